"""Numeric faults: find where a NaN or inf in a training step came from (layer, stage, device)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lm.model import LSTMLM, nll_sum


class NumericFault(FloatingPointError):
    """A NaN or inf in a step: the loss, a gradient or a weight. Names the step, the layer and,
    in a pipeline, its stage and device (attributes `step`, `layer`, `stage`, `device`)."""

    def __init__(self, message: str, *, step: int | None = None, layer: str | None = None, stage: int | None = None,
                 device: str | None = None):
        super().__init__(message)
        self.step, self.layer, self.stage, self.device = step, layer, stage, device


@dataclass
class Fault:
    """Where a non-finite number first shows: `layer`, and what is wrong there."""

    layer: str | None
    what: str
    stage: int | None = None
    device: str | None = None
    in_weights: bool = False      # the weights themselves are non-finite: no later batch can be good

    def __str__(self) -> str:
        if self.layer is None:
            return self.what
        where = f"stage {self.stage} on {self.device}" if self.stage is not None else f"on {self.device}"
        return f"layer {self.layer} ({where}): {self.what}"


def all_finite(tensors) -> bool:
    """True when no tensor holds a NaN or inf. One reduction per tensor, one sync per device."""
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


def _describe_bad(t: torch.Tensor) -> str:
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    parts = [f"{nan:,} nan" if nan else "", f"{inf:,} inf" if inf else ""]
    return " and ".join(p for p in parts if p) + f" of {t.numel():,} values"


def find_fault(model: LSTMLM, runner=None, batch=None) -> Fault:
    """Which layer a non-finite loss or gradient comes from, looked for in the order it spreads:

    1. a weight that is already NaN/inf (every later step fails too);
    2. the first layer whose output is not finite, running `batch` forward again layer by layer
       (from a fresh recurrent state, with the generators put back afterwards);
    3. the gradients: backward runs from the last layer to the first, so the last layer in
       model order whose weight gradient is not finite is where it started.
    Only called after a bad step, so a healthy step pays nothing for it. On one rank of a torchrun
    pipeline (a runner with `owned` layers and `agree_on_fault`), the rank looks at its own layers
    only (its copies of the others are stale) and every rank then names the same fault.
    """
    if runner.owned is not None:          # one torchrun rank: its own layers, then what every rank agrees on
        return runner.agree_on_fault(_search(model, runner, None, list(runner.owned), runner.bad_before_clip))
    return _search(model, runner, batch, model.layer_names)


def _search(model: LSTMLM, runner, batch, layers: list[str], bad_gradients=None) -> Fault:
    """find_fault over `layers`; `bad_gradients`: the layers whose gradients were non-finite before something
    (a clip over several ranks) spread the NaN to all of them."""
    def fault(layer, what, **kw):
        stage, device = _locate(runner, model, layer)
        return Fault(layer, what, stage, device, **kw)

    for name in layers:
        for pname, p in model.layers[name].named_parameters():
            if not all_finite([p.detach()]):
                return fault(name, f"its weight {pname} holds {_describe_bad(p.detach())}", in_weights=True)
    if batch is not None:
        found = _first_bad_output(model, batch)
        if found is not None:
            return fault(*found)
    for name in reversed(layers if bad_gradients is None else [n for n in layers if n in bad_gradients]):
        for pname, p in model.layers[name].named_parameters():
            if p.grad is not None and not all_finite([p.grad]):
                return fault(name, f"the gradient of {pname} holds {_describe_bad(p.grad)} (its forward output "
                                   "was finite: the backward overflowed)")
    return Fault(None, "every weight, output and gradient was finite when checked again (from a fresh "
                       "recurrent state); the step's result was not")


def first_of(faults: list[Fault], layer_names: list[str]) -> Fault:
    """Of the faults several ranks found in their own layers, where it started: a broken weight first (the
    earliest), else a gradient (the latest layer: backward runs from the last to the first), else none."""
    found = [f for f in faults if f.layer is not None]
    weights = [f for f in found if f.in_weights]
    if weights:
        return min(weights, key=lambda f: layer_names.index(f.layer))
    if found:
        return max(found, key=lambda f: layer_names.index(f.layer))
    return faults[0]


def _first_bad_output(model: LSTMLM, batch):
    rng_devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=rng_devices):
        x = batch.inputs
        for name in model.layer_names:
            layer = model.layers[name]
            x, _ = layer(x.to(next(layer.parameters()).device))
            if x.is_floating_point() and not all_finite([x]):
                return name, f"its output holds {_describe_bad(x)} though its input and weights are finite"
        loss = nll_sum(x, batch.targets.to(x.device))
        if not all_finite([loss]):
            return model.layer_names[-1], f"the loss is {loss.item()} though the logits are finite"
    return None


def _locate(runner, model, layer: str) -> tuple[int | None, str]:
    """(stage index, device name) of a layer: from the pipeline's placement, else the runner's device."""
    placement = runner.placement
    if placement is not None:
        for s, (dev, names) in enumerate(placement.stages):
            if layer in names:
                return s, str(dev)
    device = runner.device or next(model.layers[layer].parameters()).device
    return None, str(device)
