"""Zero bubble under a memory cap: a schedule built for a limit on the micro-batches each device may hold.

The zero-bubble family trades memory for bubble: ZB-H1 holds what 1F1B holds and idles a third as long, ZB-H2
holds about twice as much and idles almost never, the V-shapes go lower. Here the limit is a knob: `cap`
micro-batches per device, any whole number from 1 up, and the order is found by playing the step ahead of time,
tick by tick, at given costs (textbook F = B = W = 1 unless told):

    whenever a device is free, it runs, among the actions it may start now,
        1. a B (an input gradient: the stage before waits for it), the oldest micro-batch first;
        2. an F of a micro-batch it already holds (its later stage, on a V), then an F of a new one while it
           holds fewer than `cap`;
        3. a W (a weight gradient: nobody waits for it, so it fills what would be idle), the oldest first;
    and when nothing may start it waits for the next action to end anywhere.

A device holds a micro-batch from its first forward there until the last W of it there: its activations stay
until then. Holding none costs nothing, so a new micro-batch can always start (`cap` >= 1 never deadlocks: the
oldest micro-batch can always move). On one stage per device, cap = p holds what 1F1B holds on device 0, and
cap = 1 one micro-batch at a time; on 4 devices at m = 8 (unit costs) cap 1 takes 72 ticks, cap 4 29, and cap 5
or more ZB-H1's 27.

    2 devices, m = 4, F = B = W = 1:
        cap 1   device 0   0F0 0B0 0W0 0F1 0B1 0W1 ..       20 ticks: one micro-batch at a time on each device
        cap 2   device 0   0F0 0F1 0B0 0W0 0B1 0F2 0W1 ..   13 ticks: ZB-H1's memory and ZB-H1's length
"""
from __future__ import annotations

import heapq
from typing import Callable

from .actions import Action, B, F, Schedule, W


def zb_capped(stage_devices, m: int, cap: int, cost: Callable[[str, int], float] | None = None) -> Schedule:
    """The zero-bubble order for `stage_devices` and m micro-batches in which no device holds more than `cap`
    micro-batches at once (see the module's docstring for the rule). `cost(kind, stage)`: how long an action
    takes (default 1 for F, B and W alike), so a planner can build it for measured costs."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap={cap!r}: the micro-batches a device may hold at once, a whole number >= 1 (1 runs "
                         "one micro-batch at a time; the number of devices holds what 1F1B holds)")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m={m!r}: the number of micro-batches, a whole number >= 1")
    play = _Play(tuple(stage_devices), m, cap, cost or (lambda kind, stage: 1.0))
    while any(play.todo.values()):
        started = [play.start(d, a) for d in range(play.p)
                   if play.todo[d] and play.free[d] <= play.now and (a := play.choose(d)) is not None]
        if not started:             # nobody may start now: on to the next moment an action ends
            play.wait()
    return Schedule(f"zb_cap{cap}", play.stage_devices, m, play.rows,
                    split_backward=frozenset(range(play.n))).validate()


class _Play:
    """The step played ahead at given costs: what each device has run, holds and has left, and the clock."""

    def __init__(self, stage_devices: tuple, m: int, cap: int, cost):
        self.stage_devices, self.m, self.cap, self.cost = stage_devices, m, cap, cost
        self.n, self.p = len(stage_devices), max(stage_devices) + 1
        self.mine = [[s for s in range(self.n) if stage_devices[s] == d] for d in range(self.p)]
        self.first = [min(stages) for stages in self.mine]          # a micro-batch starts on d at its first stage
        self.end: dict[Action, float] = {}                          # action -> when it ends
        self.rows: list[list[Action]] = [[] for _ in range(self.p)]
        self.free = [0.0] * self.p                                  # when each device is next free
        self.held = [set() for _ in range(self.p)]                  # micro-batches each device holds
        self.w_left = [{} for _ in range(self.p)]                   # mb -> its W's still to run on the device
        self.todo = {d: 3 * m * len(self.mine[d]) for d in range(self.p)}   # F, B and W of each micro-batch-stage
        self.ends: list[float] = [0.0]                              # the times at which something ends (a heap)
        self.now = 0.0

    def deps(self, a: Action) -> list[Action]:
        if a.kind == "F":
            return [F(a.stage - 1, a.mb)] if a.stage > 0 else []
        if a.kind == "B":
            return [F(a.stage, a.mb)] + ([B(a.stage + 1, a.mb)] if a.stage < self.n - 1 else [])
        return [B(a.stage, a.mb)]

    def ready(self, a: Action) -> bool:
        return a not in self.end and all(self.end.get(x, self.now + 1) <= self.now for x in self.deps(a))

    def choose(self, d: int) -> Action | None:
        """The rule: a B, the oldest first; an F of a micro-batch d holds; a new one under the cap; a W."""
        mine, m = self.mine[d], self.m
        pick = next((a for a in (B(s, i) for i in range(m) for s in reversed(mine)) if self.ready(a)), None)
        if pick is None:
            ongoing = (F(s, i) for i in sorted(self.held[d]) for s in mine if s != self.first[d])
            pick = next((a for a in ongoing if self.ready(a)), None)
        if pick is None and len(self.held[d]) < self.cap:
            pick = next((F(self.first[d], i) for i in range(m) if self.ready(F(self.first[d], i))), None)
        if pick is None:
            waiting = [W(s, i) for i in sorted(self.w_left[d]) for s in sorted(self.w_left[d][i])
                       if B(s, i) in self.end and self.end[B(s, i)] <= self.now]
            pick = waiting[0] if waiting else None
        return pick

    def start(self, d: int, a: Action) -> Action:
        """Device d runs `a` now: note it, when it ends, and what d holds after it."""
        self.rows[d].append(a)
        self.end[a] = self.free[d] = self.now + self.cost(a.kind, a.stage)
        heapq.heappush(self.ends, self.end[a])
        self.todo[d] -= 1
        if a.kind == "F" and a.stage == self.first[d]:
            self.held[d].add(a.mb)
            self.w_left[d][a.mb] = set(self.mine[d])
        elif a.kind == "W":
            self.w_left[d][a.mb].discard(a.stage)
            if not self.w_left[d][a.mb]:
                del self.w_left[d][a.mb]
                self.held[d].discard(a.mb)
        return a

    def wait(self) -> None:
        """On to the next moment an action ends."""
        while self.ends and self.ends[0] <= self.now:
            heapq.heappop(self.ends)
        if not self.ends:
            raise RuntimeError(f"zb_capped found nothing to run for stage devices {list(self.stage_devices)}, "
                               f"m={self.m}, cap={self.cap}: a bug, please report it")
        self.now = self.ends[0]
