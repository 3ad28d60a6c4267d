"""Will it fit? The memory a placement and schedule need per device (mpedu.predict.footprint), checked before a step."""
from __future__ import annotations

import dataclasses
import weakref

import torch

from ..core import schedules
from ..core.placement import Placement
from ..core.recompute import recompute_modes
from ..core.runner import check_batch
from ..core.schedules import Action, Schedule
from ..lm import dropout
from ..runtime.devices import Device, get_device, list_devices
from ..runtime.values import format_size, parse_size
from .footprint import Footprint, device_footprints, param_sizes, stage_footprint
from .memory import GPU_LEAVES_OUT, measured_peak
from .partition import min_max_split
from .profiling import Costs


class MemoryCapError(ValueError):
    """A step would need more memory on a device than its memory_cap; the message says what fits."""


def layer_sizes(stages, micro, chunk_bounds, model) -> list[Costs]:
    """The bytes of every layer for mpedu.predict.footprint, per time chunk: from a dry run of the stages'
    forwards (on their own devices) on one micro-batch `micro` cut to each chunk length, a Costs with
    no times for each chunk in `chunk_bounds` (chunks of one length share one; T not a multiple of
    the chunk count gives two lengths, and a recurrent layer's saved bytes are not proportional to
    the length). Counted as a training step counts them (Stage's saved-tensor hooks): not the
    weights, nor the step's token ids and targets.
    """
    by_length: dict[int, Costs] = {}
    for lo, hi in chunk_bounds:
        if hi - lo not in by_length:
            by_length[hi - lo] = _chunk_sizes(stages, micro, lo, hi, model)
    return [by_length[hi - lo] for lo, hi in chunk_bounds]


def _chunk_sizes(stages, micro, lo: int, hi: int, model) -> Costs:
    """layer_sizes for the time steps lo..hi-1 of `micro`."""
    held, storages, outputs, input_saved = [], [], [], []
    cuda = sorted({s.device.torch_device.index or 0 for s in stages if s.device.is_cuda})
    # the dry run must not move the generators a real step (dropout) draws from; its dropout is positional,
    # as in a step (bool masks, where torch's own dropout would save float ones)
    with torch.random.fork_rng(devices=cuda), dropout.at(dropout.Position(0, 0)):
        x = micro.inputs[lo:hi]
        for stage in stages:
            dev = stage.device.torch_device
            targets = micro.targets[lo:hi].to(dev) if stage.is_last else None
            outs, per_layer, out_bytes, in_saved = stage.measure(x.to(dev), targets)
            held.append(outs)   # keep every graph alive: no address is reused while counting
            storages += per_layer
            outputs += out_bytes
            input_saved += in_saved
            x = outs[-1].detach()
    del held
    names = [name for stage in stages for name in stage.names]
    shared = [0] + [sum(n for ptr, n in storages[k].items() if ptr in storages[k - 1]) for k in range(1, len(names))]
    params, trainable = param_sizes(model, names)
    zeros = [0.0] * len(names)
    return Costs(names, zeros, zeros, zeros, zeros, [sum(s.values()) for s in storages], outputs, params, shared,
                 micro_batch=(hi - lo, micro.inputs.shape[1]), device=stages[0].device.name,
                 trainable_bytes=trainable, input_saved_bytes=input_saved)


def whole_sequence(chunk_sizes: list[Costs]) -> Costs:
    """One Costs for a whole micro-batch from layer_sizes' per-chunk ones: their bytes added up (what a
    footprint given `chunks` divides among the units again)."""
    first = chunk_sizes[0]
    total = {key: [sum(getattr(c, key)[k] for c in chunk_sizes) for k in range(len(first.names))]
             for key in ("activation_bytes", "output_bytes", "shared_bytes", "input_saved_bytes")}
    return dataclasses.replace(first, **total, micro_batch=(sum(c.micro_batch[0] for c in chunk_sizes),
                                                             first.micro_batch[1]))


def check_memory(footprints: list[Footprint], chunk_sizes: list[Costs], placement: Placement, schedule: Schedule,
                 recompute, caps: dict, shape: tuple[int, int]) -> None:
    """Raise MemoryCapError when a device's footprint is over its cap, naming a placement that fits.
    chunk_sizes: layer_sizes' Costs of one micro-batch, one per time chunk."""
    over = [n for n in footprints if not n.fits]
    if not over:
        return
    T, B = shape
    m, chunks = schedule.micro_batches, schedule.chunks
    what = (f"a training step on batches of T={T}, B={B} ({schedule.name}, {m} micro-batch{'es' if m != 1 else ''}"
            + (f", {chunks} time chunks" if chunks > 1 else "") + ")")
    lines = [f"{n.device} needs {format_size(n.total)} for {what}: {n.parts()}; more than its memory_cap "
             f"{format_size(n.cap)}." + gpu_measured(n.device) for n in over]
    raise MemoryCapError(" ".join(lines) + " " + _what_fits(chunk_sizes, placement, schedule, recompute, caps))


