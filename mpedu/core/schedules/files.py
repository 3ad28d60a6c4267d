"""Hand-written schedules: the text form, read from a string, a file or a --schedule value."""
from __future__ import annotations

from pathlib import Path

from .actions import Action, Schedule, ScheduleError
from .generators import ALIASES, GENERATORS


def read(text: str, stage_devices=None, micro_batches: int | None = None, name: str = "by hand") -> Schedule:
    """A hand-written schedule: one line per device, its actions in order, e.g. for 2 devices

        0F0 0F1 0B0 0B1
        1F0 1B0 1F1 1B1

    ('#' starts a comment; blank lines are skipped). A stage with W actions has its backward split
    into B + W; `1F0.1` names time chunk 1. stage_devices: None puts stage d on device d, one stage per
    line. micro_batches: None counts them from the actions. Returned validated (ScheduleError says why not)."""
    rows = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            rows.append([Action.parse(word) for word in line.replace(",", " ").split()])
    if stage_devices is None:
        if not rows:
            raise ScheduleError("the text holds no actions; write one line of actions per device, e.g. "
                                "'0F0 0F1 0B0 0B1'")
        stage_devices = list(range(len(rows)))
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
