"""Will it fit? The memory a placement and schedule need per device, checked against caps before a step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import schedules
from .devices import Device, format_size, get_device, list_devices, parse_size
from .memory import GPU_LEAVES_OUT, measured_peak
from .balance import min_max_split
from .placement import Placement
from .schedules import Action, Schedule
from .train import check_batch


class MemoryCapError(ValueError):
    """A step would need more memory on a device than its memory_cap; the message says what fits."""


def memory_estimate(pipe, batch) -> list["DeviceNeed"]:
    """What each device needs for one training step on batches of this shape, in bytes:
    its parameters, their gradients, and the activations autograd saves for backward of
    the micro-batches (and time chunks) the schedule holds at once on that device.

    The activations of one micro-batch come from a dry run of its forward with
    saved-tensor hooks (the counting a training step records in its timeline), made
    once per bucket shape. Not counted: optimizer state (the pipeline never sees the
    optimizer; plain SGD keeps none) and short-lived buffers inside an op.
    """
    check_batch(batch, pipe.model.vocab_size)
    plan = pipe._plan(batch)
    return _needs(pipe, pipe.placement.stages, pipe.schedule, _layer_storages(pipe, batch, plan))


def _layer_storages(pipe, batch, plan) -> dict[str, dict[int, int]]:
    """Per layer, the storages saved for backward by one (micro-batch, chunk) unit: {address: bytes}."""
    if plan.layer_storages is None:
        micro = batch.split(pipe.micro_batches)[0]
        lo, hi = max(plan.chunk_bounds, key=lambda b: b[1] - b[0])     # the longest time chunk
        held, storages = [], {}
        cuda = sorted({d.torch_device.index or 0 for d in pipe.devices if d.is_cuda})
        # the dry run must not move the generators a real step (dropout) draws from
        with torch.random.fork_rng(devices=cuda):
            x = micro.inputs[lo:hi]
            for stage in pipe.stages:
                dev = stage.device.torch_device
                targets = micro.targets[lo:hi].to(dev) if stage.is_last else None
                out, per_layer = stage.measure(x.to(dev), targets)
                held.append(out)    # keep every graph alive: no address is reused while counting
                storages.update(zip(stage.names, per_layer))
                x = out.detach()
        del held
        plan.layer_storages = storages
    return plan.layer_storages


def _needs(pipe, stages, schedule: Schedule, storages: dict) -> list["DeviceNeed"]:
    """DeviceNeed per device for `stages` [(device, layer names)] run by `schedule`."""
    devices = list(dict.fromkeys(dev for dev, _ in stages))
    fixed = {dev: [0, 0] for dev in devices}          # parameters, gradients
    seen: set[int] = set()
    for dev, names in stages:
        for name in names:
            for p in pipe.model.layers[name].parameters():
                if id(p) not in seen:                   # tied weights: one tensor, counted once
                    seen.add(id(p))
                    fixed[dev][0] += p.numel() * p.element_size()
                    fixed[dev][1] += p.numel() * p.element_size() if p.requires_grad else 0
    per_unit = [_union_bytes(storages[name] for name in names) for _, names in stages]
    needs = []
    for d, (dev, row) in enumerate(zip(devices, schedule.actions)):
        held = units = peak = peak_units = 0
        for a in row:
            if a.kind == "F":
                held, units = held + per_unit[a.stage], units + 1
                peak, peak_units = max(peak, held), max(peak_units, units)
            elif a.kind == "W" or a.stage not in schedule.split_backward:   # what frees the unit
                held, units = held - per_unit[a.stage], units - 1
        needs.append(DeviceNeed(dev.name, *fixed[dev], peak, peak_units, pipe.memory_cap.get(dev.name)))
    return needs


def check_memory(pipe, batch, plan) -> None:
    needs = memory_estimate(pipe, batch)
    over = [n for n in needs if not n.fits]
    if not over:
        plan.memory_checked = True
        return
    what = (f"a training step on batches of T={plan.T}, B={plan.B} ({pipe.schedule.name}, "
            f"{pipe.micro_batches} micro-batches" + (f", {pipe.chunks} time chunks" if pipe.chunks > 1 else "")
            + ")")
    lines = [f"{n.device} needs {format_size(n.total)} for {what}: {n.parts()}; more than its memory_cap "
             f"{format_size(n.cap)}." + gpu_measured(n.device) for n in over]
    raise MemoryCapError(" ".join(lines) + " " + _what_fits(pipe, plan))


def gpu_measured(device: str) -> str:
    """On a GPU, a sentence with the allocator's measured peak beside the estimate ("" elsewhere)."""
    peak = measured_peak(device)
    if peak is None:
        return ""
    return f" Measured on {device} so far: a peak of {format_size(peak)} allocated; {GPU_LEAVES_OUT}."


