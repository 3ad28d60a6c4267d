"""Hand-written schedules: the text form and PyTorch's CSV form, read from a string, a file or a --schedule value."""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from .actions import Action, B, F, Schedule, ScheduleError, W
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
    """A --schedule value: a file holds a hand-written schedule (read_file; a .csv file is PyTorch's form,
    read_csv); else it is a schedule's name, returned as it is. Text that names a path (a folder, or a
    missing file) is refused as one."""
    path = Path(value)
    if path.is_file() and path.suffix.lower() == ".csv":
        return read_csv(path, stage_devices, micro_batches)
    if path.is_file() or path.is_dir():
        return read_file(path, stage_devices, micro_batches)
    key = str(value).lower().replace("-", "").replace("_", "")
    if key not in GENERATORS and key not in ALIASES and ("/" in value or "\\" in value or path.suffix):
        raise ValueError(f"--schedule {value}: no such file, and no schedule has that name ({', '.join(GENERATORS)}); "
                         "a hand-written schedule is a file with one line of actions per device")
    return value


# -- PyTorch's CSV form ----------------------------------------------------------------------------
# torch.distributed.pipelining writes a schedule as one CSV row per rank and a cell per action ("0F1"; an empty
# cell is an idle step). Its kinds: F, I (input gradient), W (weight gradient), B (a full backward, both at
# once), and OVERLAP_F_B, written "(0F3;3B1)OVERLAP_F_B": a forward and a backward run as one action.
_TORCH_CELL = re.compile(r"^(\d+)([FIBW])(\d+)$")
_TORCH_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def read_csv(source, stage_devices=None, micro_batches: int | None = None, name: str | None = None,
             b_means_i: bool = False) -> Schedule:
    """A schedule from PyTorch's compute-only CSV form (its _dump_csv): CSV text, or the path of a file.

    PyTorch's I is mpedu's B of a split backward (W comes later); its full backward B on a stage whose other
    micro-batches split is mpedu's B with its W at once after it; an OVERLAP_F_B cell is its forward and
    backward one after the other, the pair recorded in Schedule.overlapped. stage_devices: None reads each
    stage's device off the row it sits on (as PyTorch does); given, the file must agree. micro_batches: None
    counts them. PyTorch's older files wrote B for what it now calls I: a B whose micro-batch also has a W on
    that stage is refused unless b_means_i=True reads every B as I. Returned validated."""
    text, name = _csv_source(source, name)
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()                                     # a blank line at the end is no rank
    cells = [[(r, c, _torch_cell(cell.strip(), r, c, name)) for c, cell in enumerate(row) if cell.strip()]
             for r, row in enumerate(rows)]
    if not any(cells):
        raise ScheduleError(f"the CSV schedule {name!r} holds no actions; PyTorch's form is one row per rank, "
                            "a cell per action, e.g. '0F0,0F1,0I0,0W0,0I1,0W1'")
    if b_means_i:
        cells = [[(r, c, [("I" if kind == "B" else kind, s, i) for kind, s, i in group]) for r, c, group in row]
                 for row in cells]
    actions = [(r, c, kind, s, i) for row in cells for r, c, group in row for kind, s, i in group]
    _refuse_old_b(actions, name)
    split = frozenset(s for _, _, kind, s, _ in actions if kind in "IW")
    placed = _csv_stage_devices(actions, name)
    if stage_devices is None:
        stage_devices = placed
    elif list(stage_devices) != placed:
        raise ValueError(f"the CSV schedule {name!r} puts the stages on devices {placed} (each stage on the row "
                         f"it sits on), but this placement gives {list(stage_devices)}; build the placement "
                         "for the file, or the file for the placement")
    out, overlapped = _mpedu_rows(cells, split)
    if micro_batches is None:
        micro_batches = 1 + max(a.mb for row in out for a in row)
    return Schedule(name, tuple(stage_devices), micro_batches, out, split_backward=split,
                    overlapped=frozenset(overlapped)).validate()


def _refuse_old_b(actions, name: str) -> None:
    """A B beside a W of the same stage and micro-batch: PyTorch's older files' B, which is today's I."""
    weighed = {(s, i) for _, _, kind, s, i in actions if kind == "W"}
    old = next(((r, c, s, i) for r, c, kind, s, i in actions if kind == "B" and (s, i) in weighed), None)
    if old is not None:
        r, c, s, i = old
        raise ScheduleError(f"the CSV schedule {name!r} has {s}B{i} (rank {r}, column {c}) and also {s}W{i}: a B "
                            f"is a full backward, weights included, so stage {s} would compute micro-batch {i}'s "
                            "weight gradient twice. PyTorch's older files wrote B for what it now calls I (the "
                            "input-gradient half); if this is one of those, read B as I: "
                            "read_csv(..., b_means_i=True)")