def gpu_measured(device: str) -> str:
    """On a GPU, a sentence with the allocator's measured peak beside the estimate ("" elsewhere)."""
    peak = measured_peak(device)
    if peak is None:
        return ""
    return f" Measured on {device} so far: a peak of {format_size(peak)} allocated; {GPU_LEAVES_OUT}."



def _what_fits(chunk_sizes: list[Costs], placement: Placement, schedule: Schedule, recompute, caps: dict) -> str:
    """A placement that fits the caps (over these devices, else over more), or why none does."""
    sizes = whole_sequence(chunk_sizes)
    names, devices_now = sizes.names, placement.devices
    p, n = len(devices_now), len(names)
    m, chunks = schedule.micro_batches, schedule.chunks
    smallest = min(caps[d.name] for d in devices_now if d.name in caps)
    modes = recompute_modes(recompute, len(placement.stages))
    mode = modes[0] if len(set(modes)) == 1 else None      # a per-stage choice does not carry over to new stages

    def need(i, j, device, k, rows) -> Footprint:     # layers i..j-1 as stage k, running rows[k]
        layers = [names[i:j]]
        each = [c.stages(layers)[0] for c in chunk_sizes] if chunks > 1 else None   # each chunk its own bytes
        return stage_footprint(sizes.stages(layers)[0], rows[k], k, mode, m, chunks, split, device.name,
                               per_chunk=each)

    rows, split = _rows_per_stage(schedule, p)
    for q in range(p, n + 1):
        devices = _devices_for(devices_now, q)
        if devices is None:
            return (f"No placement over {p} devices fits, and this machine offers too few devices of "
                    f"this kind to spread the layers further; raise the cap." + _hints(schedule, p, modes))
        rows, split = _rows_per_stage(schedule, q)
        limits = [caps.get(d.name) for d in devices_now] + [smallest] * (q - p)
        found = min_max_split(n, q, lambda i, j, k: (
            need(i, j, devices[k], k, rows).total / limits[k] if limits[k] else 0.0))
        if found is None or found[0] > 1.0:      # some device would hold more than its cap
            continue
        counts = found[1]
        starts = [sum(counts[:k]) for k in range(q)]
        fits = Placement(names, {name: devices[k] for k in range(q)
                                 for name in names[starts[k]:starts[k] + counts[k]]})
        totals = ", ".join(
            f"{devices[k]} {format_size(need(starts[k], starts[k] + counts[k], devices[k], k, rows).total)}"
            for k in range(q))
        where = "A placement that fits" if q == p else (
            f"No placement over these {p} devices fits; over {q} devices with {format_size(smallest)} each, one does")
        under = (" under 1f1b (interleaved needs two or more stages per device; this is one stage each)"
                 if schedule.name == "interleaved" else "")
        return f"{where}{under}: '{fits}' (needs {totals})." + _hints(schedule, p, modes)
    worst = max(range(n), key=lambda i: need(i, i + 1, devices_now[0], 0, rows).total)
    alone = need(worst, worst + 1, devices_now[0], 0, rows)
    return (f"No placement fits, even one layer per device: {names[worst]} alone needs "
            f"{format_size(alone.total)} with {alone.in_flight} "
            f"micro-batches in flight; raise the cap, or use smaller batches or shorter buckets."
            + _hints(schedule, p, modes))


def _hints(schedule: Schedule, p: int, modes: list) -> str:
    """Other ways to hold fewer activations: a schedule with fewer micro-batches in flight, recomputation."""
    hint = ""
    if schedule.name == "gpipe" and schedule.micro_batches > p:
        hint += (f" Or hold fewer micro-batches at once: 1f1b keeps at most {p} per device where gpipe "
                 f"keeps all {schedule.micro_batches}.")
    if all(mode is None for mode in modes) and schedule.micro_batches * schedule.chunks > 1:
        hint += (" Or recompute activations (recompute='all', --recompute all): each stage then keeps only its "
                 "input per micro-batch and runs its forward again before the backward.")
    return hint


def _devices_for(devices: list[Device], q: int) -> list[Device] | None:
    """These devices, then unused ones of the same kind, q in all (None: not enough)."""
    virtual = devices[0].virtual
    spare = [d for d in list_devices() if d.virtual == virtual and d not in devices]
    more = devices + spare[:q - len(devices)]
    return more if len(more) == q else None


def _rows_per_stage(schedule: Schedule, q: int) -> tuple[list[list[Action]], set]:
    """Per stage of a one-stage-per-device split over q devices, the actions it would run under this
    schedule's kind (gpipe: every micro-batch before the first backward; 1f1b: at most q - s), and
    the stages whose W frees a micro-batch."""
    m, chunks = schedule.micro_batches, schedule.chunks
    name = "1f1b" if schedule.name == "interleaved" else schedule.name    # it needs several stages per device
    try:
        made = schedules.make(name, list(range(q)), m, chunks)
        return made.actions, set(made.split_backward)
    except ValueError:                       # e.g. interleaved needs several stages per device
        return [[Action(a.kind, k, a.mb) for a in _one_row(m * chunks).actions[0]] for k in range(q)], set()


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


