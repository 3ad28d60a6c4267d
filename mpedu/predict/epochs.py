"""Predict a whole epoch of mixed buckets: one simulated step per (T, B) shape, weighted by how many batches have it."""
from __future__ import annotations

from typing import Mapping

from ..core import schedules
from .simulator import simulate


class EpochPrediction:
    """Predicted seconds of an epoch of batches of mixed shapes: per (T, B) shape, how many batches and
    the predicted step of one."""

    def __init__(self, per_shape: dict):
        self.per_shape = per_shape          # (T, B) -> (batches, seconds per step, what ran it)

    @property
    def total_s(self) -> float:
        return sum(count * step for count, step, _ in self.per_shape.values())

    @property
    def batches(self) -> int:
        return sum(count for count, _, _ in self.per_shape.values())

    def table(self) -> str:
        lines = [f"{'T':>5}{'B':>5}{'batches':>9}{'step ms':>10}{'total s':>9}  plan"]
        for (T, B), (count, step, how) in sorted(self.per_shape.items()):
            lines.append(f"{T:>5}{B:>5}{count:>9}{step * 1e3:>10.1f}{count * step:>9.2f}  {how}")
        lines.append(f"epoch: {self.batches} batches, {self.total_s:.2f} s predicted")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def predict_epoch(batches, curve, plan, **simulate_args) -> EpochPrediction:
    """Predict an epoch of `batches` (a BucketIterator, Batches, or (T, B) shapes), each step simulated
    with the costs of its own micro-batch shape, `curve.at(T, B / m)` (a costcurve.CostCurve).

    plan: what runs each step: a Pipeline, or anything with placement, schedule, micro_batches, chunks
    (and optionally recompute, and micro_batch_sizes for unequal micro-batches, each then read at its own
    width), e.g. a planner Candidate; or a dict {T: such} to run each bucket length its own way (the
    planner's per-bucket choice). One simulation per distinct shape.
    """
    counts: dict = {}
    for b in batches:
        shape = tuple(b.inputs.shape) if hasattr(b, "inputs") else tuple(b)
        counts[shape] = counts.get(shape, 0) + 1
    per_shape = {}
    for (T, B), count in counts.items():
        how = plan.get(T) if isinstance(plan, Mapping) else plan
        if how is None:
            raise ValueError(f"the plan has no entry for bucket length T={T}; give one for each of "
                             f"{sorted({t for t, _ in counts})}")
        m, sizes = how.micro_batches, getattr(how, "micro_batch_sizes", None)
        if sizes is not None and sum(sizes) != B:
            raise ValueError(f"a batch of B={B} columns (T={T}) does not split into micro-batches of sizes "
                             f"{list(sizes)}, which add up to {sum(sizes)}; use BucketIterator(drop_last=True) so "
                             "every batch is full")
        if sizes is None and B % m:
            raise ValueError(f"a batch of B={B} columns (T={T}) does not split into micro_batches={m}; "
                             "use BucketIterator(drop_last=True) so every batch is full, or a divisor of "
                             f"{B}")
        name = how.schedule if isinstance(how.schedule, str) else how.schedule.name
        schedule = schedules.make(name, how.placement.stage_devices, m, how.chunks)
        extra = {"recompute": how.recompute} if getattr(how, "recompute", None) is not None else {}
        if sizes is not None:
            extra["micro_batches"] = list(sizes)
            costs = [curve.at(T, b, how.chunks) for b in sizes]
        else:
            costs = curve.at(T, B // m, how.chunks)
        step = simulate(schedule, costs, how.placement, **extra, **simulate_args).makespan
        rc = getattr(how, "recompute", None)
        if rc is not None and not isinstance(rc, str):                 # a Pipeline's mode per stage
            modes = set(rc.values() if isinstance(rc, Mapping) else rc)
            rc = modes.pop() if len(modes) == 1 else "per stage"
        split = m if sizes is None else list(sizes)
        per_shape[T, B] = (count, step, f"{name} m={split}" + (f" c={how.chunks}" if how.chunks > 1 else "")
                           + (f" recompute={rc}" if rc else ""))
    return EpochPrediction(per_shape)
