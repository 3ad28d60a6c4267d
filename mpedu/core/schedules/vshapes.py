"""The V-shape schedules: 2p stages on p devices, device r holding stage r on the way down and stage 2p-1-r on the
way back up (so device 0 holds the first and the last stage): ZB-V and DualPipeV, PyTorch 2.13's orders."""
from __future__ import annotations

from .actions import Action, B, F, Schedule, W


def is_v_shape(stage_devices) -> bool:
    """2p stages on p devices, device r holding stages r and 2p-1-r: (0, 1, .., p-1, p-1, .., 1, 0)."""
    p = max(stage_devices, default=-1) + 1
    return p > 0 and list(stage_devices) == list(range(p)) + list(reversed(range(p)))


def _v_devices(name: str, stage_devices) -> int:
    """The device count of a V placement; ValueError naming the V for any other placement."""
    if not is_v_shape(stage_devices):
        p = max(max(stage_devices, default=0) + 1, 2)
        v = list(range(p)) + list(reversed(range(p)))
        raise ValueError(f"{name} needs the V placement: 2p stages on p devices, device r holding stages r and "
                         f"2p-1-r (so device 0 holds the first and the last stage), e.g. stage devices {v} for {p} "
                         f"devices; got {list(stage_devices)}. Use schedule='gpipe' or 'looped_bfs' for other "
                         "placements")
    return max(stage_devices) + 1


def _count_off(pattern, m: int) -> tuple[list[Action], set[int]]:
    """A device's row from its pattern of (kind, stage) tokens: each token takes the next micro-batch of its
    kind on its stage, so a pattern says only in what rhythm a device alternates its two stages.

        ("F", s)        the next forward of stage s
        ("B", s)        the next input-gradient backward of s; its W waits (joins the queue of pending W's)
        ("B+W", s)      the next backward of s as a whole: B and its W at once (torch's full backward B)
        ("W", s)        the W of the oldest B of s still waiting; ("W", None): of the oldest on either stage,
                        and nothing when none waits
        ("F||B+W", s, t) a forward of s overlapped with a whole backward of t (torch's OVERLAP_F_B)

    Returns the row and the positions of the overlapped forwards (each followed by its backward). Micro-batches
    numbered m or more pad the pattern (zbv with m < 2p - 1) and are left out of the row.
    """
    row: list[Action] = []
    overlapped: set[int] = set()
    taken: dict[tuple[str, int], int] = {}         # (F or B, stage) -> micro-batches numbered so far
    waiting: list[tuple[int, int]] = []           # (stage, mb) of B's whose W has not run, oldest first

    def take(kind: str, s: int) -> int:
        i = taken.get((kind, s), 0)
        taken[kind, s] = i + 1
        return i

    def put(*actions: Action) -> None:
        row.extend(a for a in actions if a.mb < m)

    for kind, s, *other in pattern:
        if kind == "F":
            put(F(s, take("F", s)))
        elif kind == "B":
            i = take("B", s)
            put(B(s, i))
            waiting.append((s, i))
        elif kind == "B+W":
            i = take("B", s)
            put(B(s, i), W(s, i))
        elif kind == "W":
            k = next((k for k, (t, _) in enumerate(waiting) if s is None or t == s), None)
            if k is not None:
                t, i = waiting.pop(k)
                put(W(t, i))
        else:                                                       # "F||B+W"
            overlapped.add(len(row))
            i, t = take("F", s), other[0]
            j = take("B", t)
            put(F(s, i), B(t, j), W(t, j))
    return row, overlapped


def zbv(stage_devices, m: int) -> Schedule:
    """Zero bubble V (ZB-V; Qi et al., 2024, section 6; PyTorch's ScheduleZBVZeroBubble, action for action).

    The V placement: device r holds stage r on the way down and stage 2p-1-r on the way up, so a micro-batch
    goes down the devices, turns on device p-1 and comes back up to device 0, which holds the first and the
    last stage. Every backward is split into B (input gradient) and W (weight gradient). Device r's row, its
    "down" stage r and its "up" stage 2p-1-r, in phases (n = max(m, 2p - 1) micro-batches):
        fill      2(p-r) - 1 forwards down: enough to keep the devices below busy until the turn comes back
        turn      r pairs (F up, F down), then p-r triples (F up, B up, W up): the up stage's first
                  micro-batches go straight into their backward, W filling what would be a bubble
        steady    n - p rounds of (F down, B down, W down, F up, B up, W up); the forwards down stop once
                  all n are in (after the first n - 2p + r + 1 rounds)
        drain     r pairs (B down, B up) with their W's held back, p-r pairs (B down, W down), then the
                  held-back W's, up stage first
    With m < 2p - 1 the rows are those of 2p - 1 micro-batches with the missing ones left out (as PyTorch
    pads), which costs more than 6m + p - 1 ticks: the V fills with 2p - 1.

        2 devices (stages 0, 3 on device 0; 1, 2 on device 1), m = 4, F = B = W = 1: 25 = 6m + p - 1 ticks
            device 0   0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 ..
            device 1   1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 ..
    Each device holds at most 2p micro-batch-stages whose W is not done, each half of a device's layers: 1F1B's
    peak of p micro-batches on device 0. It idles p - 1 ticks at unit costs, a sixth of 1F1B's 3(p - 1).
    """
    p = _v_devices("zbv", stage_devices)
    n = max(m, 2 * p - 1)
    rows = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        pattern = [("F", down)] * (2 * (p - r) - 1)                         # fill
        pattern += [("F", up), ("F", down)] * r                             # turn
        pattern += [("F", up), ("B", up), ("W", up)] * (p - r)
        for k in range(n - p):                                              # steady
            pattern += [("F", down)] if k < n - 2 * p + r + 1 else []
            pattern += [("B", down), ("W", down), ("F", up), ("B", up), ("W", up)]
        pattern += [("B", down), ("B", up)] * r                             # drain
        pattern += [("B", down), ("W", down)] * (p - r)
        pattern += [("W", up)] * r + [("W", down)] * r
        rows.append(_count_off(pattern, m)[0])
    return Schedule("zbv", tuple(stage_devices), m, rows, split_backward=frozenset(range(2 * p)))


