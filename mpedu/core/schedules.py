"""Pipeline schedules as data: per device, an ordered list of actions such as `1F3`.

Letters used throughout: p devices, n stages (n >= p when a device holds several),
m micro-batches, s a stage, i a micro-batch, c a time chunk, k a clock tick.

An action is (kind, stage, micro-batch[, chunk]) with kind
    F  forward of one micro-batch through one stage
    B  backward: the input gradient (and, when the schedule has no W for that
       stage, the weight gradient too)
    W  weight gradient only (zero-bubble schedules split the backward into B + W)
Its string form is `<stage><kind><micro-batch>` (`1F3`), with `.c` for a time
chunk other than 0 (`1F3.2`).

One Schedule drives the executor (mpedu.core.pipeline), the simulator (mpedu.predict.simulator)
and the printers here. `Schedule.validate()` proves it can run before anything does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

KINDS = "FBW"
MAX_UNITS = 2**16      # (micro-batch, chunk) units per step: far beyond any batch this course uses
_ACTION_RE = re.compile(r"^(\d+)([FBW])(\d+)(?:\.(\d+))?$")


class Action(NamedTuple):
    kind: str    # "F", "B" or "W"
    stage: int
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{self.mb}"
        return text if self.chunk == 0 else f"{text}.{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"cannot read action {text!r}: write <stage><F|B|W><micro-batch>, e.g. '1F3' "
                             "(stage 1, forward, micro-batch 3), or '1F3.2' for time chunk 2")
        stage, kind, mb, chunk = match.groups()
        return cls(kind, int(stage), int(mb), int(chunk or 0))


def F(stage: int, mb: int, chunk: int = 0) -> Action:
    return Action("F", stage, mb, chunk)


def B(stage: int, mb: int, chunk: int = 0) -> Action:
    return Action("B", stage, mb, chunk)


def W(stage: int, mb: int, chunk: int = 0) -> Action:
    return Action("W", stage, mb, chunk)


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows the grid and marks the bad action."""


