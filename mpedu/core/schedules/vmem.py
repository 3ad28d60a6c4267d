"""V-Half and V-Min: V-shapes that hold less than ZB-V (Qi et al., 2024, "Pipeline Parallelism with Controllable
Memory"), built from a building block repeated every 6 ticks, then squeezed at both ends.

The V placement as in zbv: device r holds stage r on the way down and stage 2p-1-r on the way back up. Every
backward is split into B (input gradient) and W (weight gradient). At unit costs (F = B = W = 1 tick per stage)
a device has 6 actions per micro-batch: F down, F up, B up, B down and their two W's.

    block     micro-batch 0's ticks on each device (F down, F up, B up, B down); micro-batch i runs 6i ticks
              later. How fast the block goes down and back up sets how long a device holds a micro-batch-stage
              (from its F to its W), and so the memory:
        v_half    F down 2 ticks a device, F up 1, B up 2, B down 1: device r holds its two stages for about
                  6p ticks in all, about p micro-batch-stages at once: half of 1F1B's 2p
        v_min     1 tick a device all the way: about 4p ticks, 2p/3 micro-batch-stages: a third of 1F1B's
              A gap before B up (the smallest that puts a device's four actions on four different ticks of the 6)
              keeps them apart; the two ticks of each 6 left free take the W's.
    squeeze   In the warm-up (before device 0's first backward of stage 0) and the cool-down (after its last
              forward of stage 0) the block leaves ticks empty. There each F and B, in tick order, moves to the
              earliest free tick after its dependencies (and after its kind's previous micro-batch) at which its
              device's peak stays within the block's own: the memory limit (`held_limit`).
    W's       Every free tick runs the W of the oldest B waiting, so memory is freed as soon as it can be.

A device's row is its actions by tick (the simulator plays it, without the empty ticks).

    2 devices, m = 4, F = B = W = 1 (on 2 devices neither holds less than ZB-V: the blocks are too short to save):
        v_half   25 ticks, at most 4 micro-batch-stages held, ZB-V's length and memory in another order
            device 0   0F0 0F1 3F0 3B0 3F1 3W0 0F2 0B0 3B1 0W0 3F2 3W1 0F3 0B1 3B2 0W1 3F3 3B3 0B2 3W2 0B3 ..
        v_min    27 ticks, at most 3 micro-batch-stages held on device 0, 4 on device 1
            device 0   0F0 0F1 3F0 3B0 3W0 0B0 0W0 3F1 3B1 3W1 0F2 0B1 0W1 3F2 3B2 3W2 0F3 0B2 0W2 3F3 ..
    4 devices, m >= 6: v_half 6m + 5 ticks holding 6 micro-batch-stages per device (0.28 of 1F1B's idle 6(p - 1)
    = 18 ticks, at 3/4 of its 2p = 8); v_min (m >= 4) 6m + 11 holding 4 (0.61 at 1/2); ZB-V 6m + 3 holding 8.
"""
from __future__ import annotations

from .actions import Action, B, F, Schedule, W
from .vshapes import _v_devices

PERIOD = 6               # ticks between two micro-batches' blocks: F, B and W of two stages at unit costs


def _rhythm(name: str, p: int, r: int, g: int) -> tuple[int, int, int, int]:
    """Micro-batch 0's ticks on device r with a gap of g: (F down, F up, B up, B down)."""
    if name == "v_half":       # down 2 ticks a device, turn on device p-1, up 1 a device; backward the same
        return 2 * r, 3 * p - 2 - r, 3 * p - 1 + g + 2 * r, 6 * p - 2 + g - r
    return r, 2 * p - 1 - r, 2 * p + g + r, 4 * p - 1 + g - r          # v_min: 1 tick a device both ways


def block(name: str, p: int) -> list[tuple[int, int, int, int]]:
    """Each device's (F down, F up, B up, B down) ticks of micro-batch 0, with the smallest gap before B up that
    puts a device's four actions on four different ticks of every 6."""
    for g in range(PERIOD * 2):
        ticks = [_rhythm(name, p, r, g) for r in range(p)]
        if all(len({t % PERIOD for t in row}) == 4 for row in ticks):
            return ticks
    raise AssertionError(f"{name}: no gap separates the block's actions on {p} devices")   # never for p >= 1


def min_micro_batches(name: str, p: int) -> int:
    """The fewest micro-batches for which the block reaches its steady phase: device 0 is still starting
    micro-batches (its last forward of stage 0, at tick 6(m - 1)) after the first one's backward has come back to
    stage 0 (at the block's B-down tick on device 0)."""
    return block(name, p)[0][3] // PERIOD + 2


def _peak(row: dict[int, Action]) -> int:
    """The most micro-batch-stages a device holds when it runs `row` (tick -> F or B) and every free tick runs
    the W of the oldest B waiting: +1 at each F, -1 at each W."""
    held = peak = waiting = 0
    for t in range(max(row, default=-1) + 1):
        a = row.get(t)
        if a is None:
            if waiting:
                waiting, held = waiting - 1, held - 1
        elif a.kind == "F":
            held += 1
        else:
            waiting += 1
        peak = max(peak, held)
    return peak


