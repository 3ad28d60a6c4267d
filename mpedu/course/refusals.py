"""The explorer's refusals: why a board and menu choice cannot be predicted, in the words on screen, and the fix."""
from __future__ import annotations

import re

from ..core import schedules
from ..core.placement import Placement
from .layout import V_SCHEDULES, kept_cuts, v_layout
from .wording import plural, sequences


class Refusal(ValueError):
    """A choice the explorer cannot predict, in the learner's words. `fix` is None or (button text, what to
    set, its value), what to set being one of the explorer's controls: "schedule", "placement", "micro_batches" or
    "sizes" (the micro-batch sizes box)."""

    def __init__(self, message: str, fix=None):
        super().__init__(message)
        self.fix = fix


def check(layers: list[str], devices: list[str], assignment: dict, schedule: str, label: str, micro_batches: int,
          chunks: int, batch_width: int, cuts=(), sizes=None, tied=()):
    """(placement, Schedule) for a board (`devices` its columns, `assignment` layer -> device, `cuts` the layers that
    start a stage although the layer before is on the same device, as the V's turn) and the menus (`label` is the
    schedule as its menu shows it; `sizes`, the micro-batch sizes read by read_sizes, give the count when set;
    `tied`, pairs of layers sharing a weight); a Refusal says what is wrong and what to do. The library's own
    messages name its arguments, which a learner at the explorer never typed."""
    if len(devices) > len(layers):
        raise Refusal(f"{len(devices)} devices but only {len(layers)} layers: every device needs a layer. "
                      f"Use at most {len(layers)} devices.")
    # (a drop on a column drawn before the devices changed can name a device the board no longer has)
    stray = next(((layer, d) for layer, d in assignment.items() if d not in devices), None)
    if stray:
        raise Refusal(f"{stray[0]} sits on {stray[1]}, which is not on the board: drag it onto "
                      f"{' or '.join(devices)}.")
    missing = [layer for layer in layers if layer not in assignment]
    if missing:
        raise Refusal(f"{missing[0]} is on no device: drag it onto one.")
    placement = Placement(layers, assignment, kept_cuts(layers, assignment, cuts))
    empty = [d for d in devices if d not in assignment.values()]
    if empty:
        raise Refusal(f"{empty[0]} holds no layer: drag a layer onto it, or use fewer devices.")
    m = len(sizes) if sizes else micro_batches
    stage_devices, p = placement.stage_devices, len(devices)
    several = len(set(stage_devices)) != len(stage_devices)
    in_turn = schedules.is_round_robin(stage_devices) and max(stage_devices) + 1 == p
    if schedule in ("1f1b", "zb1") and several and not (schedule == "1f1b" and in_turn):
        stages = placement.stages
        d = next(dev for dev, _ in stages if [x for x, _ in stages].count(dev) > 1)
        runs = [" ".join(ls) for dev, ls in stages if dev == d]
        v = " (the V that ZB-V and DualPipeV run on)" if schedules.is_v_shape(stage_devices) and p > 1 else ""
        raise Refusal(f"{label} needs each device to hold one stage (one run of neighbouring "
                      f"layers), but {d.name} holds {len(runs)}: {' / '.join(runs)}{v}. Drag those layers "
                      f"together onto one device, or pick GPipe in the schedule menu.",
                      fix=("use GPipe", "schedule", "gpipe"))
    if schedule == "interleaved" or (schedule == "1f1b" and several):   # 1F1B on stages dealt in turn interleaves
        _check_interleaved(placement, layers, devices, in_turn, m, batch_width, label, schedule)
    if schedule in V_SCHEDULES:
        _check_v(placement, layers, devices, m, batch_width, label, schedule)
    _check_tied(placement, tied, layers, devices, schedule)
    try:
        made = schedules.make(schedule, stage_devices, m, chunks if schedule == "wavefront" else 1)
    except ValueError:
        if schedule not in V_SCHEDULES:
            raise
        raise Refusal(f"{label} cannot run {m} micro-batch{'es' if m != 1 else ''} on {plural(p, 'device')}. Pick more "
                      f"micro-batches, or pick ZB-V, which runs any number.", fix=("use ZB-V", "schedule", "zbv"))
    return placement, made


