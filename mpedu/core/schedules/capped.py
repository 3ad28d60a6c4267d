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
    stage_devices = tuple(stage_devices)
    n, p = len(stage_devices), max(stage_devices) + 1
    cost = cost or (lambda kind, stage: 1.0)
    mine = [[s for s in range(n) if stage_devices[s] == d] for d in range(p)]
    first = [min(stages) for stages in mine]                       # a micro-batch starts on d at its first stage
    end: dict[Action, float] = {}                                  # action -> when it ends
    rows: list[list[Action]] = [[] for _ in range(p)]
    free = [0.0] * p                                               # when each device is next free
    held = [set() for _ in range(p)]                               # micro-batches each device holds
    w_left = [{} for _ in range(p)]                                # mb -> its W's still to run on the device
    todo = {d: 3 * m * len(mine[d]) for d in range(p)}              # F, B and W of each micro-batch-stage
    ends: list[float] = [0.0]                                      # the times at which something ends (a heap)

    def deps(a: Action) -> list[Action]:
        if a.kind == "F":
            return [F(a.stage - 1, a.mb)] if a.stage > 0 else []
        if a.kind == "B":
            return [F(a.stage, a.mb)] + ([B(a.stage + 1, a.mb)] if a.stage < n - 1 else [])
        return [B(a.stage, a.mb)]

    def ready(a: Action, now: float) -> bool:
        return a not in end and all(end.get(x, now + 1) <= now for x in deps(a))

    def choose(d: int, now: float) -> Action | None:
        backwards = [B(s, i) for i in range(m) for s in reversed(mine[d])]
        pick = next((a for a in backwards if ready(a, now)), None)
        if pick is None:
            ongoing = [F(s, i) for i in sorted(held[d]) for s in mine[d] if s != first[d]]
            pick = next((a for a in ongoing if ready(a, now)), None)
        if pick is None and len(held[d]) < cap:
            pick = next((F(first[d], i) for i in range(m) if ready(F(first[d], i), now)), None)
        if pick is None:
            waiting = [W(s, i) for i in sorted(w_left[d]) for s in sorted(w_left[d][i]) if B(s, i) in end
                       and end[B(s, i)] <= now]
            pick = waiting[0] if waiting else None
        return pick

    now = 0.0
    while any(todo.values()):
        moved = False
        for d in range(p):
            a = choose(d, now) if todo[d] and free[d] <= now else None
            if a is None:
                continue
            rows[d].append(a)
            end[a] = free[d] = now + cost(a.kind, a.stage)
            heapq.heappush(ends, end[a])
            todo[d] -= 1
            moved = True
            if a.kind == "F" and a.stage == first[d]:
                held[d].add(a.mb)
                w_left[d][a.mb] = set(mine[d])
            elif a.kind == "W":
                w_left[d][a.mb].discard(a.stage)
                if not w_left[d][a.mb]:
                    del w_left[d][a.mb]
                    held[d].discard(a.mb)
        if not moved:            # nobody may start now: on to the next moment an action ends
            while ends and ends[0] <= now:
                heapq.heappop(ends)
            if not ends:
                raise RuntimeError(f"zb_capped found nothing to run for stage devices {list(stage_devices)}, m={m}, "
                                   f"cap={cap}: a bug, please report it")
            now = ends[0]
    return Schedule(f"zb_cap{cap}", stage_devices, m, rows, split_backward=frozenset(range(n))).validate()
