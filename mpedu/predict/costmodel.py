"""A small, stated cost model of the language model's layers on a GPU: what `profile` would measure there.

Why a model at all: on a CPU core every layer is bound by arithmetic, so the layer
with the most multiply-adds (the decoder of a 10,000-word vocabulary) is the
slowest. A GPU does arithmetic about 100x faster, but it cannot hurry an LSTM's
time steps: step t needs step t-1's hidden state, so a layer runs T small steps one
after the other, and each step pays a fixed cost (launching its kernels) whatever
its size. The decoder is one large product over all steps at once. So on a GPU
an LSTM layer, though lighter in weights, can take longer than the decoder: the
opposite of a CPU, and the reason MXNet's how-to calls its LSTM layers heavy.

Assumptions (all in `GPUSpec`, change them to model another GPU):
- a large matrix product runs at `flops` (achieved, not peak; 2 FLOP per multiply-add);
- element-wise work (softmax, gathers) streams its bytes at `memory_Bps`;
- every kernel costs at least `launch_s`; an unrolled LSTM time step launches
  `kernels_per_step` kernels forward (a product for the hidden state, then
  element-wise gates and cell update), twice as many backward;
- nothing overlaps inside a layer, and a layer's bytes (weights, activations)
  are the same as on the CPU: they come from a profile on any device.
Defaults describe a GPU of the how-to's time (about 5 TFLOP/s fp32, 300 GB/s,
8 us per kernel) running MXNet's unrolled LSTM. A fused LSTM kernel (cuDNN) or a
newer GPU lowers launch_s and raises flops: rerun with its numbers, or better,
`profile(model, batch, "cuda:0")` where a GPU is present.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .profiling import Costs

FLOAT_BYTES = 4


@dataclass(frozen=True)
class GPUSpec:
    """The few numbers the cost model needs (see the module's assumptions)."""

    flops: float = 5e12             # FLOP/s achieved on large fp32 products
    memory_Bps: float = 300e9       # bytes/s achieved by element-wise kernels
    launch_s: float = 8e-6          # fixed cost of one kernel
    kernels_per_step: int = 6       # kernels of one unrolled LSTM time step, forward
    name: str = "GPU cost model"

    def __post_init__(self):
        for field in ("flops", "memory_Bps", "launch_s", "kernels_per_step"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPUSpec.{field}={getattr(self, field)!r} must be > 0")


def _product(spec: GPUSpec, flop: float) -> float:
    """One matrix-product kernel: arithmetic time, never less than a launch."""
    return max(spec.launch_s, flop / spec.flops)


def _stream(spec: GPUSpec, nbytes: float, kernels: int = 1) -> float:
    """`kernels` element-wise kernels that together move `nbytes`."""
    return kernels * spec.launch_s + nbytes / spec.memory_Bps


def layer_times(kind: str, T: int, b: int, n_in: int, n_out: int, spec: GPUSpec) -> tuple[float, float, float]:
    """(forward, input-gradient B, weight-gradient W) seconds of one layer on one micro-batch (T, b).

    kind "embed": n_in = vocabulary, n_out = embedding size; "lstm": n_in = input
    size, n_out = hidden size; "decode": n_in = hidden size, n_out = vocabulary.
    """
    rows = T * b                                           # positions in the micro-batch
    if kind == "embed":
        forward = _stream(spec, 2 * rows * n_out * FLOAT_BYTES)                       # gather rows
        weight = _stream(spec, (n_in * n_out + 2 * rows * n_out) * FLOAT_BYTES, 2)   # zero, scatter-add
        return forward, 0.0, weight
    if kind == "lstm":
        gates = 4 * n_out
        # The input part of all T steps is one product; the hidden part is T dependent steps.
        step = max(spec.kernels_per_step * spec.launch_s, 2 * b * n_out * gates / spec.flops)
        forward = _product(spec, 2 * rows * n_in * gates) + T * step
        back_step = max(2 * spec.kernels_per_step * spec.launch_s, 2 * b * gates * n_out / spec.flops)
        b_input = T * back_step + _product(spec, 2 * rows * gates * n_in)            # back through time, then dX
        b_weight = _product(spec, 2 * rows * gates * n_in) + _product(spec, 2 * rows * gates * n_out)  # dW_ih, dW_hh
        return forward, b_input, b_weight
    if kind == "decode":
        logits = rows * n_out * FLOAT_BYTES
        forward = _product(spec, 2 * rows * n_in * n_out) + _stream(spec, 3 * logits, 3)   # product, log-softmax, loss
        b_input = _stream(spec, 3 * logits, 2) + _product(spec, 2 * rows * n_out * n_in)   # softmax grad, dX
        b_weight = _product(spec, 2 * rows * n_out * n_in)                                 # dW
        return forward, b_input, b_weight
    raise ValueError(f"unknown layer kind {kind!r}: expected 'embed', 'lstm' or 'decode'")


def gpu_costs(costs: Costs, model, spec: GPUSpec | None = None) -> Costs:
    """`costs` (a profile on any device) with every time replaced by the GPU cost model's.

    Bytes (weights, activations, transfers) are kept: they do not depend on the device.
    The result works wherever a profile does: simulate, balance_by_time, the explorer.
    """
    spec = spec or GPUSpec()
    T, b = costs.micro_batch
    c = model.config
    sizes = {"embed": ("embed", model.vocab_size, c.embed_size), "decode": ("decode", c.hidden_size, model.vocab_size)}
    for i in range(c.num_layers):
        sizes[f"lstm{i}"] = ("lstm", c.embed_size if i == 0 else c.hidden_size, c.hidden_size)
    forward, backward, b_input, b_weight = [], [], [], []
    for name in costs.names:
        if name not in sizes:
            raise ValueError(f"the GPU cost model knows embed, lstmN and decode layers, not {name!r}")
        f, bi, bw = layer_times(*sizes[name][:1], T, b, *sizes[name][1:], spec)
        forward.append(f)
        backward.append(bi + bw)          # the fused backward does both halves once
        b_input.append(bi)
        b_weight.append(bw)
    return replace(costs, forward=forward, backward=backward, backward_input=b_input, backward_weight=b_weight,
                   device=spec.name)
