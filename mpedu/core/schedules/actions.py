"""Schedules as data: Action, Schedule and its checks (validate, run_order, the printed grid)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
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
    # (device, k): the F at actions[device][k] and the B after it are one overlapped pair (DualPipeV's OVERLAP_F_B):
    # on a GPU one's compute would hide the other's transfers; a device here runs them one after the other
    overlapped: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)  # what validate() passed

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
        for d, k in sorted(self.overlapped):
            row = self.actions[d] if isinstance(d, int) and 0 <= d < p else []
            pair = row[k:k + 2] if isinstance(k, int) and k >= 0 else []
            if len(pair) != 2 or pair[0].kind != "F" or pair[1].kind != "B" or pair[0].stage == pair[1].stage:
                raise ScheduleError(f"overlapped pair (device {d}, position {k}): an overlapped pair is a forward "
                                    "followed on its device by a backward (B) of another stage, e.g. 0F3 3B1; "
                                    f"device {d}'s row has {' '.join(map(self.label, pair)) or 'no action there'}"
                                    f"\n{self.grid()}")
        run_order(self)  # raises on deadlock
        self._checked = ([list(row) for row in self.actions], *self._counts())     # a copy of what passed
        return self

    def validated(self) -> "Schedule":
        """This schedule, validated again only if its rows or counts changed since validate() last passed
        (a caller may edit the rows, lists, in place). Cheap enough for every step when they did not: an
        unchanged row holds the very Actions of the copy validate() kept, so comparing the two is a pointer
        compare per action (hashing the actions instead took a near-empty step 15-25 us)."""
        checked = self._checked
        if checked is None or checked[0] != self.actions or checked[1:] != self._counts():
            self.validate()
        return self

    def _counts(self) -> tuple:
        return (tuple(self.stage_devices), self.micro_batches, self.chunks, frozenset(self.split_backward),
                frozenset(self.overlapped))

    # -- text ---------------------------------------------------------------------
    @classmethod
    def from_text(cls, text: str, stage_devices=None, micro_batches: int | None = None,
                  name: str = "by hand") -> "Schedule":
        """A hand-written schedule, one line of actions per device, validated:

            Schedule.from_text('''
                0F0 0F1 0B0 0B1
                1F0 1B0 1F1 1B1
            ''')

        stage_devices: None puts stage d on device d (one stage per line); give it when a device holds
        several stages. micro_batches: None counts them from the actions. The inverse of to_text."""
        from .files import read  # (files reads the text into this module's Schedule)
        return read(text, stage_devices, micro_batches, name=name)

    def to_text(self) -> str:
        """One line of actions per device, the form from_text reads (and a schedule file holds)."""
        return "\n".join(" ".join(map(self.label, row)) for row in self.actions)

    def to_csv(self) -> str:
        """PyTorch's compute-only CSV form (what torch.distributed.pipelining's _load_csv reads): a row per
        device, a cell per action, a split stage's B written I as PyTorch names the input gradient, an
        overlapped pair one (F;B)OVERLAP_F_B cell. schedules.read_csv is the inverse."""
        from .files import csv_text  # (files holds PyTorch's file format)
        return csv_text(self)

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
        raise _deadlock(schedule, stuck, pos, done)
    played.sort(key=lambda x: (x[2], x[0]))
    return played


def _deadlock(schedule: Schedule, stuck: list[int], pos: list[int], done) -> ScheduleError:
    """What each stuck device waits for, and the grid with the action at the cause marked."""
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
    return ScheduleError("deadlock: no device can go on\n  " + "\n  ".join(lines) + "\n" + schedule.grid(mark=mark))