def _what_fits(pipe, plan) -> str:
    """A placement that fits the caps (over these devices, else over more), or why none does."""
    names, storages = pipe.model.layer_names, plan.layer_storages
    p, n = len(pipe.devices), len(names)
    caps = [pipe.memory_cap.get(d.name) for d in pipe.devices]
    smallest = min(c for c in caps if c is not None)

    def need(i, j, device, units) -> DeviceNeed:     # one stage, layers i..j-1
        return _needs(pipe, [(device, names[i:j])], _one_row(units), storages)[0]

    for q in range(p, n + 1):
        devices = _devices_for(pipe, q)
        if devices is None:
            return (f"No placement over {p} devices fits, and this machine offers too few devices of "
                    f"this kind to spread the layers further; raise the cap." + _fewer_in_flight_hint(pipe))
        units, limits = _units_per_stage(pipe, q), caps + [smallest] * (q - p)
        found = min_max_split(n, q, lambda i, j, k: (
            need(i, j, devices[k], units[k]).total / limits[k] if limits[k] else 0.0))
        if found is None or found[0] > 1.0:      # some device would hold more than its cap
            continue
        counts = found[1]
        starts = [sum(counts[:k]) for k in range(q)]
        fits = Placement(names, {name: devices[k] for k in range(q)
                                 for name in names[starts[k]:starts[k] + counts[k]]})
        totals = ", ".join(f"{devices[k]} {format_size(need(starts[k], starts[k] + counts[k], devices[k], units[k]).total)}"
                           for k in range(q))
        where = "A placement that fits" if q == p else (
            f"No placement over these {p} devices fits; over {q} devices with {format_size(smallest)} each, one does")
        return f"{where}: '{fits}' (needs {totals})." + _fewer_in_flight_hint(pipe)
    worst = max(range(n), key=lambda i: need(i, i + 1, pipe.devices[0], units[0]).total)
    return (f"No placement fits, even one layer per device: {names[worst]} alone needs "
            f"{format_size(need(worst, worst + 1, pipe.devices[0], units[0]).total)} with {units[0]} "
            f"micro-batches in flight; raise the cap, or use smaller batches or shorter buckets."
            + _fewer_in_flight_hint(pipe))


def _fewer_in_flight_hint(pipe) -> str:
    p = len(pipe.devices)
    if pipe.schedule.name == "gpipe" and pipe.micro_batches > p:
        return (f" Or hold fewer micro-batches at once: 1f1b keeps at most {p} per device where gpipe "
                f"keeps all {pipe.micro_batches}.")
    return ""


def _devices_for(pipe, q: int) -> list[Device] | None:
    """This pipeline's devices, then unused ones of the same kind, q in all (None: not enough)."""
    virtual = pipe.devices[0].virtual
    spare = [d for d in list_devices() if d.virtual == virtual and d not in pipe.devices]
    devices = pipe.devices + spare[:q - len(pipe.devices)]
    return devices if len(devices) == q else None


def _units_per_stage(pipe, q: int) -> list[int]:
    """Units each stage of a one-stage-per-device split over q devices holds at most, under this
    schedule's kind (gpipe: every micro-batch; 1f1b: at most q - s)."""
    try:
        schedule = schedules.make(pipe.schedule.name, list(range(q)), pipe.micro_batches, pipe.chunks)
    except ValueError:                       # e.g. interleaved needs several stages per device
        return [pipe.micro_batches * pipe.chunks] * q
    peaks = []
    for row in schedule.actions:
        units = peak = 0
        for a in row:
            units += 1 if a.kind == "F" else -1 if (a.kind == "W" or a.stage not in schedule.split_backward) else 0
            peak = max(peak, units)
        peaks.append(peak)
    return peaks


@dataclass
class DeviceNeed:
    """Bytes one device needs for a training step (see Pipeline.memory_estimate)."""

    device: str
    params: int
    grads: int
    activations: int      # the most saved-for-backward bytes held at once
    in_flight: int        # the most (micro-batch, chunk) units held at once
    cap: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.activations

    @property
    def fits(self) -> bool:
        return self.cap is None or self.total <= self.cap

    def parts(self) -> str:
        held = f"{self.in_flight} micro-batch{'es' if self.in_flight != 1 else ''}"
        return (f"parameters {format_size(self.params)} + gradients {format_size(self.grads)} + activations "
                f"{format_size(self.activations)} ({held} held at once)")

    def __str__(self) -> str:
        cap = f", cap {format_size(self.cap)}" if self.cap is not None else ""
        return f"{self.device}: {format_size(self.total)} = {self.parts()}{cap}"


def _union_bytes(dicts) -> int:
    """Bytes of the distinct storages in several {address: bytes} maps (a layer's output saved
    by the next layer too is counted once)."""
    merged: dict[int, int] = {}
    for d in dicts:
        merged.update(d)
    return sum(merged.values())


def _one_row(units: int) -> Schedule:
    """A one-device schedule that holds `units` forwards before their backwards (for estimates)."""
    row = [Action("F", 0, i) for i in range(units)] + [Action("B", 0, i) for i in range(units)]
    return Schedule("estimate", (0,), max(units, 1), [row])


def parse_caps(memory_cap, devices: list[Device]) -> dict[str, int]:
    """{device name: bytes} from one size for all devices, or a dict device -> size."""
    if memory_cap is None:
        return {}
    if not isinstance(memory_cap, dict):
        size = parse_size(memory_cap)
        return {d.name: size for d in devices}
    caps = {}
    for name, size in memory_cap.items():
        dev = get_device(name)
        if dev not in devices:
            raise ValueError(f"memory_cap names {dev}, which this placement does not use; it uses "
                             f"{', '.join(d.name for d in devices)}")
        if dev.name in caps:      # 'vgpu0' and 'vgpu:0' are one device
            raise ValueError(f"memory_cap gives {dev} two caps ({caps[dev.name]:,} and {parse_size(size):,} bytes, "
                             f"the second as {name!r}); give each device one cap")
        caps[dev.name] = parse_size(size)
    return caps
