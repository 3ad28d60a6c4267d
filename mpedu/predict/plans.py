"""The planner's answer: each Candidate (a placement, schedule, micro-batch count and recomputation with
its predicted step time and memory), and Plans, the Pareto front among them, with its table and picture."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from ..core.placement import Placement
from ..pictures.planplot import plot_plans
from ..runtime.values import format_size
from .ranking import Measurement, measure


class PlanStopped(Exception):
    """plan(..., should_stop=...) said stop: the search ended before it was done (no result)."""


class NoPlanFits(ValueError):
    """No plan fits the memory cap: `smallest` is the plan with the smallest footprint found, `cap` the cap."""

    def __init__(self, message: str, smallest, cap: int):
        super().__init__(message)
        self.smallest, self.cap = smallest, cap


def as_choices(value) -> tuple:
    """A tuple of choices from a tuple or list, or from one value (a name, a count, None)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


@dataclass(frozen=True)
class Candidate:
    """One way to run a step: where the layers go, in what order, in how many pieces, with what kept."""

    placement: Placement
    schedule: str
    micro_batches: int
    chunks: int
    recompute: str | None
    step_s: float                   # predicted seconds per training step
    device_bytes: tuple[int, ...]   # predicted peak bytes per device (weights, gradients, activations)
    fits: bool = True               # every device within the memory cap
    micro_batch_sizes: tuple[int, ...] | None = None     # unequal micro-batches (sentences each); None: equal

    @property
    def peak_bytes(self) -> int:
        """The largest device's footprint: what a cap must allow."""
        return max(self.device_bytes)

    @property
    def label(self) -> str:
        chunks = f" c={self.chunks}" if self.chunks > 1 else ""
        rc = f" recompute={self.recompute}" if self.recompute else ""
        sizes = f" sizes {','.join(map(str, self.micro_batch_sizes))}" if self.micro_batch_sizes else ""
        return f"{self.schedule} m={self.micro_batches}{sizes}{chunks}{rc}"

    def pipeline(self, model, **kwargs):
        """A Pipeline that runs this candidate (extra keyword arguments go to Pipeline)."""
        from ..core.pipeline import Pipeline
        if self.recompute is not None:
            kwargs["recompute"] = self.recompute
        m = list(self.micro_batch_sizes) if self.micro_batch_sizes else self.micro_batches
        return Pipeline(model, self.placement, self.schedule, m, chunks=self.chunks, **kwargs)

    def __str__(self) -> str:
        return (f"{self.label:<40} {self.step_s * 1e3:9.1f} ms  peak {format_size(self.peak_bytes):>9}  "
                f"{self.placement}")


@dataclass
class Plans:
    """The Pareto front of a search (fastest first) and the fastest candidate under the cap."""

    front: list[Candidate]
    best: Candidate | None
    memory_cap: int | None
    searched: int                   # candidates considered
    simulated: list[Candidate] = field(default_factory=list)   # every candidate simulated, fastest first
    seconds: float = 0.0            # time the search took (profiling not included)
    # the candidates the search did not need to simulate, by time bound, and simulate's link and cores:
    # top() simulates more of them when it needs more plans that fit
    pending: list = field(default_factory=list, repr=False)
    simulate_args: tuple = (None, None)
    simulate_one: Callable | None = field(default=None, repr=False)   # (option, link, cores, cap) -> Candidate
    # `best` with micro-batches of unequal size, where that is predicted faster within the cap (else None)
    split: Candidate | None = None

    def table(self) -> str:
        cap = f"memory cap {format_size(self.memory_cap)}" if self.memory_cap else "no memory cap"
        lines = [f"Pareto front of {self.searched} candidates ({len(self.simulated)} simulated, "
                 f"{self.seconds * 1e3:.0f} ms), {cap}:"]
        for c in self.front:
            mark = "*" if c is self.best else " " if c.fits else "x"
            lines.append(f" {mark} {c}")
        lines.append("* the fastest that fits" + ("; x over the cap" if self.memory_cap else ""))
        if self.split is not None and self.best is not None:
            lines.append(f"unequal micro-batches, predicted {self.best.step_s / self.split.step_s:.2f}x as fast as *: "
                         f"{self.split}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def top(self, k: int = 5) -> list[Candidate]:
        """The k candidates to measure: the front's points that fit, fastest first, then the fastest
        other plans that fit (simulating candidates the search skipped, if it must)."""
        chosen = [c for c in self.front if c.fits][:k]
        for c in self.fastest_fitting(k):
            if len(chosen) >= k:
                break
            if all(c is not d for d in chosen):
                chosen.append(c)
        return sorted(chosen, key=lambda c: c.step_s)

    def fastest_fitting(self, k: int) -> list[Candidate]:
        """The k fastest plans within the cap, exactly: skipped candidates are simulated, in order of
        their time bound, until none left could be faster than the k-th."""
        link, cores = self.simulate_args
        while self.pending:
            fits = [c for c in self.simulated if c.fits]
            if len(fits) >= k and fits[k - 1].step_s <= self.pending[0].bound:
                break
            option = self.pending.pop(0)
            if self.memory_cap is None or option.memory_floor <= self.memory_cap:
                bisect.insort(self.simulated, self.simulate_one(option, link, cores, self.memory_cap),
                              key=lambda c: (c.step_s, c.peak_bytes))
        return [c for c in self.simulated if c.fits][:k]

    def spread(self, k: int = 4) -> list[Candidate]:
        """k plans from the front that fit, from the fastest to the smallest, evenly spaced along it: a
        ranking test among plans that differ, where the top k may all be within noise of each other."""
        fitting = [c for c in self.front if c.fits]
        if len(fitting) <= k:
            return fitting
        return [fitting[round(i * (len(fitting) - 1) / (k - 1))] for i in range(k)]

    def measure(self, model, batch, top: int = 5, steps: int = 3, warmup: int = 1,
                candidates: list[Candidate] | None = None, rounds=None) -> Measurement:
        """Run the `top` candidates for real (median of `steps` steps after `warmup`), one step of each
        in turn per round so that drifting load falls on all alike; compare with the predictions.
        `rounds`: see mpedu.predict.ranking.measure."""
        return measure(candidates if candidates is not None else self.top(top), model, batch, steps, warmup,
                       rounds, link=self.simulate_args[0])

    def plot(self, ax=None, measured: Measurement | None = None):
        """Peak memory against step time: every simulated candidate (grey), the front (line), the best
        (star), the cap (dashed), and measured points beside their predictions when given."""
        return plot_plans(self, ax, measured)
