"""Every rank's actions in one step, gathered into one Timeline (mpedu.runtime.clock's Clock marks the times)."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.timeline import ALL_REDUCE, Event, Timeline
from ..runtime.clock import Clock

__all__ = ["ALL_REDUCE", "Recorder", "merge", "shared_origin"]


def shared_origin(rounds: int = 9, same_host: bool | None = None) -> float:
    """This rank's `time.perf_counter()` reading of one moment common to every rank (a collective: all call it).

    Times measured from it put every rank's rows on one axis. On one machine all processes read the
    same monotonic clock, so rank 0's reading is everyone's: exact (a barrier's exit instead would be
    off by how late each process was scheduled: milliseconds with 4 processes on 2 cores, enough to
    draw a receiver computing before its input was sent). Across machines the clocks differ by an
    unknown offset, estimated as the least (arrival - rank 0's sending time) over `rounds` broadcasts
    of rank 0's clock: off by the quickest broadcast's latency. `same_host`: None asks the ranks.
    """
    if same_host is None:       # one machine: one host name and one boot (cloned VMs may share a name)
        boot = Path("/proc/sys/kernel/random/boot_id")
        here = (socket.gethostname(), boot.read_text().strip() if boot.exists() else "")
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, here)
        same_host = len(set(hosts)) == 1
    if same_host:
        origin = [time.perf_counter()]
        dist.broadcast_object_list(origin, src=0)
        return origin[0]
    offsets = []
    for _ in range(rounds):
        dist.barrier()
        sent = [time.perf_counter()]
        dist.broadcast_object_list(sent, src=0)
        offsets.append(time.perf_counter() - sent[0])
    return sent[0] + (min(offsets) if dist.get_rank() else 0.0)   # rank 0's own reading is the origin


class Recorder:
    """This rank's actions in one step, as (kind, stage, mb, start, end, bytes, peer).

    Times are seconds since `t_base`, one moment common to every rank (`shared_origin`), so
    rows of different ranks line up. On a GPU, marks are CUDA events, read after the step.
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
