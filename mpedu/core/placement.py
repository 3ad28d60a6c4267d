"""Placement: which device each layer lives on (MXNet's group2ctx); runs of layers form stages."""
from __future__ import annotations

import re
from typing import Iterable, Mapping

from ..runtime.devices import Device, device_list, get_device, get_devices

_RANGE_RE = re.compile(r"^([a-z_]+)(\d+)-(\d+)$")


def _shown(text) -> str:
    """repr(text), cut to its start and its length when long: a message never echoes a 10,000-character value."""
    shown = repr(text)
    return shown if len(shown) <= 60 else f"{shown[:50]}...' ({len(str(text)):,} characters)"



def tied_layers(model, names=None) -> list[tuple[str, str]]:
    """The pairs of layers (of `names`, default all, in model order) that share a weight, such as a tied
    embedding and decoder, the first holder first: they must sit on one device."""
    owner: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    for name in names if names is not None else model.layer_names:
        for p in model.layers[name].parameters():
            first = owner.setdefault(id(p), name)
            if first != name and (first, name) not in pairs:
                pairs.append((first, name))
    return pairs

class Placement:
    """An ordered map layer name -> Device covering every layer of a model once.

    Consecutive layers on one device form a stage. A device may hold several stages
    (e.g. `lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0`): allowed, at the price of more
    transfers. Two groups of a written placement are two stages even on one device: the V shape of
    `v_shape` puts stages r and 2p - 1 - r on device r, so the middle two share the last device:

        embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | lstm3,decode:vgpu0      stage devices 0 1 1 0

    (`cuts`: the layers that start a stage although the layer before is on the same device.)
    Build one with `parse`, `from_dict`, `even`, `single` or `v_shape`.
    """

    def __init__(self, layer_names: Iterable[str], assignment: Mapping[str, Device | str], cuts: Iterable[str] = ()):
        self.layer_names = list(layer_names)
        unknown = [name for name in assignment if name not in self.layer_names]
        if unknown:
            raise ValueError(f"layer {_shown(unknown[0])} is not in the model; its layers are "
                             f"{', '.join(self.layer_names)}")
        missing = [name for name in self.layer_names if name not in assignment]
        if missing:
            raise ValueError(f"layer {_shown(missing[0])} is not placed on any device; every layer needs one "
                             f"(unplaced: {', '.join(missing)}). Add it to a group, e.g. "
                             f"'{missing[0]}:vgpu0'")
        if not self.layer_names:
            raise ValueError("the model has no layers to place")
        self.assignment = {name: get_device(assignment[name]) for name in self.layer_names}
        cuts = set(cuts)
        if not cuts <= set(self.layer_names[1:]):
            raise ValueError(f"cuts {sorted(cuts - set(self.layer_names[1:]))} are not layers after the first; a cut "
                             "names the layer a stage starts at")
        self.cuts = frozenset(cuts)

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, model) -> "Placement":
        """Read `"embed,lstm0-3:vgpu0 | lstm4-7,decode:vgpu1"` (ranges like lstm0-3 allowed)."""
        if not isinstance(text, str):
            raise ValueError(f"a placement string is text like 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1', "
                             f"got {type(text).__name__} {_shown(text)}")
        if not text.strip():
            raise ValueError("empty placement: write groups like 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1'")
        assignment: dict[str, str] = {}
        group_of: dict[str, int] = {}
        for k, (names, device) in enumerate(read_groups(text, limit=len(model.layer_names))):
            for name in names:
                if name in assignment:
                    raise ValueError(f"layer {_shown(name)} is placed twice ({_shown(assignment[name])} and "
                                     f"{_shown(device)}); give each layer one device")
                assignment[name], group_of[name] = device, k
        placement = cls(model.layer_names, assignment)
        # a layer whose neighbour before it sits on its device in another group starts a stage of its own
        names = model.layer_names
        cuts = [b for a, b in zip(names, names[1:]) if a in group_of and b in group_of and group_of[a] != group_of[b]
                and placement.assignment[a] == placement.assignment[b]]
        return cls(names, assignment, cuts) if cuts else placement

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Device | str], model) -> "Placement":
        return cls(model.layer_names, mapping)

    @classmethod
    def even(cls, model, devices: int | Iterable) -> "Placement":
        """Contiguous groups with equal layer counts (the naive split; see balance for a better one)."""
        devs = device_list(devices)
        names = model.layer_names
        if not devs:
            raise ValueError("no devices given: pass a device count or a list such as ['vgpu:0', 'vgpu:1']")
        if len(devs) > len(names):
            raise ValueError(f"{len(devs)} devices but only {len(names)} layers ({', '.join(names)}): "
                             f"every device needs at least one layer; use at most {len(names)} devices")
        q, r = divmod(len(names), len(devs))
        assignment, start = {}, 0
        for k, dev in enumerate(devs):
            size = q + (1 if k < r else 0)
            for name in names[start:start + size]:
                assignment[name] = dev
            start += size
        return cls(names, assignment)

    @classmethod
    def single(cls, model, device: Device | str = "vgpu:0") -> "Placement":
        return cls(model.layer_names, {name: device for name in model.layer_names})

    @classmethod
    def v_shape(cls, model, devices: int | Iterable, sizes: list[int] | None = None) -> "Placement":
        """2p stages on p devices, stage s on device min(s, 2p - 1 - s): down the devices and back, so the
        first and the last stage (embed and decode) share device 0. `sizes`: the layers of each stage, in model
        order (default: as even as `even` would cut 2p stages)."""
        devs = device_list(devices)
        names, p = model.layer_names, len(devs)
        if sizes is None:
            q, r = divmod(len(names), 2 * p)
            sizes = [q + (1 if k < r else 0) for k in range(2 * p)]
        if len(sizes) != 2 * p or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != len(names):
            raise ValueError(f"a V shape on {p} devices has {2 * p} stages of at least one layer each, "
                             f"{len(names)} layers in all; got sizes {sizes}"
                             + (f" (the model has only {len(names)} layers)" if len(names) < 2 * p else ""))
        assignment, cuts, start = {}, [], 0
        for s, size in enumerate(sizes):
            for name in names[start:start + size]:
                assignment[name] = devs[min(s, 2 * p - 1 - s)]
            if s:
                cuts.append(names[start])
            start += size
        first = [names[k] for k in range(1, len(names)) if assignment[names[k]] == assignment[names[k - 1]]]
        return cls(names, assignment, [c for c in cuts if c in first])

    # -- checks ---------------------------------------------------------------------
    def check_tied_weights(self, model) -> None:
        """Refuse a weight used by layers on two devices (tied embedding and decoder): each device would
        update its own copy, and the two would drift apart. On one device a tied weight is fine."""
        for other, name in tied_layers(model, self.layer_names):
            if self.assignment[other] != self.assignment[name]:
                raise ValueError(f"tied weights: {other} ({self.assignment[other]}) and {name} "
                                 f"({self.assignment[name]}) share one weight matrix, so they must sit on the "
                                 "same device; place them together or build the model with tie_weights=False")

    # -- derived --------------------------------------------------------------------
    @property
    def stages(self) -> list[tuple[Device, list[str]]]:
        """Runs of consecutive layers on one device, in model order."""
        runs: list[tuple[Device, list[str]]] = []
        for name in self.layer_names:
            dev = self.assignment[name]
            if runs and runs[-1][0] == dev and name not in self.cuts:
                runs[-1][1].append(name)
            else:
                runs.append((dev, [name]))
        return runs

    @property
    def devices(self) -> list[Device]:
        """The devices used, in the order their first stage appears."""
        return list(dict.fromkeys(dev for dev, _ in self.stages))

    @property
    def stage_devices(self) -> list[int]:
        """For each stage, the index of its device in `devices` (what schedules need)."""
        index = {dev: k for k, dev in enumerate(self.devices)}
        return [index[dev] for dev, _ in self.stages]

    def __str__(self) -> str:
        # devices written without their colon (vgpu0), as in MXNet's group2ctx strings
        return " | ".join(f"{','.join(_compress(layers))}:{dev.name.replace(':', '')}"
                          for dev, layers in self.stages)

    def __repr__(self) -> str:
        return f"Placement({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Placement) and self.assignment == other.assignment and self.cuts == other.cuts


