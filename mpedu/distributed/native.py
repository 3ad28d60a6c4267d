"""PyTorch's own schedule classes for mpedu's schedule names (`--runtime torch`), to compare with the bridge.

mpedu.distributed runs mpedu's own action lists through the bridge (mpedu.distributed.bridge).
This module answers a different question: which of PyTorch's hand-written schedule classes
implements the same idea, so the two can be set side by side (and the bench can time PyTorch's
own code). Names are read by mpedu.core.schedules.canonical, so the aliases are mpedu's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ..core.schedules import canonical, is_round_robin

NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb1")    # those PyTorch has a class for

ROUND_ROBIN_HINT = ("Round-robin means: cut the layers into v * p consecutive groups and give group k to "
                    "rank k % p; for 2 ranks and 4 groups: 'G0:rank0 | G1:rank1 | G2:rank0 | G3:rank1', "
                    "where G0..G3 are runs of your model's layers (see model.layer_names)")


def layout(stage_ranks: list[int]) -> str:
    """"single" (one stage per rank), "looped" (stage s on rank s % p), "v" or "other"."""
    p, n = max(stage_ranks) + 1, len(stage_ranks)
    if n == p:
        return "single"
    if is_round_robin(stage_ranks):
        return "looped"
    if n == 2 * p and stage_ranks == list(range(p)) + list(reversed(range(p))):
        return "v"
    return "other"


@dataclass(frozen=True)
class TorchPlan:
    """Which PyTorch schedule runs an mpedu schedule, and with how many micro-batches per step() call."""

    schedule: str          # mpedu's name
    cls: type              # a torch.distributed.pipelining schedule class
    per_call: int          # micro-batches per step() call; naive: 1, called m times
    layout: str            # "single" (one stage per rank) or "looped" (stage s on rank s % p)

    @property
    def multi(self) -> bool:
        """Whether the class takes a list of stages (all but GPipe and 1F1B do, even for one stage)."""
        return not issubclass(self.cls, PipelineScheduleSingle)


def plan_schedule(schedule: str, stage_ranks: list[int], m: int) -> TorchPlan:
    """Map an mpedu schedule name and a stage -> rank layout to a torch schedule class.

        naive        GPipe with 1 micro-batch per step() call, called m times (one in flight)
        gpipe        ScheduleGPipe; several stages per rank: ScheduleLoopedBFS
        1f1b         Schedule1F1B;  several stages per rank: ScheduleInterleaved1F1B
        interleaved  ScheduleInterleaved1F1B (needs v >= 2 stages per rank, round-robin)
        zb1          ScheduleInterleavedZeroBubble (one stage per rank, or round-robin)
    """
    try:
        key = canonical(schedule)
    except ValueError:
        key = None
    if key in ("zbv", "dualpipev"):
        raise ValueError(f"--runtime torch --schedule {schedule}: mpedu does not run PyTorch's own "
                         f"{'ScheduleZBVZeroBubble' if key == 'zbv' else 'ScheduleDualPipeV'}, whose eval() fails in "
                         f"torch {torch.__version__} (the rank holding two adjacent stages hands over a gradient "
                         f"that evaluation has not got); mpedu's {key} is its order action for action: leave "
                         "--runtime at mpedu")
    if key not in NAMES:
        raise ValueError(f"unknown schedule {schedule!r} among PyTorch's own classes; choose one of "
                         f"{', '.join(NAMES)} (mpedu's own action lists run any schedule: leave --runtime at mpedu)")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"micro_batches must be a whole number >= 1, got {m!r}")
    shape = layout(list(stage_ranks))
    if shape in ("v", "other"):
        why = ("a V (stage s and stage 2p-1-s on one rank) is what PyTorch's ZBV schedule wants, but in torch "
               f"{torch.__version__} ScheduleZBVZeroBubble cannot evaluate (eval() fails), so --runtime torch does not "
               "offer it (mpedu's zbv and dualpipev run the V with --runtime mpedu)"
               if shape == "v" else "PyTorch's multi-stage schedules put stage s on rank s % p")
        raise ValueError(f"stage ranks {list(stage_ranks)}: each rank must hold one stage, or stages dealt "
                         f"round-robin (stage s on rank s % p); {why}. {ROUND_ROBIN_HINT}")
    table = {
        ("naive", "single"): pp.ScheduleGPipe, ("naive", "looped"): pp.ScheduleLoopedBFS,
        ("gpipe", "single"): pp.ScheduleGPipe, ("gpipe", "looped"): pp.ScheduleLoopedBFS,
        ("1f1b", "single"): pp.Schedule1F1B, ("1f1b", "looped"): pp.ScheduleInterleaved1F1B,
        ("interleaved", "looped"): pp.ScheduleInterleaved1F1B,
        ("zb1", "single"): pp.ScheduleInterleavedZeroBubble, ("zb1", "looped"): pp.ScheduleInterleavedZeroBubble,
    }
    if (key, shape) not in table:   # interleaved on one stage per rank
        raise ValueError(f"interleaved needs each rank to hold v >= 2 stages dealt round-robin, but stage ranks "
                         f"{list(stage_ranks)} give one stage per rank; use 1f1b, or deal the stages round-robin. "
                         f"{ROUND_ROBIN_HINT}")
    cls = table[key, shape]
    p = max(stage_ranks) + 1
    rounds = max(1, m // p)
    if cls in (pp.ScheduleInterleaved1F1B, pp.ScheduleInterleavedZeroBubble) and m % rounds:
        # PyTorch runs these in max(1, m // p) equal rounds of micro-batches and refuses a remainder
        good = sorted({k for k in range(1, 2 * max(m, p) + 1) if k % max(1, k // p) == 0} - {m})
        near = sorted(sorted(good, key=lambda k: abs(k - m))[:3])
        raise ValueError(f"{cls.__name__} splits the m micro-batches into max(1, m // p) = {rounds} equal rounds "
                         f"on p={p} ranks, and m={m} does not divide into {rounds}; use --micro-batches "
                         f"{' or '.join(map(str, near))}")
    return TorchPlan(key, cls, 1 if key == "naive" else m, shape)
