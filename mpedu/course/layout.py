"""The explorer's stages on the board: the schedule menu with the V-shape schedules, the stage cuts a board keeps (two
stages on one device, as the V's turn needs), the V laid out as Placement.v_shape does, and the tied weights a model
has. No widgets here: the refusals and the explorer both read it."""
from __future__ import annotations

from types import SimpleNamespace

from ..core import schedules
from ..core.placement import Placement
from .wording import SCHEDULES

# The schedules that run on the V placement (2 stages a device, device 0 holding the first and the last), as the menu
# names them; V-Half and V-Min where the library has them.
_V_LABELS = {"zbv": "zero bubble V (ZB-V)", "dualpipev": "DualPipeV", "v_half": "V-Half", "v_min": "V-Min"}
V_SCHEDULES = {key: text for key, text in _V_LABELS.items() if key in schedules.GENERATORS}
SCHEDULE_MENU = {**SCHEDULES, **V_SCHEDULES}


def kept_cuts(layers: list[str], assignment: dict, cuts) -> list[str]:
    """The cuts that still mean something on this board: a layer that starts a stage although the layer before it
    sits on the same device (after a drag, a cut whose neighbours went to two devices is no cut any more)."""
    cuts = set(cuts)
    return [b for a, b in zip(layers, layers[1:]) if b in cuts and a in assignment and assignment.get(b) ==
            assignment[a]]


def stage_devices(layers: list[str], assignment: dict, cuts) -> list[int]:
    """Each stage's device, numbered in the order the devices first appear (Placement.stage_devices)."""
    index, out, cuts = {}, [], set(cuts)
    for k, name in enumerate(layers):
        device = assignment[name]
        if not k or device != assignment[layers[k - 1]] or name in cuts:
            out.append(index.setdefault(device, len(index)))
    return out


def is_v(layers: list[str], assignment: dict, cuts) -> bool:
    """Whether a board (every layer on a device) is laid out as a V."""
    if any(name not in assignment for name in layers):
        return False
    return schedules.is_v_shape(stage_devices(layers, assignment, kept_cuts(layers, assignment, cuts)))


def with_turn(layers: list[str], assignment: dict, cuts) -> list[str]:
    """`cuts`, plus the V's turn where the board is one cut short of a V: a run of neighbouring layers on one device
    that, cut in its middle, makes the stages go down the devices and back (device r holding stages r and 2p-1-r).
    A learner who drags a chip between stages of a V keeps a V; any other board keeps its cuts as they are."""
    cuts = kept_cuts(layers, assignment, cuts)
    if any(name not in assignment for name in layers) or schedules.is_v_shape(stage_devices(layers, assignment, cuts)):
        return cuts
    starts = [k for k, name in enumerate(layers)
              if not k or assignment[name] != assignment[layers[k - 1]] or name in cuts] + [len(layers)]
    for lo, hi in zip(starts, starts[1:]):
        if hi - lo >= 2:
            turn = layers[lo + (hi - lo + 1) // 2]            # the first half one layer longer, as v_shape cuts
            if schedules.is_v_shape(stage_devices(layers, assignment, cuts + [turn])):
                return sorted(cuts + [turn], key=layers.index)
    return cuts


def v_layout(layers: list[str], devices: list[str]) -> Placement:
    """The V on these devices, as Placement.v_shape lays it out (2p stages as even as can be)."""
    return Placement.v_shape(SimpleNamespace(layer_names=list(layers)), devices)


