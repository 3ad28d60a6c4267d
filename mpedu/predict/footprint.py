"""One model of a device's memory: weights, gradients, optimizer state, the activations a schedule holds at its peak."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from ..core.recompute import recompute_modes, recomputes
from ..runtime.values import format_size


@dataclass
class Footprint:
    """Bytes one device holds for a training step. Activations change during the step; this is their peak."""

    device: str
    weights: int
    gradients: int
    optimizer_state: int
    activations: int        # the most activation bytes held at once (with the recomputation's own peak)
    in_flight: int          # the most (micro-batch, chunk) units held at once
    cap: int | None = None

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activations

    @property
    def fits(self) -> bool:
        return self.cap is None or self.total <= self.cap

    def parts(self) -> str:
        held = f"{self.in_flight} micro-batch{'es' if self.in_flight != 1 else ''}"
        optimizer = f" + optimizer state {format_size(self.optimizer_state)}" if self.optimizer_state else ""
        return (f"parameters {format_size(self.weights)} + gradients {format_size(self.gradients)}{optimizer} + "
                f"activations {format_size(self.activations)} ({held} held at once)")

    def __str__(self) -> str:
        cap = f", cap {format_size(self.cap)}" if self.cap is not None else ""
        return f"{self.device}: {format_size(self.total)} = {self.parts()}{cap}"


def peak_held(row, unit_bytes: Callable[[int, int, int], tuple[float, float]], split=(),
              grad_bytes: Callable[[int, int], float] = lambda stage, mb: 0.0) -> tuple[float, int]:
    """The one loop that counts what a schedule holds: walk one device's actions in the order it runs
    them and return (most bytes held at once, most units held at once).

    unit_bytes(stage, mb, chunk) -> (kept, full): what a (micro-batch, chunk) unit holds from its F to its
    backward, and while its backward runs. kept == full without recomputation; with it, kept is the
    stage's input and the backward first rebuilds `full`. A unit is freed by its B, or by its W on a
    stage in `split` (zero-bubble: B keeps the graph for W, and grad_bytes(stage, mb), the gradient of the
    stage's output for micro-batch mb, which W starts from again).
    """
    held = peak = 0.0
    units = peak_units = 0
    holding: dict = {}
    for a in row:
        key = (a.stage, a.mb, a.chunk)
        if a.kind == "F":
            kept, _ = unit_bytes(a.stage, a.mb, a.chunk)
            holding[key] = kept
            held += kept
            units += 1
            peak_units = max(peak_units, units)
        elif a.kind == "B":
            kept, full = unit_bytes(a.stage, a.mb, a.chunk)
            if full != kept and key in holding:          # the re-run forward rebuilds the saved tensors
                held += full - holding[key]
                holding[key] = full
            peak = max(peak, held)
            if a.stage not in split and key in holding:
                held -= holding.pop(key)
                units -= 1
            elif key in holding:
                extra = grad_bytes(a.stage, a.mb)
                holding[key] += extra
                held += extra
        elif a.kind == "W" and key in holding:
            held -= holding.pop(key)
            units -= 1
        peak = max(peak, held)
    return peak, peak_units


def output_grad_bytes(c) -> float:
    """What a split (zero-bubble) stage keeps from its B to its W besides its activations: the gradient of
    its output; 0 on a stage where nothing wants a gradient (a frozen first stage on token ids)."""
    return c.output_bytes if c.activation_bytes or c.trainable_bytes else 0


def unit_bytes(stage_costs, modes, micro_batches: int, chunks: int = 1, per_chunk=None, per_micro_batch=None):
    """unit_bytes(stage, mb, chunk=0) -> (kept, full) for peak_held, from StageCosts of one full-sequence
    micro-batch (a unit holds 1/chunks of it), or `per_chunk`: for each time chunk, the StageCosts of that
    chunk alone (chunks of unequal lengths hold unequal bytes). `per_micro_batch`: micro-batches of unequal
    widths hold unequal bytes; for each micro-batch its own pair (stage_costs, per_chunk), read as those two
    arguments are (per_chunk None: a unit holds 1/chunks of the stage costs)."""
    def sizes(s: int, mb: int, chunk: int = 0) -> tuple[float, float]:
        own, chunked = (stage_costs, per_chunk) if per_micro_batch is None else per_micro_batch[mb]
        if chunked is not None:
            c, share = chunked[chunk][s], 1
        else:
            c, share = own[s], chunks
        full = c.activation_bytes / share
        if not recomputes(modes[s], mb, micro_batches):
            return full, full
        # held between F and B: the input only; while the backward runs, the rebuilt activations
        # and the input (counted once where the first layer saves the input itself)
        kept = c.input_bytes / share
        return kept, full + kept - min(c.input_saved_bytes / share, kept)
    return sizes


def device_footprints(costs, placement, schedule, recompute=None, optimizer_bytes_per_param: float = 0.0,
                      optimizer_state: Mapping[str, int] | None = None,
                      caps: Mapping[str, int] | None = None, chunk_costs=None,
                      micro_batch_costs=None) -> list[Footprint]:
    """Footprint per device (in placement.devices order) of a training step that runs `schedule`
    over `placement`, from per-layer `costs` (mpedu.predict.profiling.Costs of one full-sequence micro-batch).

    weights: the stage's parameters (a tied weight once: see param_sizes); gradients: one tensor per
    trainable weight; optimizer state: `optimizer_bytes_per_param` bytes per byte of trainable
    weights (SGD 0, momentum 1, Adam 2), or the bytes `optimizer_state` gives per device;
    activations: the peak of peak_held over the device's actions, a unit (micro-batch, time chunk)
    holding 1/chunks of a micro-batch's. `recompute` as for Pipeline (see recompute_modes).

    With time chunks (wavefront) a chunk saves more than 1/chunks of the whole sequence (each
    chunk's recurrent state comes in and is saved again): `chunk_costs`, profiled on one chunk's
    length (the batch cut to its first T/c steps), gives a unit's bytes as measured; a list of
    them, one per time chunk, gives each chunk its own (T not a multiple of the chunk count).

    Micro-batches of unequal widths (Pipeline(..., micro_batches=[8, 16, 24, 16])) hold unequal bytes:
    `micro_batch_costs`, one entry per micro-batch, each what `costs` (a Costs of that width) or
    `chunk_costs` (a list per time chunk) would be for all, gives each micro-batch its own; `costs` then
    gives only the weights.
    """
    stage_costs = costs.stages(placement)
    stages = placement.stages
    if len(stage_costs) != schedule.num_stages:
        raise ValueError(f"the placement has {len(stage_costs)} stages but schedule {schedule.name!r} has "
                         f"{schedule.num_stages}; build the schedule from placement.stage_devices")
    modes = recompute_modes(recompute, len(stages))
    m, chunks = schedule.micro_batches, schedule.chunks
    if micro_batch_costs is None:
        pairs = [(stage_costs, _per_chunk(chunk_costs, placement, chunks))] * m
    else:
        if chunk_costs is not None:
            raise ValueError("give chunk_costs or micro_batch_costs, not both: micro_batch_costs may hold a list "
                             "per time chunk for each micro-batch")
        if len(micro_batch_costs) != m:
            raise ValueError(f"micro_batch_costs gives {len(micro_batch_costs)} micro-batches, the schedule runs {m}")
        pairs = [(c.stages(placement), None) if not isinstance(c, (list, tuple)) else
                 (c[0].stages(placement), _per_chunk(c, placement, chunks)) for c in micro_batch_costs]
    sizes = unit_bytes(stage_costs, modes, m, chunks, per_micro_batch=pairs)
    names = [d.name for d in placement.devices]
    fixed = {name: [0, 0] for name in names}
    for (device, _), c in zip(stages, stage_costs):
        fixed[device.name][0] += c.param_bytes
        fixed[device.name][1] += c.trainable_bytes
    out = []
    for name, row in zip(names, schedule.actions):
        peak, units = peak_held(row, sizes, schedule.split_backward,
                                lambda s, mb: output_grad_bytes(pairs[mb][0][s]))
        weights, grads = fixed[name]
        opt = (optimizer_state[name] if optimizer_state is not None and name in optimizer_state
               else int(round(optimizer_bytes_per_param * grads)))
        out.append(Footprint(name, weights, grads, opt, int(round(peak)), units,
                             caps.get(name) if caps else None))
    return out


def _per_chunk(chunk_costs, placement, chunks: int):
    """device_footprints' chunk_costs as unit_bytes' per_chunk: per time chunk, that chunk's StageCosts (None: none)."""
    if chunk_costs is None:
        return None
    each = list(chunk_costs) if isinstance(chunk_costs, (list, tuple)) else [chunk_costs] * chunks
    if len(each) != chunks:
        raise ValueError(f"chunk_costs gives {len(each)} time chunks, the schedule runs {chunks}")
    return [c.stages(placement) for c in each]


def stage_footprint(stage_cost, row, stage: int, mode: str | None, micro_batches: int, chunks: int = 1,
                    split=(), device: str = "", optimizer_bytes_per_param: float = 0.0,
                    per_chunk=None) -> Footprint:
    """The Footprint of one stage alone on a device that runs `row` (its actions, as stage `stage` of a
    schedule): for partitioners that try a stage's layers before a placement exists. per_chunk: the
    stage's StageCost on each time chunk alone (chunks of unequal lengths hold unequal bytes)."""
    modes = {stage: mode}
    each = None if per_chunk is None else [{stage: c} for c in per_chunk]
    peak, units = peak_held(row, unit_bytes({stage: stage_cost}, modes, micro_batches, chunks, each), split,
                            lambda s, mb: output_grad_bytes(stage_cost))
    return Footprint(device, stage_cost.param_bytes, stage_cost.trainable_bytes,
                     int(round(optimizer_bytes_per_param * stage_cost.trainable_bytes)), int(round(peak)), units)


def unique_params(model, names=None):
    """(layer name, parameter) for each distinct weight of `model`'s layers `names`, in layer order. A
    weight shared by several layers (tied embedding and decoder) comes once, with the first layer
    holding it: the one place ties are de-duplicated, by storage (two Parameter objects viewing one
    storage are one tensor in memory)."""
    seen: set[tuple[str, int]] = set()
    for name in (list(names) if names is not None else model.layer_names):
        for p in model.layers[name].parameters():
            key = (str(p.device), p.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                yield name, p


def param_sizes(model, names=None) -> tuple[list[int], list[int]]:
    """(parameter bytes, trainable bytes) per layer of `model`, a tied weight once (see unique_params)."""
    names = list(names) if names is not None else model.layer_names
    params, trainable = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for name, p in unique_params(model, names):
        nbytes = p.numel() * p.element_size()
        params[name] += nbytes
        trainable[name] += nbytes if p.requires_grad else 0
    return list(params.values()), list(trainable.values())