def _mpedu_rows(cells, split) -> tuple[list[list[Action]], set]:
    """PyTorch's cells as mpedu's rows, and the overlapped pairs as (row, index of the pair's first action)."""
    out: list[list[Action]] = [[] for _ in cells]
    overlapped = set()
    for r, row in enumerate(cells):
        for _, _, group in row:
            if len(group) == 2:
                overlapped.add((r, len(out[r])))
            for kind, s, i in group:
                if kind == "F":
                    out[r].append(F(s, i))
                elif kind == "B" and s in split:           # a full backward on a split stage: both halves at once
                    out[r] += [B(s, i), W(s, i)]
                else:
                    out[r].append(W(s, i) if kind == "W" else B(s, i))
    return out, overlapped


def _csv_source(source, name: str | None) -> tuple[str, str]:
    """(text, name) of read_csv's source: a Path or the name of a file is read; other text is the CSV itself."""
    if isinstance(source, str) and "\n" not in source and "," not in source and source.strip().lower().endswith(".csv"):
        source = Path(source.strip())                 # a file's name, even one that is missing (said so below)
    if not isinstance(source, Path):
        return str(source), name or "csv"
    if not source.is_file():
        raise ValueError(f"schedule file {source}: no such file; give PyTorch's CSV form, one row per rank")
    try:
        return source.read_bytes().decode("utf-8"), name or source.stem
    except UnicodeDecodeError as e:
        raise ValueError(f"schedule file {source} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}); PyTorch's CSV form is text, one row per rank") from None


def _torch_cell(cell: str, r: int, c: int, name: str) -> list[tuple[str, int, int]]:
    """A cell's actions as (PyTorch kind, stage, micro-batch): one, or an overlapped forward and backward."""
    pair = _TORCH_OVERLAP.match(cell)
    parts = [part.strip() for part in pair.group(1).split(";")] if pair else [cell]
    found = [_TORCH_CELL.match(part) for part in parts]
    if all(found) and (not pair or (len(found) == 2 and found[0].group(2) == "F" and found[1].group(2) in "IB")):
        return [(kind, int(s), int(i)) for s, kind, i in (m.groups() for m in found)]
    raise ScheduleError(f"the CSV schedule {name!r}, rank {r}, column {c}: cannot read cell {cell!r}; mpedu reads "
                        "PyTorch's compute-only form: <stage><F|I|B|W><micro-batch> such as '1F3', or "
                        "'(0F3;3B1)OVERLAP_F_B' (write the file with _dump_csv(path, format='compute_only'))")


def _csv_stage_devices(actions, name: str) -> list[int]:
    """Each stage's device, the row its actions sit on; refused when a stage sits on two or none."""
    rank: dict[int, int] = {}
    for r, c, kind, s, i in actions:
        if rank.setdefault(s, r) != r:
            raise ScheduleError(f"the CSV schedule {name!r} has stage {s} on rank {rank[s]} and on rank {r} "
                                f"({s}{kind}{i}, column {c}); a stage lives on one rank")
    missing = [s for s in range(max(rank) + 1) if s not in rank]
    if missing:
        raise ScheduleError(f"the CSV schedule {name!r} has no actions for stage {missing[0]} (stages 0.."
                            f"{max(rank)}); every stage needs its forwards and backwards")
    return [rank[s] for s in range(len(rank))]


def csv_text(schedule: Schedule) -> str:
    """Schedule.to_csv: PyTorch's compute-only CSV form of `schedule`, one row per device."""
    if schedule.chunks > 1:
        raise ValueError(f"schedule {schedule.name!r} cuts the sequence into {schedule.chunks} time chunks; "
                         "PyTorch's schedule files have no time chunks (write it with to_text instead)")
    split = schedule.split_backward

    def cell(a: Action) -> str:
        return f"{a.stage}{'I' if a.kind == 'B' and a.stage in split else a.kind}{a.mb}"

    lines = []
    for d, row in enumerate(schedule.actions):
        cells, k = [], 0
        while k < len(row):
            if (d, k) not in schedule.overlapped:
                cells.append(cell(row[k]))
                k += 1
                continue
            f, b = row[k], row[k + 1]
            whole = k + 2 < len(row) and row[k + 2] == W(b.stage, b.mb)   # B with its W at once: a full backward
            back = f"{b.stage}B{b.mb}" if whole or b.stage not in split else cell(b)
            cells.append(f"({cell(f)};{back})OVERLAP_F_B")
            k += 3 if whole else 2
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"