@dataclass
class Schedule:
    """An ordered action list per device, plus what is needed to check it.

    stage_devices[s] is the index (0..p-1) of the device that holds stage s.
    """

    name: str
    stage_devices: tuple[int, ...]
    micro_batches: int
    actions: list[list[Action]]
    chunks: int = 1
    split_backward: frozenset[int] = field(default_factory=frozenset)  # stages whose backward is B + W
    _checked: int | None = field(default=None, init=False, repr=False, compare=False)  # what validate() passed

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def num_devices(self) -> int:
        return len(self.actions)

    def dependencies(self, a: Action) -> list[Action]:
        """The actions `a` must wait for (other than the one before it on its device)."""
        n, last_chunk = self.num_stages, self.chunks - 1
        if a.kind == "F":
            deps = [F(a.stage - 1, a.mb, a.chunk)] if a.stage > 0 else []
            if a.chunk > 0:  # recurrent state from the previous time chunk
                deps.append(F(a.stage, a.mb, a.chunk - 1))
        elif a.kind == "B":
            deps = [F(a.stage, a.mb, a.chunk)]
            if a.stage < n - 1:  # gradient of this stage's output
                deps.append(B(a.stage + 1, a.mb, a.chunk))
            if a.chunk < last_chunk:  # gradient of the state this chunk handed on (BPTT)
                deps.append(B(a.stage, a.mb, a.chunk + 1))
        else:
            deps = [B(a.stage, a.mb, a.chunk)]
        return deps

    # -- checking -----------------------------------------------------------------
    def check_counts(self, micro_batches: int | None = None, chunks: int | None = None) -> None:
        """Refuse a micro_batches= or chunks= given beside this schedule that contradicts its own counts
        (None: not given; a Schedule brings its own)."""
        for what, given, own in (("micro_batches", micro_batches, self.micro_batches), ("chunks", chunks, self.chunks)):
            if given is not None and given != own:
                raise ValueError(f"{what}={given}, but the schedule {self.name!r} was built for {own}; leave "
                                 f"{what} out (a Schedule brings its own) or build the schedule for {given}")

    def validate(self) -> "Schedule":
        """Raise ScheduleError naming the first bad action; return self when the schedule can run."""
        for what, value in (("micro_batches", self.micro_batches), ("chunks", self.chunks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"schedule {self.name!r}: {what}={value!r}; it must be a whole number >= 1")
        n, m, p = self.num_stages, self.micro_batches, self.num_devices
        if sorted(set(self.stage_devices)) != list(range(p)):
            raise ScheduleError(f"stage_devices {list(self.stage_devices)} must use every device 0..{p - 1}")
        seen: set[Action] = set()
        for d, row in enumerate(self.actions):
            for a in row:
                if not isinstance(a, Action):
                    raise ScheduleError(f"device {d}'s row holds {a!r}, not an Action: write F(0, 1), B(0, 1) and "
                                        f"W(0, 1), or Action.parse('0F1') for the text form")
                problem = None
                if a.kind not in KINDS:
                    problem = f"unknown kind {a.kind!r}"
                elif not 0 <= a.stage < n:
                    problem = f"stage {a.stage} does not exist (stages 0..{n - 1})"
                elif not 0 <= a.mb < m:
                    problem = f"micro-batch {a.mb} does not exist (0..{m - 1})"
                elif not 0 <= a.chunk < self.chunks:
                    problem = f"chunk {a.chunk} does not exist (0..{self.chunks - 1})"
                elif self.stage_devices[a.stage] != d:
                    problem = f"stage {a.stage} lives on device {self.stage_devices[a.stage]}, not device {d}"
                elif a in seen:
                    problem = "appears twice"
                elif a.kind == "W" and a.stage not in self.split_backward:
                    problem = f"stage {a.stage} runs a full backward in B; it has no separate W"
                if problem:
                    raise ScheduleError(f"{a}: {problem}\n{self.grid(mark=a)}")
                seen.add(a)
        for s in range(n):
            kinds = "FBW" if s in self.split_backward else "FB"
            for kind in kinds:
                for i in range(m):
                    for c in range(self.chunks):
                        if Action(kind, s, i, c) not in seen:
                            raise ScheduleError(f"{Action(kind, s, i, c)} is missing: every stage needs "
                                                f"{' and '.join(kinds)} for every micro-batch\n{self.grid()}")
        run_order(self)  # raises on deadlock
        self._checked = self._fingerprint()
        return self

    def validated(self) -> "Schedule":
        """This schedule, validated again only if its rows or counts changed since validate() last passed
        (one hash when not: cheap enough for every step; a caller may edit the rows, lists, in place)."""
        if self._checked != self._fingerprint():
            self.validate()
        return self

    def _fingerprint(self) -> int:
        """What validate() checked, as one number (a hash of the rows and counts: cheap next to validating)."""
        return hash((tuple(self.stage_devices), self.micro_batches, self.chunks, frozenset(self.split_backward),
                     tuple(tuple(row) for row in self.actions)))

    # -- printing -----------------------------------------------------------------
    def label(self, a: Action) -> str:
        """An action as the grid writes it: with time chunks, always with its chunk (0B0.0)."""
        return f"{a}.0" if self.chunks > 1 and a.chunk == 0 else str(a)

    def grid(self, mark: Action | None = None) -> str:
        """Device x step table; `mark` gets '<-- ERROR HERE' on its row."""
        text = self.label

        width = max([len(text(a)) for row in self.actions for a in row] + [3])
        steps = max((len(row) for row in self.actions), default=0)
        lines = [f"{'step':>8} " + " ".join(f"{k:>{width}}" for k in range(steps))]
        for d, row in enumerate(self.actions):
            cells = " ".join(f"{text(a):>{width}}" for a in row)
            flag = "  <-- ERROR HERE" if mark is not None and mark in row else ""
            lines.append(f"{'dev ' + str(d):>8} {cells}{flag}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.name}: p={self.num_devices}, n={self.num_stages}, m={self.micro_batches}\n{self.grid()}"


def run_order(schedule: Schedule, cost: Callable[[int, Action], float] = lambda d, a: 1.0,
              link: Callable[[Action], float] = lambda a: 0.0):
    """Play the schedule: every device runs its list in order; an action starts when its
    device is free and its dependencies have finished, plus `link(action)` when one
    ran on another device. Returns [(device, action, start, end)] sorted by start.

    This is the deadlock check and the core of the simulator. Start times depend only
    on each device's own order and the dependencies, so a device simply runs ahead
    until its next action waits for one not yet played, and is woken when that one
    is: O(actions). If devices are left waiting, the schedule can never finish.
    """
    done: dict[Action, tuple[int, float]] = {}          # action -> (device, end time)
    waiter: dict[Action, int] = {}                      # unplayed action -> the device waiting for it
    free = [0.0] * schedule.num_devices
    pos = [0] * schedule.num_devices
    played = []
    ready = list(range(schedule.num_devices))
    while ready:
        d = ready.pop()
        row = schedule.actions[d]
        while pos[d] < len(row):
            a = row[pos[d]]
            deps = schedule.dependencies(a)
            blocker = next((dep for dep in deps if dep not in done), None)
            if blocker is not None:
                # only the device of a stage waits on that stage's actions, so one waiter each
                waiter[blocker] = d
                break
            start = free[d]
            for dep in deps:
                src, end = done[dep]
                start = max(start, end + link(a) if src != d else end)
            end = start + cost(d, a)
            done[a] = (d, end)
            free[d] = end
            pos[d] += 1
            played.append((d, a, start, end))
            if a in waiter:
                ready.append(waiter.pop(a))
    stuck = [d for d, row in enumerate(schedule.actions) if pos[d] < len(row)]
    if stuck:
        label = schedule.label
        lines, cause = [], None
        for d in stuck:
            a = schedule.actions[d][pos[d]]
            missing = [x for x in schedule.dependencies(a) if x not in done]
            own = [x for x in missing if schedule.stage_devices[x.stage] == d]   # behind it on its own device
            cause = cause or (a if own else None)
            lines.append(f"device {d} waits at {label(a)} for {', '.join(map(label, missing))}"
                         + (f", which comes later in device {d}'s own list" if own else ""))
        mark = cause or schedule.actions[stuck[0]][pos[stuck[0]]]
        raise ScheduleError("deadlock: no device can go on\n  " + "\n  ".join(lines) + "\n" + schedule.grid(mark=mark))
    played.sort(key=lambda x: (x[2], x[0]))
    return played


# -- generators ----------------------------------------------------------------------
# Each takes stage_devices (stage -> device index) and m, and returns a Schedule.


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
    "zb1": zb1,
    "wavefront": wavefront,
}


ALIASES = {"onefoneb": "1f1b", "zb": "zb1", "zbh1": "zb1", "zerobubble": "zb1"}


def canonical(name: str) -> str:
    """A schedule's name as GENERATORS spells it ('1F1B', 'zero-bubble' -> '1f1b', 'zb1'); ValueError if unknown."""
    key = str(name).lower().replace("-", "").replace("_", "")
    key = ALIASES.get(key, key)
    if key not in GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(GENERATORS)}")
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
    return GENERATORS[key](list(stage_devices), m).validate()