def _with_ws(row: dict[int, Action]) -> list[Action]:
    """The row by tick, every free tick (and then the end) taking the W of the oldest B waiting."""
    out: list[Action] = []
    waiting: list[Action] = []
    for t in range(max(row, default=-1) + 1):
        a = row.get(t)
        if a is None:
            if waiting:
                out.append(waiting.pop(0))
            continue
        out.append(a)
        if a.kind == "B":
            waiting.append(W(a.stage, a.mb))
    return out + waiting


def _controlled(name: str, stage_devices, m: int) -> tuple[Schedule, int]:
    """The schedule and its memory limit (micro-batch-stages per device)."""
    p = _v_devices(name, stage_devices)
    _check_micro_batches(name, p, m)
    n = 2 * p
    when: dict[Action, int] = {}
    rows: list[dict[int, Action]] = [{} for _ in range(p)]
    for r, (f_down, f_up, b_up, b_down) in enumerate(block(name, p)):
        down, up = r, n - 1 - r
        for i in range(m):
            for a, t in ((F(down, i), f_down), (F(up, i), f_up), (B(up, i), b_up), (B(down, i), b_down)):
                when[a] = t + PERIOD * i
                rows[r][when[a]] = a
    limit = max(_peak(row) for row in rows)
    _squeeze(when, rows, stage_devices, m, limit)
    schedule = Schedule(name, tuple(stage_devices), m, [_with_ws(row) for row in rows],
                        split_backward=frozenset(range(n)))
    return schedule, limit


def _check_micro_batches(name: str, p: int, m: int) -> None:
    """Refuse an m the block cannot reach its steady phase with, saying which m it needs."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m={m!r}: the number of micro-batches, a whole number >= 1")
    need = min_micro_batches(name, p)
    if m < need:
        first_back = block(name, p)[0][3]
        raise ValueError(f"{name} needs at least {need} micro-batches on {p} devices, got m={m}: its block starts "
                         f"a micro-batch every {PERIOD} ticks, and the first one's backward comes back to stage 0 at "
                         f"tick {first_back}; device 0 must still be starting micro-batches then (its last start, at "
                         f"tick {PERIOD}(m - 1), after tick {first_back}: m >= {first_back} // {PERIOD} + 2 = {need}). "
                         f"Use micro_batches >= {need}, or zbv (any m), or zb_cap<k> on the V to hold at most k "
                         "micro-batches per device")


def _squeeze(when: dict, rows: list, stage_devices, m: int, limit: int) -> None:
    """The warm-up and the cool-down squeezed, in place: in tick order, each F and B outside the steady phase
    moves to the earliest free tick after its dependencies at which its device stays within `limit`."""
    n = len(stage_devices)

    def deps(a: Action) -> list[Action]:
        if a.kind == "F":
            own = [F(a.stage - 1, a.mb)] if a.stage > 0 else []
        else:
            own = [F(a.stage, a.mb)] + ([B(a.stage + 1, a.mb)] if a.stage < n - 1 else [])
        return own + ([Action(a.kind, a.stage, a.mb - 1)] if a.mb > 0 else [])

    taken: list[set[int]] = [set() for _ in rows]          # ticks of the actions already placed
    phase = "warm-up"
    for a in sorted(when, key=lambda a: (when[a], stage_devices[a.stage])):
        d, t0 = stage_devices[a.stage], when[a]
        if phase == "warm-up" and a == B(0, 0):
            phase = "steady"
        if phase == "steady":
            if a == F(0, m - 1):
                phase = "cool-down"
            taken[d].add(t0)
            continue
        row = rows[d]
        for t in range(max((when[x] for x in deps(a)), default=-1) + 1, t0):
            if t in taken[d]:
                continue
            del row[when[a]]
            row[t] = a
            if _peak(row) <= limit:
                when[a] = t
                break
            del row[t]
            row[t0] = a
        taken[d].add(when[a])


def held_limit(name: str, p: int, m: int) -> int:
    """The most micro-batch-stages a device of `name` ("v_half" or "v_min") may hold on p devices with m
    micro-batches: its block's own peak, which the squeeze keeps (1F1B's peak on the V is 2p)."""
    return _controlled(name, list(range(p)) + list(reversed(range(p))), m)[1]


def v_half(stage_devices, m: int) -> Schedule:
    """V-Half (Qi et al., 2024): a V-shape holding about half of 1F1B's activations (see the module's docstring).
    On 4 devices, m >= 6, F = B = W = 1: 6m + 5 ticks, 6 micro-batch-stages per device (1F1B: 8). Needs
    m >= min_micro_batches('v_half', p) (p + 2 for even p, p + 1 for odd)."""
    return _controlled("v_half", stage_devices, m)[0]


def v_min(stage_devices, m: int) -> Schedule:
    """V-Min (Qi et al., 2024): a V-shape holding about a third of 1F1B's activations (see the module's
    docstring). On 4 devices, F = B = W = 1: 6m + 11 ticks, 4 micro-batch-stages per device (1F1B: 8). Needs
    m >= min_micro_batches('v_min', p) (4 on 4 devices)."""
    return _controlled("v_min", stage_devices, m)[0]
