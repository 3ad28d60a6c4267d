"""Every rank's actions in one step, gathered into one Timeline (mpedu.clock's Clock marks the times)."""
from __future__ import annotations

import torch

from ..clock import Clock
from ..timeline import ALL_REDUCE, Event, Timeline

__all__ = ["ALL_REDUCE", "Recorder", "merge"]


class Recorder:
    """This rank's actions in one step, as (kind, stage, mb, start, end, bytes, peer).

    Times are seconds since `t_base`, taken right after a barrier on every rank, so
    rows of different ranks line up (to the barrier's skew, well under a millisecond
    on one machine). On a GPU, marks are CUDA events, read after the step.
    """

    def __init__(self, device: torch.device, t_base: float):
        self.device = device
        self.t_base = t_base
        self.enabled = True
        self.mb_offset = 0          # torch's own naive: the k-th step() call runs micro-batch k
        self.marks: list[list] = []
        self.clock: Clock | None = None

    def start_step(self) -> None:
        self.marks.clear()
        if self.enabled:
            self.clock = Clock(self.device, self.t_base)

    def now(self):
        return self.clock.mark() if self.enabled and self.clock is not None else 0.0

    def add(self, kind: str, stage: int, mb: int, start, end, nbytes: int = 0, peer: str = "") -> None:
        if self.enabled:
            self.marks.append([kind, stage, mb + self.mb_offset, start, end, nbytes, peer])

    def extend_forward(self, end) -> None:
        """The last stage's loss runs right after its forward: count it in that F box."""
        for mark in reversed(self.marks):
            if mark[0] == "F":
                mark[4] = end
                return

    def events(self) -> list[tuple]:
        if self.clock is None or not self.marks:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sec = self.clock.seconds
        return [(k, s, i, sec(a), sec(b), n, peer) for k, s, i, a, b, n, peer in self.marks]


def merge(gathered: list[list[tuple]], devices: list[str]) -> Timeline:
    """Every rank's events (gathered[r] from rank r) into one Timeline starting at 0."""
    events = [(r, e) for r, evs in enumerate(gathered) for e in evs]
    t0 = min((e[3] for _, e in events), default=0.0)
    timeline = Timeline(list(devices))
    for r, (kind, stage, mb, start, end, nbytes, peer) in events:
        timeline.add(Event(device=devices[r], kind=kind, stage=stage, mb=mb, start=start - t0, end=end - t0,
                           bytes=nbytes, peer=peer))
    return timeline