# -- hand-written schedules ------------------------------------------------------------


def read(text: str, stage_devices, micro_batches: int | None = None, name: str = "by hand") -> Schedule:
    """A hand-written schedule: one line per device, its actions in order, e.g. for 2 devices

        0F0 0F1 0B0 0B1
        1F0 1B0 1F1 1B1

    ('#' starts a comment; blank lines are skipped). A stage with W actions has its backward split
    into B + W; `1F0.1` names time chunk 1. micro_batches: None counts them from the actions.
    Returned validated (ScheduleError says why not)."""
    rows = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            rows.append([Action.parse(word) for word in line.replace(",", " ").split()])
    devices = max(stage_devices) + 1
    if len(rows) != devices:
        raise ValueError(f"the schedule {name!r} has {len(rows)} device lines but the placement uses "
                         f"{devices} devices; write one line of actions per device")
    if micro_batches is None:
        micro_batches = 1 + max((a.mb for row in rows for a in row), default=0)
    split = frozenset(a.stage for row in rows for a in row if a.kind == "W")
    chunks = 1 + max((a.chunk for row in rows for a in row), default=0)
    return Schedule(name, tuple(stage_devices), micro_batches, rows, chunks=chunks, split_backward=split).validate()


def read_file(path, stage_devices, micro_batches: int | None = None) -> Schedule:
    """`read` on a file's text, named after the file; a file that is no text is refused naming it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"schedule file {path} is a folder; give a file with one line of actions per device")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"schedule file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}); a schedule file holds one line of actions per device, e.g. "
                         "'0F0 0F1 0B0 0B1'") from None
    return read(text, stage_devices, micro_batches, name=path.stem)


def from_option(value: str, stage_devices, micro_batches: int | None = None) -> str | Schedule:
    """A --schedule value: a file holds a hand-written schedule (read_file); else it is a schedule's
    name, returned as it is. Text that names a path (a folder, or a missing file) is refused as one."""
    path = Path(value)
    if path.is_file() or path.is_dir():
        return read_file(path, stage_devices, micro_batches)
    key = str(value).lower().replace("-", "").replace("_", "")
    if key not in GENERATORS and key not in ALIASES and ("/" in value or "\\" in value or path.suffix):
        raise ValueError(f"--schedule {value}: no such file, and no schedule has that name ({', '.join(GENERATORS)}); "
                         "a hand-written schedule is a file with one line of actions per device")
    return value
