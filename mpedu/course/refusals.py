"""The explorer's refusals: why a board and menu choice cannot be predicted, in the words on screen, and the fix."""
from __future__ import annotations

from ..core import schedules
from ..core.placement import Placement
from .wording import sequences


class Refusal(ValueError):
    """A choice the explorer cannot predict, in the learner's words. `fix` is None or (button text, what to
    set, its value), what to set being one of the explorer's controls: "schedule", "placement" or "micro_batches"."""

    def __init__(self, message: str, fix=None):
        super().__init__(message)
        self.fix = fix


def check(layers: list[str], devices: list[str], assignment: dict, schedule: str, label: str, micro_batches: int,
          chunks: int, batch_width: int):
    """(placement, Schedule) for a board (`devices` its columns, `assignment` layer -> device) and the menus
    (`label` is the schedule as its menu shows it); a Refusal says what is wrong and what to do. The
    library's own messages name its arguments, which a learner at the explorer never typed."""
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
    placement = Placement(layers, assignment)
    empty = [d for d in devices if d not in assignment.values()]
    if empty:
        raise Refusal(f"{empty[0]} holds no layer: drag a layer onto it, or use fewer devices.")
    m = micro_batches
    stage_devices, p = placement.stage_devices, len(devices)
    several = len(set(stage_devices)) != len(stage_devices)
    in_turn = schedules.is_round_robin(stage_devices) and max(stage_devices) + 1 == p
    if schedule in ("1f1b", "zb1") and several and not (schedule == "1f1b" and in_turn):
        stages = placement.stages
        d = next(dev for dev, _ in stages if [x for x, _ in stages].count(dev) > 1)
        runs = [" ".join(ls) for dev, ls in stages if dev == d]
        raise Refusal(f"{label} needs each device to hold one stage (one run of neighbouring "
                      f"layers), but {d.name} holds {len(runs)}: {' / '.join(runs)}. Drag those layers "
                      f"together onto one device, or pick GPipe in the schedule menu.",
                      fix=("use GPipe", "schedule", "gpipe"))
    if schedule == "interleaved" or (schedule == "1f1b" and several):   # 1F1B on stages dealt in turn interleaves
        _check_interleaved(placement, layers, devices, in_turn, m, batch_width, label, schedule)
    return placement, schedules.make(schedule, stage_devices, m, chunks if schedule == "wavefront" else 1)


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