def read_groups(text: str, limit: int | None = None) -> list[tuple[list[str], str]]:
    """'embed,lstm0-1:vgpu0 | decode:cuda:1' -> [(['embed', 'lstm0', 'lstm1'], 'vgpu0'), (['decode'], 'cuda:1')].

    Only the reading: device names are returned as written (Placement.parse turns them into
    Devices; mpedu.distributed reads them as rank labels). `limit` bounds a layer range."""
    groups = []
    for group in text.split("|"):
        if group.count(":") < 1:
            raise ValueError(f"placement group {_shown(group.strip())} has no device: write 'layers:device', "
                             "e.g. 'embed,lstm0:vgpu0'")
        layers, device = group.rsplit(":", 1)
        if not device.strip():
            raise ValueError(f"placement group {_shown(group.strip())} names no device after ':'")
        # "lstm0:vgpu:1" splits as ("lstm0:vgpu", "1"); "vgpu:-1" too, and the device then says it does not exist
        if re.fullmatch(r"\s*-?\d+\s*", device) and ":" in layers:
            layers, device = layers.rsplit(":", 1)[0], layers.rsplit(":", 1)[1] + ":" + device.strip()
        if len(device.strip()) > 32:     # device names are short; a long one would be echoed whole below
            raise ValueError(f"{_shown(device.strip())} is not a device name; devices look like vgpu:0, "
                             "cuda:1 or cpu")
        groups.append((_expand(layers, limit=limit), device.strip()))
    return groups