def dualpipev(stage_devices, m: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded onto the V placement; PyTorch's ScheduleDualPipeV, action for action).

    The V placement as in zbv: device r holds stage r (down) and 2p-1-r (up). Its main phase pairs one stage's
    forward with the other stage's backward of another micro-batch, so that on a GPU one's compute hides the
    other's transfers (PyTorch's OVERLAP_F_B action). Here an overlapped pair is its two actions one after the
    other on their device, the forward first, as PyTorch's runtime runs its sub-actions; the positions of the
    forwards are in Schedule.overlapped. PyTorch mixes full backwards (B) and split ones (I + W) on one stage;
    mpedu splits every stage's backward and writes a full backward as B with its W at once after it. Device r's
    row, in phases:
        fill      2(p-r-1) forwards down, then r+1 pairs (F down, F up)
        turn      p-r-1 triples (B up, W up, F up), zero bubble on the up stage
        main      m-2p+r+1 rounds of two overlapped pairs: (F down || B up), (F up || B down); on the last
                  device the first (F down, B up) runs apart (PyTorch: a shorter bubble so)
        drain     p-r-1 rounds (B up, (F up || B down)); r+1 rounds (B up, B down), whole until half-way,
                  split after it, their W's held back; p-r-1 rounds (W, B down); r+1 W's (held-back W's
                  oldest first)

        2 devices, m = 4 ([x y] overlapped): 25 ticks at F = B = W = 1, at most 2p + 1 micro-batch-stages held
            device 0   0F0 0F1 0F2 3F0 3B0 3W0 3F1 [0F3 3B1] 3W1 [3F2 0B0] 0W0 3B2 3W2 [3F3 0B1] 0W1 3B3 3W3 ..
            device 1   1F0 2F0 1F1 2F1 1F2 2B0 2W0 [2F2 1B0] 1W0 [1F3 2B1] 2W1 [2F3 1B1] 1W1 2B2 2W2 ..
    Needs m >= 2p, as PyTorch: device 0's main phase has m - 2p + 1 rounds.
    """
    p = _v_devices("dualpipev", stage_devices)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least as many micro-batches as stages: m >= 2p = {2 * p} for {p} "
                         f"devices, got m={m} (device 0's main phase, where forwards overlap backwards, has m - 2p + 1 "
                         f"rounds). Use micro_batches >= {2 * p}, or zbv, "
                         "which takes any m")
    rows, overlapped = [], set()
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        pattern = [("F", down)] * (2 * (p - r - 1))                         # fill
        pattern += [("F", down), ("F", up)] * (r + 1)
        pattern += [("B", up), ("W", None), ("F", up)] * (p - r - 1)        # turn
        for k in range(m - 2 * p + r + 1):                                  # main
            last_first = k == 0 and r == p - 1
            pattern += [("F", down), ("B+W", up)] if last_first else [("F||B+W", down, up)]
            pattern.append(("F||B+W", up, down))
        pattern += [("B+W", up), ("F||B+W", up, down)] * (p - r - 1)        # drain
        half = (r + 1) // 2
        for k in range(r + 1):
            # whole backwards until half-way, split ones after it (on odd devices from the up stage's B on)
            pattern.append(("B" if k > half or (k == half and r % 2) else "B+W", up))
            pattern.append(("B" if k >= half else "B+W", down))
        pattern += [("W", None), ("B", down)] * (p - r - 1)
        pattern += [("W", None)] * (r + 1)
        row, pairs = _count_off(pattern, m)
        rows.append(row)
        overlapped |= {(r, k) for k in pairs}
    return Schedule("dualpipev", tuple(stage_devices), m, rows, split_backward=frozenset(range(2 * p)),
                    overlapped=frozenset(overlapped))
