"""What overlapping DualPipeV's F || B pairs would save on GPUs: the step played with and without overlap."""
from __future__ import annotations

from typing import NamedTuple

from .simulator import simulate


class OverlapSaving(NamedTuple):
    sequential: float    # seconds per step, each pair one action after the other (what mpedu's engine runs)
    overlapped: float    # seconds per step, each pair one box of max(F, B)
    share: float         # 1 - overlapped / sequential: the share of the step overlap would save


def overlap_saving(schedule, costs, placement=None, **options) -> OverlapSaving:
    """The predicted step without and with overlapped pairs, and the share of the step overlap saves:

        overlap_saving(make("dualpipev", [0, 1, 1, 0], 8), [StageCost(1.0)] * 4)   # 49 -> 38 ticks: 22%
        overlap_saving(pipe, costs)                                 # a Pipeline's own plan, its link
        overlap_saving(schedule, costs, placement, link="pcie4")

    Arguments as for simulate (a Schedule, a Pipeline or a schedule name; options such as micro_batches=,
    link=, speed=). With overlap a pair is one box lasting max(F, B) once both its inputs are in: the most
    two CUDA streams could hide, so the share is an upper bound for a GPU. It can be negative: a pair waits for
    both inputs, where in turn its first action would run while the second's input is still on its way.
    mpedu's engine (virtual devices, CPU threads) always runs the pair in turn, as the first number does; the
    second is a prediction only. A schedule without pairs saves 0.
    """
    if "overlap" in options:
        raise TypeError("overlap_saving plays the step both ways itself; leave out overlap=")
    sequential = simulate(schedule, costs, placement, **options).makespan
    overlapped = simulate(schedule, costs, placement, overlap=True, **options).makespan
    return OverlapSaving(sequential, overlapped, 1.0 - overlapped / sequential if sequential > 0 else 0.0)

