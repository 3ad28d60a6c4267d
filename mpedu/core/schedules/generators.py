"""The named schedules, each a pure function of (stage_devices, m): naive, GPipe, 1F1B, interleaved
1F1B, looped BFS, zero bubble (ZB-H1) and the wavefront here; the V-shapes (ZB-V, DualPipeV) in vshapes, the V-shapes
that hold less (V-Half, V-Min) in vmem, zero bubble under a memory cap in capped (`zb_cap2`); `make` builds any of them
by name."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

from .actions import MAX_UNITS, Action, B, F, Schedule, W
from .capped import zb_capped
from .vmem import min_micro_batches, v_half, v_min
from .vshapes import dualpipev, zbv


def _by_device(order: list[Action], stage_devices) -> list[list[Action]]:
    """Project one global order onto the devices (keeps each device's relative order)."""
    rows: list[list[Action]] = [[] for _ in range(max(stage_devices) + 1)]
    for a in order:
        rows[stage_devices[a.stage]].append(a)
    return rows


def naive(stage_devices, m: int = 1) -> Schedule:
    """Plain model parallelism: one micro-batch at a time goes all the way forward and
    back before the next starts, so exactly one device is ever busy (MXNet's example)."""
    n = len(stage_devices)
    order = []
    for i in range(m):
        order += [F(s, i) for s in range(n)]
        order += [B(s, i) for s in reversed(range(n))]
    return Schedule("naive", tuple(stage_devices), m, _by_device(order, stage_devices))


def gpipe(stage_devices, m: int) -> Schedule:
    """GPipe: fill the pipeline with all m forwards, then drain it with all backwards.

    Clock table for n = 3, m = 4 (F of micro-batch i on stage s at tick i + s):
        tick     0   1   2   3   4   5 | 6   7   8   9  10  11
        stage 0  F0  F1  F2  F3        |         B0  B1  B2  B3
        stage 1      F0  F1  F2  F3    |     B0  B1  B2  B3
        stage 2          F0  F1  F2  F3| B0  B1  B2  B3
    Dependencies always sit at an earlier tick, so any device may hold any stages.
    """
    n = len(stage_devices)
    fwd = sorted((i + s, s, i) for s in range(n) for i in range(m))
    bwd = sorted((i + (n - 1 - s), n - 1 - s, i) for s in range(n) for i in range(m))
    order = [F(s, i) for _, s, i in fwd] + [B(n - 1 - r, i) for _, r, i in bwd]
    return Schedule("gpipe", tuple(stage_devices), m, _by_device(order, stage_devices))


def one_f_one_b(stage_devices, m: int) -> Schedule:
    """1F1B: after a short warm-up each device alternates one forward and one backward,
    so stage s holds the activations of at most n - s micro-batches (GPipe: m)."""
    n = len(stage_devices)
    if len(set(stage_devices)) != n:
        if is_round_robin(stage_devices):
            return interleaved(stage_devices, m)
        raise ValueError(f"1f1b needs one stage per device, or stages dealt round-robin to devices "
                         f"(interleaved); got stage devices {list(stage_devices)}. Use schedule='gpipe' "
                         "for other placements")
    rows: list[list[Action]] = [[] for _ in range(n)]
    for s in range(n):
        row = rows[stage_devices[s]]
        warmup = min(n - s - 1, m)
        row += [F(s, i) for i in range(warmup)]                 # warm-up: fill the pipe
        for i in range(m - warmup):                            # steady state: one F, one B
            row += [F(s, warmup + i), B(s, i)]
        row += [B(s, i) for i in range(m - warmup, m)]          # cool-down: drain
    return Schedule("1f1b", tuple(stage_devices), m, rows)


def is_round_robin(stage_devices) -> bool:
    """Stage s on device s % p for every stage: interleaved's (looped) placement, v >= 1 stages per device."""
    p = max(stage_devices) + 1
    return len(stage_devices) % p == 0 and all(d == s % p for s, d in enumerate(stage_devices))


def interleaved(stage_devices, m: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each of p devices holds v stages dealt round-robin
    (stage s on device s % p). Forwards go in groups of p micro-batches per model chunk;
    the bubble shrinks by a factor v at the cost of v times more transfers."""
    p, n = max(stage_devices) + 1, len(stage_devices)
    v = n // p
    if not is_round_robin(stage_devices) or v < 2:
        raise ValueError(f"interleaved needs each of the p devices to hold v >= 2 stages dealt round-robin "
                         f"(stage s on device s % p), got stage devices {list(stage_devices)}; e.g. "
                         "'embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | lstm3,decode:vgpu1'")
    if m % p:
        raise ValueError(f"interleaved needs micro_batches to be a multiple of the {p} devices, got {m}")
    total = m * v

    def nth(k: int, d: int, backward: bool) -> Action:
        group = (k // p) % v                       # which of the device's model chunks
        chunk = v - 1 - group if backward else group
        mb = (k // (p * v)) * p + k % p
        return Action("B" if backward else "F", chunk * p + d, mb)

    rows = []
    for d in range(p):
        warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
        row = [nth(k, d, False) for k in range(warmup)]          # warm-up
        for k in range(total - warmup):                          # steady state
            row += [nth(warmup + k, d, False), nth(k, d, True)]
        row += [nth(k, d, True) for k in range(total - warmup, total)]  # cool-down
        rows.append(row)
    return Schedule("interleaved", tuple(stage_devices), m, rows)


def looped_bfs(stage_devices, m: int) -> Schedule:
    """Breadth-first pipelining (Lamy-Poirier, 2023; PyTorch's ScheduleLoopedBFS): each device runs all m
    forwards of its first stage, then all m of its next one, and so on; then the backwards, its last stage
    first, micro-batches in reverse order. Stages dealt round-robin give PyTorch's order, action for action:

        2 devices, stages 0 and 2 on device 0, 1 and 3 on device 1, m = 2:
            device 0   0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0
            device 1   1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0
    Like GPipe it holds all m micro-batches until their backward; unlike it, a device finishes one stage's
    forwards before the next (GPipe on these stages takes micro-batch 0 through both of a device's stages first).
    """
    rows = []
    for d in range(max(stage_devices) + 1):
        mine = [s for s, device in enumerate(stage_devices) if device == d]
        rows.append([F(s, i) for s in mine for i in range(m)]
                    + [B(s, i) for s in reversed(mine) for i in reversed(range(m))])
    return Schedule("looped_bfs", tuple(stage_devices), m, rows)


def zb1(stage_devices, m: int) -> Schedule:
    """Zero bubble ZB-H1 (Qi et al., 2023): the backward is split into B (input
    gradient, which the previous stage waits for) and W (weight gradient, which
    nobody waits for), and W's are moved to where 1F1B sat idle.

    Stage s runs 1F1B's F and B order but delays each W by s places: the last
    stages, which 1F1B keeps busiest early, push their W's into the cool-down, so
    the B's that the first stages wait for arrive sooner. With equal F, B and W
    times the bubble is (p - 1) units against 1F1B's 3 (p - 1); every stage holds
    at most n micro-batches whose W is not done, 1F1B's peak on stage 0.
    """
    n = len(stage_devices)
    if len(set(stage_devices)) != n:
        raise ValueError(f"the zb1 schedule needs one stage per device, got stage devices {list(stage_devices)}; "
                         "use schedule='gpipe' for a placement where a device holds several stages")
    rows: list[list[Action]] = [[] for _ in range(n)]
    for s in range(n):
        row = rows[stage_devices[s]]
        warmup = min(n - s - 1, m)
        row += [F(s, i) for i in range(warmup)]                 # warm-up
        for i in range(m):                                     # steady state and cool-down
            if warmup + i < m:
                row.append(F(s, warmup + i))
            row.append(B(s, i))
            if i >= s:
                row.append(W(s, i - s))                        # W delayed by s places
        row += [W(s, i) for i in range(max(m - s, 0), m)]      # the delayed W's
    return Schedule("zb1", tuple(stage_devices), m, rows, split_backward=frozenset(range(n)))


def wavefront(stage_devices, m: int, chunks: int = 2) -> Schedule:
    """Pipelining along time: each micro-batch's sequence is cut into `chunks` time
    chunks, and stage s works on chunk c while stage s+1 works on chunk c-1.

    The unit of work is (micro-batch i, chunk c). Forwards go through the units in
    order like GPipe's fill (chunk c after chunk c-1: it needs that chunk's (h, c)
    state); backwards drain them with the chunks reversed, because chunk c's
    backward needs the state gradient from chunk c+1 (backpropagation through time).
    Clock table for n = 2 stages, m = 1, 3 chunks:
        tick     0     1     2     3   | 4     5     6     7
        stage 0  F0.0  F0.1  F0.2      |       B0.2  B0.1  B0.0
        stage 1        F0.0  F0.1  F0.2| B0.2  B0.1  B0.0
    """
    n = len(stage_devices)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a whole number >= 1, got {chunks!r}")
    units = [(i, c) for i in range(m) for c in range(chunks)]
    fwd = sorted((u + s, s, u) for s in range(n) for u in range(len(units)))
    # backward units: micro-batches in order, chunks from last to first
    back_units = [(i, c) for i in range(m) for c in reversed(range(chunks))]
    bwd = sorted((v + (n - 1 - s), n - 1 - s, v) for s in range(n) for v in range(len(back_units)))
    order = [F(s, *units[u]) for _, s, u in fwd] + [B(n - 1 - r, *back_units[v]) for _, r, v in bwd]
    return Schedule("wavefront", tuple(stage_devices), m, _by_device(order, stage_devices), chunks=chunks)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "looped_bfs": looped_bfs,
    "zb1": zb1,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "v_half": v_half,
    "v_min": v_min,
    "wavefront": wavefront,
}
V_SHAPED = ("zbv", "dualpipev", "v_half", "v_min")     # built for the V placement: device r holds stages r, 2p-1-r


def fewest_micro_batches(name: str, p: int) -> int:
    """The fewest micro-batches schedule `name` takes on p devices (fewer are refused, saying so): DualPipeV 2p,
    V-Half and V-Min their blocks' (mpedu.core.schedules.vmem), any other 1."""
    key = canonical(name)
    if key == "dualpipev":
        return 2 * p
    if key in ("v_half", "v_min"):
        return min_micro_batches(key, p)
    return 1


ALIASES = {"onefoneb": "1f1b", "zb": "zb1", "zbh1": "zb1", "zerobubble": "zb1", "loopedbfs": "looped_bfs",
           "bfs": "looped_bfs", "zbvzerobubble": "zbv", "zerobubblev": "zbv",
           "vhalf": "v_half", "vmin": "v_min"}


_CAPPED = re.compile(r"^zbcap(\d{1,4})$")      # zb_cap3: zero bubble holding at most 3 micro-batches per device


def canonical(name: str) -> str:
    """A schedule's name as GENERATORS spells it ('1F1B', 'zero-bubble' -> '1f1b', 'zb1'; 'ZB-cap3' -> 'zb_cap3');
    ValueError if unknown."""
    key = str(name).lower().replace("-", "").replace("_", "")
    key = ALIASES.get(key, key)
    capped = _CAPPED.match(key)
    if capped and int(capped.group(1)) >= 1:
        return f"zb_cap{int(capped.group(1))}"
    if key not in GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(GENERATORS)}, or zb_cap<k> (zero "
                         "bubble holding at most k micro-batches per device, e.g. zb_cap2)")
    return key


def make(name: str, stage_devices, m: int, chunks: int = 1) -> Schedule:
    """Build and validate the named schedule (`chunks` > 1: time chunks, wavefront only)."""
    key = canonical(name)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"micro_batches must be a whole number >= 1, got {m!r}")
    if isinstance(chunks, int) and m * chunks > MAX_UNITS:
        # writing down a schedule of 2**70 actions would never finish: refuse it first
        raise ValueError(f"micro_batches={m} x chunks={chunks} is more than the {MAX_UNITS:,} pieces a step may "
                         "be cut into; a batch of B sentences splits into at most B micro-batches")
    if key == "wavefront":
        return wavefront(list(stage_devices), m, chunks).validate()
    if chunks != 1:
        raise ValueError(f"chunks={chunks}: only the 'wavefront' schedule pipelines along time; "
                         f"use schedule='wavefront' or chunks=1 (--schedule wavefront, or --chunks 1)")
    if key.startswith("zb_cap"):
        return zb_capped(list(stage_devices), m, int(key[len("zb_cap"):]))
    return GENERATORS[key](list(stage_devices), m).validate()


def for_runner(schedule, stage_devices: list[int], micro_batches, chunks) -> Schedule:
    """A runner's Schedule: made from a name (micro_batches default 4, chunks 1), or its own checked copy
    of one given (whose counts the given ones, if any, must match)."""
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(f"schedule must be a name such as 'gpipe' or a Schedule, got {schedule!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a whole number >= 1, got {chunks!r}")
    if isinstance(micro_batches, bool):
        raise ValueError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}")
    if isinstance(schedule, str):
        return make(schedule, stage_devices, 4 if micro_batches is None else micro_batches,
                              1 if chunks is None else chunks)
    if list(schedule.stage_devices) != stage_devices:
        raise ValueError(f"schedule {schedule.name!r} was built for stage devices "
                         f"{list(schedule.stage_devices)}, but this placement gives {stage_devices}")
    # its own copy of the rows: an edit of the caller's schedule after this would otherwise reach the
    # steps unchecked (and a cycle between devices would wait for ever)
    own = replace(schedule, actions=[list(row) for row in schedule.actions]).validate()
    schedule.check_counts(micro_batches, chunks)
    return own


def forwards_only(stage_devices, m: int, chunks: int = 1) -> list[list[Action]]:
    """Each device's actions for an evaluation step: the fill order (GPipe's, or the wavefront's), no backwards."""
    fill = wavefront(stage_devices, m, chunks) if chunks > 1 else gpipe(stage_devices, m)
    return [[a for a in row if a.kind == "F"] for row in fill.actions]