def _expand(layers: str, limit: int | None = None) -> list[str]:
    """'embed, lstm0-2' -> ['embed', 'lstm0', 'lstm1', 'lstm2']; a range over `limit` names is refused
    before it is spelled out (lstm0-999999999 would take minutes and gigabytes)."""
    names = []
    for item in layers.split(","):
        item = item.strip()
        if not item:
            continue
        match = _RANGE_RE.match(item)
        if match:
            prefix, lo, hi = match.group(1), int(match.group(2)), int(match.group(3))
            if hi < lo:
                raise ValueError(f"layer range {_shown(item)} runs backwards; write {prefix}{hi}-{lo}")
            if limit is not None and hi - lo >= limit:
                raise ValueError(f"layer range {_shown(item)} is wider than the model, which has {limit} layers; "
                                 f"write a range such as {prefix}0-1")
            names += [f"{prefix}{k}" for k in range(lo, hi + 1)]
        else:
            names.append(item)
    if not names:
        raise ValueError(f"a placement group names no layers before its device: {_shown(layers)}")
    return names


def _compress(names: list[str]) -> list[str]:
    """['lstm0', 'lstm1', 'lstm2'] -> ['lstm0-2'] for the string form."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush():
        if len(run) >= 2:
            out.append(f"{run[0][0]}{run[0][1]}-{run[-1][1]}")
        else:
            out.extend(f"{p}{k}" for p, k in run)
        run.clear()

    for name in names:
        match = re.match(r"^([a-z_]+)(\d+)$", name)
        if match and run and run[-1][0] == match.group(1) and run[-1][1] + 1 == int(match.group(2)):
            run.append((match.group(1), int(match.group(2))))
            continue
        flush()
        if match:
            run.append((match.group(1), int(match.group(2))))
        else:
            out.append(name)
    flush()
    return out


def as_placement(placement, model) -> Placement:
    """A Placement from what a runner accepts: a Placement (of this model's layers), a placement string,
    a dict layer -> device, or a device count (an even split)."""
    if isinstance(placement, Placement):
        if placement.layer_names != model.layer_names:
            raise ValueError(f"the placement is for layers {placement.layer_names}, "
                             f"but the model has {model.layer_names}")
        return placement
    if isinstance(placement, str):
        return Placement.parse(placement, model)
    if isinstance(placement, dict):
        return Placement.from_dict(placement, model)
    if isinstance(placement, int) and not isinstance(placement, bool):
        return Placement.even(model, get_devices(placement))
    raise TypeError(f"placement must be a Placement, a string like 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1', "
                    f"a dict or a device count; got {type(placement).__name__}")