def cap_memory(pipe, memory_cap):
    """Install a memory cap on a Pipeline and return it: before its first training step on each batch
    shape (and again when other weights train: a thawed layer saves more), memory_estimate is checked
    against the cap; a device over it raises MemoryCapError naming a placement that fits, before any
    worker runs. `memory_cap` is one size for every device ("2MB", or bytes) or a dict device -> size
    ({"vgpu:0": "2MB"}); None installs nothing. `python -m mpedu train --memory-cap` and
    `train(..., memory_cap=...)` install it; the step itself knows nothing of memory."""
    caps = parse_caps(memory_cap, pipe.devices)
    if caps:        # one cap at a time: a new one replaces the old
        pipe.before_training_step[:] = [g for g in pipe.before_training_step if not isinstance(g, MemoryGuard)]
        pipe.before_training_step.append(MemoryGuard(pipe, caps))
    return pipe


class MemoryGuard:
    """The check cap_memory installs: called with each training batch, it estimates once per shape and
    per choice of trained weights, and raises MemoryCapError when a device would go over its cap."""

    def __init__(self, pipe, caps: dict[str, int]):
        self.pipe, self.caps = pipe, caps
        self.checked: set = set()

    def __call__(self, batch) -> None:
        pipe = self.pipe
        key = tuple(batch.inputs.shape), _which_train(pipe)
        if key not in self.checked:
            check_memory(memory_estimate(pipe, batch), _layer_sizes(pipe, batch), pipe.placement, pipe.schedule,
                         pipe.recompute, self.caps, key[0])
            self.checked.add(key)


def caps_of(pipe) -> dict[str, int]:
    """The caps installed on `pipe` by cap_memory ({} when none)."""
    return next((g.caps for g in pipe.before_training_step if isinstance(g, MemoryGuard)), {})


def memory_estimate(pipe, batch) -> list[Footprint]:
    """What each device of a Pipeline holds for a training step on batches of this shape: its weights,
    their gradients, and the activations at the schedule's peak (mpedu.predict.footprint), with the
    pipeline's recomputation, each against its cap when one is installed. The activations of one
    micro-batch come from a dry run of its forward with saved-tensor hooks (the counting a training step
    records in its timeline), made once per bucket shape (and per width, for micro-batches of unequal
    sizes: each holds its own). Not counted: optimizer state (the pipeline never sees the optimizer; plain
    SGD keeps none) and short-lived buffers inside an op."""
    each = _micro_batch_sizes(pipe, batch)         # per micro-batch, per time chunk
    if len(set(map(id, each))) == 1:               # equal micro-batches: one dry run for all
        return device_footprints(each[0][0], pipe.placement, pipe.schedule, pipe.recompute, caps=caps_of(pipe),
                                 chunk_costs=each[0])
    return device_footprints(each[0][0], pipe.placement, pipe.schedule, pipe.recompute, caps=caps_of(pipe),
                             micro_batch_costs=each)


_SIZES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # pipe -> {(shape, trains): layer sizes}


def _which_train(pipe) -> tuple[bool, ...]:
    """Which of the stages' weights require grad now: a key for what a step saves."""
    return tuple(p.requires_grad for stage in pipe.stages for layer in stage.layers for p in layer.parameters())


def _layer_sizes(pipe, batch) -> list[Costs]:
    """layer_sizes of the widest micro-batch of `batch` (all of them, when they are equal): what a hint
    about other placements reads, erring on the side of more memory."""
    each = _micro_batch_sizes(pipe, batch)
    return max(each, key=lambda sizes: sizes[0].micro_batch[1])


def _micro_batch_sizes(pipe, batch) -> list[list[Costs]]:
    """layer_sizes for each micro-batch of `batch` in `pipe`'s split, one dry run per width: equal
    micro-batches share one list."""
    # what a step saves depends on which weights train now (a layer frozen or thawed after the pipeline was
    # built): one dry run per such choice; always of a training step (train mode, dropout masks and all)
    check_batch(batch, pipe.model.vocab_size)
    plan = pipe.bucket_plan(batch)
    cache = _SIZES.setdefault(pipe, {})
    micro = None
    out = []
    for i, b in enumerate(plan.sizes):
        key = (plan.T, b), _which_train(pipe)
        if key not in cache:
            micro = micro or batch.split(list(plan.sizes))
            layers = [layer for stage in pipe.stages for layer in stage.layers]
            modes = [layer.training for layer in layers]
            try:
                for layer in layers:
                    layer.train()
                cache[key] = layer_sizes(pipe.stages, micro[i], plan.chunk_bounds, pipe.model)
            finally:
                for layer, mode in zip(layers, modes):
                    layer.train(mode)
        out.append(cache[key])
    return out