def _check_v(placement, layers, devices, m: int, batch_width: int, label: str, schedule: str) -> None:
    """The V-shape schedules: 2 stages on each device, down the devices and back, and (DualPipeV) a micro-batch
    for every stage."""
    p = len(devices)
    if 2 * p > len(layers):
        most = len(layers) // 2
        use = f"Use {'1 device' if most == 1 else f'{most} devices or fewer'}, or pick GPipe" if most else "Pick GPipe"
        raise Refusal(f"{label} needs two stages on every device, so at least {2 * p} layers for "
                      f"{plural(p, 'device')}; this model has {len(layers)}. {use}.",
                      fix=("use GPipe", "schedule", "gpipe"))
    if not schedules.is_v_shape(placement.stage_devices):
        v = str(v_layout(layers, devices))
        first = devices[0]
        raise Refusal(f"{label} needs the layers laid out as a V: {2 * p} stages that go down the devices and "
                      f"back up, so that {first} holds the first stage and the last (embed and decode), the next "
                      f"device the second and the one before last, and so on. For example: {v}. Drag the chips "
                      f"that way, press the button below, or pick GPipe.",
                      fix=("lay the layers out as a V", "placement", v))
    fewest = getattr(schedules, "fewest_micro_batches", None)          # V-Half and V-Min need a few blocks
    least = fewest(schedule, p) if fewest else 2 * p if schedule == "dualpipev" else 1
    if m < least:
        options = [k for k in range(1, batch_width + 1) if batch_width % k == 0 and k >= least]
        fix = (f"use {options[0]} micro-batches", "micro_batches", options[0]) if options else \
            ("use ZB-V", "schedule", "zbv")
        instead = f"Pick {options[0]} micro-batches or more, or pick ZB-V" if options else "Pick ZB-V"
        need = (f"as many micro-batches as stages: {least}" if least == 2 * p and schedule == "dualpipev" else
                f"{least} micro-batches")
        raise Refusal(f"{label} needs at least {need} for {plural(p, 'device')}, but you chose {m}. {instead}, "
                      "which runs any number.", fix=fix)


def _check_tied(placement, tied, layers, devices, schedule: str) -> None:
    """Layers that share a weight (a tied embedding and decoder) must sit on one device: the V puts them there."""
    for a, b in tied:
        da, db = placement.assignment[a].name, placement.assignment[b].name
        if da == db:
            continue
        p = len(devices)
        if 2 * p > len(layers):
            ways, fix = "drag them onto one device, or use fewer devices", None
        elif schedule in ("naive", "gpipe", "wavefront") or schedule in V_SCHEDULES:
            ways = "drag them onto one device, or press the button below for a V, which puts them together"
            fix = ("lay the layers out as a V", "placement", str(v_layout(layers, devices)))
        else:
            ways, fix = "drag them onto one device, or pick ZB-V, whose V puts them together", ("use ZB-V",
                                                                                                 "schedule", "zbv")
        raise Refusal(f"{a} and {b} share one weight matrix (tied weights), so they must sit on one device, but "
                      f"{a} is on {da} and {b} on {db}: each device would update a copy of its own. "
                      f"{ways[0].upper()}{ways[1:]}.", fix=fix)


def read_sizes(text: str, batch_width: int) -> tuple[int, ...] | None:
    """The micro-batch sizes box: None when empty (equal micro-batches), else the sizes, sequences each, which must
    add up to the batch width; a Refusal in the box's words otherwise, with a button back to equal micro-batches."""
    text = (text or "").strip()
    if not text:
        return None
    equal = ("use equal micro-batches", "sizes", "")
    parts = [part.strip() for part in re.split(r"[,\s]+", text) if part.strip()]
    whole = lambda part: part.isascii() and part.isdigit()   # noqa: E731  ("²" is a digit to str.isdigit)
    if not all(map(whole, parts)):
        bad = next(part for part in parts if not whole(part))
        bad = bad if len(bad) <= 12 else f"{bad[:10]}…"          # a message never echoes a long paste whole
        raise Refusal(f"sizes: “{bad}” is not a number of sequences. Write whole numbers with commas between, "
                      f"such as {example_sizes(batch_width)}, or leave the box empty for equal micro-batches.",
                      fix=equal)
    sizes = tuple(int(part) for part in parts)
    if 0 in sizes:
        raise Refusal(f"sizes {_listed(sizes)}: every micro-batch needs at least 1 sequence. Drop the 0, or leave "
                      f"the box empty for equal micro-batches.", fix=equal)
    if sum(sizes) != batch_width:
        raise Refusal(f"sizes {_listed(sizes)} add up to {plural(sum(sizes), 'sequence')}, but the "
                      f"batch holds {batch_width}: make them add up to {batch_width} (such as "
                      f"{example_sizes(batch_width)}), or leave the box empty for equal micro-batches.", fix=equal)
    return sizes


