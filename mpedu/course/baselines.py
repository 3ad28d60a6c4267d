"""Baselines: a pipeline's speed measured beside one virtual device and one device with every core, in turn.

Does the pipeline pay? Two answers, both honest, measured on the same batches at the end of a run:

    this pipeline          p virtual devices, one core each (p cores in all)
    one virtual device     the whole model on one core: what the pipeline's cores would do one at a time
    one device, all cores  the whole model on `cpu` with PyTorch's intra-op threads (every core splits
                           each operation): what `--devices 1` runs

The first comparison is the course's: pipelining p cores against one. The second is the one a user
meets on a laptop: PyTorch already spreads one large operation over the cores, and on a CPU that
often beats a pipeline, whose stages wait for one another (the bubble) and hand tensors over.

Each runner trains (forward and backward, no optimizer step) on a copy of the model, so the trained
weights are untouched; runners take turns round by round, and each figure is the median of its rounds,
so a machine whose speed drifts moves all three alike.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from ..core.pipeline import Pipeline
from ..core.placement import Placement
from ..core.runner import fit_width
from ..core.single import SingleDevice
from ..runtime.devices import usable_cores
from .wording import plural

ROUNDS = 3


@dataclass(frozen=True)
class Baselines:
    """Tokens per second of the three runners, each the median of `rounds` rounds run in turn."""

    pipeline: float
    one_virtual_device: float
    all_cores: float
    threads: int                   # the intra-op threads of "one device, all cores"
    devices: int                   # the pipeline's virtual devices
    rounds: int

    @property
    def speedup(self) -> float:
        """The pipeline's tokens/s over one virtual device's."""
        return self.pipeline / self.one_virtual_device

    def lines(self) -> list[str]:
        against = self.pipeline / self.all_cores
        return [
            f"measured after training, {self.rounds} rounds in turn on the same batches: this pipeline on "
            f"{self.devices} virtual devices (a core each) {self.pipeline:,.0f} tokens/s",
            f"  one virtual device (the whole model on one core): {self.one_virtual_device:,.0f} tokens/s, "
            f"so the pipeline is {self.speedup:.2f}x as fast",
            f"  one device with all cores ({plural(self.threads, 'intra-op thread')}, as --devices 1 runs): "
            f"{self.all_cores:,.0f} tokens/s, so the pipeline is {against:.2f}x as fast"
            + ("" if against >= 1 else ": on a CPU, PyTorch's threads split each operation with no bubble "
               "and no hand-off"),
        ]

    def summary(self) -> dict:
        return {"tokens_per_s_pipeline": round(self.pipeline, 1),
                "tokens_per_s_one_virtual_device": round(self.one_virtual_device, 1),
                "tokens_per_s_one_device_all_cores": round(self.all_cores, 1),
                "intra_op_threads_all_cores": self.threads,
                "pipeline_vs_one_virtual_device": round(self.speedup, 3),
                "pipeline_vs_one_device_all_cores": round(self.pipeline / self.all_cores, 3)}


def measure_baselines(pipe: Pipeline, batches, rounds: int = ROUNDS) -> Baselines:
    """Time `pipe`'s placement and schedule, one virtual device and one all-cores device on `batches`
    (a few, a list), round by round in turn, each runner on its own copy of `pipe.model`."""
    batches = [fit_width(b, pipe.micro_batches) for b in batches]     # as training feeds the pipeline
    if not batches:
        raise ValueError("measure_baselines needs at least one batch")
    model = pipe.model
    runners = {
        "pipeline": Pipeline(copy.deepcopy(model), pipe.placement, pipe.schedule, micro_batches=pipe.micro_batches,
                             chunks=pipe.chunks, link=pipe.link, recompute=pipe.recompute),
        "one_virtual_device": Pipeline(copy.deepcopy(model), Placement.single(model), "naive", micro_batches=1),
        "all_cores": SingleDevice(copy.deepcopy(model)),
    }
    tokens = sum(b.tokens for b in batches)
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    # every core as an intra-op thread for the all-cores device: a virtual device's worker sets the
    # process's count to 1, which a thread that starts parallel work later would take
    threads, before = len(usable_cores()), torch.get_num_threads()
    try:
        for r in range(rounds + 1):                 # round 0 warms each runner up (first steps allocate)
            for name, runner in runners.items():
                torch.set_num_threads(threads if name == "all_cores" else before)
                start = time.perf_counter()
                for batch in batches:
                    runner.train_step(batch)
                seconds = time.perf_counter() - start
                if r:
                    speeds[name].append(tokens / seconds)
    finally:
        torch.set_num_threads(before)
        for runner in runners.values():
            runner.close()
    median = {name: statistics.median(v) for name, v in speeds.items()}
    return Baselines(median["pipeline"], median["one_virtual_device"], median["all_cores"],
                     threads=threads, devices=len(pipe.devices), rounds=rounds)