def _listed(sizes) -> str:
    """"1, 3, 3, 1"; a long paste shown by its start and its count."""
    shown = ", ".join(map(str, sizes[:10]))
    return shown if len(sizes) <= 12 else f"{shown}, … ({len(sizes)} in all)"


def example_sizes(width: int) -> str:
    """Sizes that add up to `width`, small first and last ones (the fill and the drain): 4,12,12,4 for 32."""
    if width < 4:
        return ",".join(["1"] * width)
    end = max(1, width // 8)
    middle, extra = divmod(width - 2 * end, 2)
    return f"{end},{middle + extra},{middle},{end}"


def _check_interleaved(placement, layers, devices, in_turn: bool, m: int, batch_width: int, label: str,
                       schedule: str) -> None:
    p = len(devices)
    if p < 2 or 2 * p > len(layers):
        most = len(layers) // 2
        use = "pick 1F1B" if most < 2 else f"use {'2' if most == 2 else f'2 to {most}'} devices, or pick 1F1B"
        raise Refusal(f"{label} needs 2 or more devices, each holding 2 or more stages, so at least "
                      f"{max(2 * p, 4)} layers for {max(p, 2)} devices; this model has {len(layers)}. "
                      f"{use[0].upper()}{use[1:]}.")
    options = [k for k in range(1, batch_width + 1) if batch_width % k == 0]   # what the slider offers
    fits = [k for k in options if k % p == 0]
    if not fits:                     # before the dealing fix, which would lead to a layout that cannot run either
        others = [q for q in range(2, len(layers) // 2 + 1) if any(k % q == 0 for k in options)]
        ways = [f"use {' or '.join(map(str, others))} devices"] if others else []
        if len(placement.stages) > p:   # several stages a device: 1F1B would interleave them too
            ways += ["drag each device's layers together (then 1F1B runs one stage per device)", "pick GPipe"]
            fix = ("use GPipe", "schedule", "gpipe")
        else:
            ways.append("pick 1F1B")
            fix = ("use 1F1B", "schedule", "1f1b")
        instead = ", ".join(ways[:-1]) + (", or " if len(ways) > 1 else "") + ways[-1] + "."
        instead = instead[0].upper() + instead[1:]
        raise Refusal(f"{label} sends micro-batches round the {p} devices in groups of {p}, but a batch of "
                      f"{sequences(batch_width)} splits into {', '.join(map(str, options))} micro-batch"
                      f"{'es' if options != [1] else ''}, none a multiple of {p}. {instead}", fix=fix)
    if not in_turn or len(placement.stages) < 2 * p:
        dealing = dealt(layers, devices)
        raise Refusal(f"{label} needs the layers dealt to the devices in turn, at least twice round: a run "
                      f"of layers on {devices[0]}, the next on {devices[1]}, and so on, "
                      f"then {devices[0]} again. For example: {dealing}. Drag the chips that way, "
                      f"press the button below, or pick 1F1B.",
                      fix=("deal the layers in turn", "placement", dealing))
    if m % p:
        best = min(fits, key=lambda k: abs(k - m))
        raise Refusal(f"{label} sends micro-batches round the {p} devices in groups of {p}, so their number "
                      f"must be a multiple of {p}; you chose {m}. Pick {best} micro-batches.",
                      fix=(f"use {best} micro-batches", "micro_batches", best))


def dealt(layers: list[str], devices: list[str]) -> str:
    """The layers cut into 2p runs as even as can be, run r on device r mod p: what interleaved 1F1B needs."""
    runs = 2 * len(devices)
    q, extra = divmod(len(layers), runs)
    groups, start = [], 0
    for r in range(runs):
        size = q + (r < extra)
        groups.append(f"{','.join(layers[start:start + size])}:{devices[r % len(devices)].replace(':', '')}")
        start += size
    return " | ".join(groups)
