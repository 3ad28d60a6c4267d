"""Stages for torch.distributed.pipelining: consecutive layers as one module, a tensor in and a tensor out.

Two rules of PyTorch's pipelining shape this module. A stage's outputs must be tensors,
so an LSTM's (h, c) never leaves its stage (each micro-batch starts from zero state). And
gloo sends contiguous tensors only, so activations and incoming gradients are made
contiguous at the stage boundary.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed import pipelining as pp

from ..core.stage import is_recurrent
from ..lm import dropout
from ..lm.model import Decode, Embed, LSTMLayer


class ContiguousGrad(torch.autograd.Function):
    """Identity forward; in backward, a contiguous gradient (gloo refuses to send strided tensors)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class StageModule(nn.Module):
    """Consecutive layers of an LSTMLM as one pipeline stage: a tensor in, a tensor out.

    First stage: tokens (b, T) batch-first, as torch's step() splits along dim 0 ->
    (T, b) time-major inside. Others: (T, b, F). Output (T, b, F') or logits (T, b, V).
    Each layer starts from zero state and its (h, c) never leaves the stage.
    """

    def __init__(self, names: list[str], layers: list[nn.Module]):
        super().__init__()
        self.names = list(names)
        self.layers = nn.ModuleList(layers)   # the model's own modules: Parameters are shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = ContiguousGrad.apply(x)       # (T, b, F) received from the previous rank
        else:
            x = x.t()                         # (b, T) -> (T, b) token ids
        for name, layer in zip(self.names, self.layers):
            x, _ = layer(x, None)             # None: zero state, reset every micro-batch
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {name!r} returned {type(x).__name__}, but a pipeline stage may only "
                                "pass tensors between ranks; make the layer return (tensor, state)")
        return x.contiguous()                 # gloo sends contiguous tensors only


def out_width(name: str, layer: nn.Module) -> int:
    """Features of a layer's output: what the next rank's receive buffer must hold."""
    if isinstance(layer, Embed):
        return layer.embedding.embedding_dim
    if isinstance(layer, LSTMLayer):
        return layer.lstm.hidden_size
    if isinstance(layer, Decode):
        return layer.linear.out_features
    raise TypeError(f"layer {name!r} is a {type(layer).__name__}; mpedu.distributed knows the output width of "
                    "Embed, LSTMLayer and Decode only, and needs it to build static receive buffers")


def whole_backward_in_b(stage_index: int, module: nn.Module) -> bool:
    """Whether a zero-bubble stage runs its whole backward in B, leaving W nothing: a stage after the first
    that holds a recurrent layer. PyTorch's split reaches the weights in W by running the graph's nodes again
    from the gradients B captured, and an LSTM is one node whose kernel computes input and weight gradients
    together: split, it would run twice (zb1 measured 1.19x 1F1B's step, bench/vs_torch_pipelining.py).
    The first stage needs no split: it sends no gradient, so PyTorch leaves its B empty and runs it all in W."""
    return stage_index > 0 and is_recurrent(module)


def _nothing_left():
    """The W runner of a stage whose B ran the whole backward."""
    return lambda: None


class TimedStage(pp.PipelineStage):
    """A PipelineStage that records each F, B and W it runs, and each send it posts, in a Recorder.

    `position(mb)` gives the micro-batch's dropout Position (None: evaluation, no dropout), so
    the masks are the slice of the one-process masks that these columns would draw. A later stage
    with an LSTM runs its whole backward in B (whole_backward_in_b).
    """

    def __init__(self, submodule, stage_index, *args, recorder, position=lambda mb: None, **kwargs):
        if whole_backward_in_b(stage_index, submodule):
            kwargs.setdefault("dw_builder", _nothing_left)     # PyTorch: B runs the full backward, W the runner
        super().__init__(submodule, stage_index, *args, **kwargs)
        self.recorder = recorder
        self.position = position

    def _timed(self, kind, mb, run):
        start = self.recorder.now()
        result = run()
        self.recorder.add(kind, self.stage_index, mb, start, self.recorder.now())
        return result

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with dropout.at(self.position(fwd_chunk_id)):
            return self._timed("F", fwd_chunk_id, lambda: super(TimedStage, self).forward_one_chunk(
                fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", bwd_chunk_id, lambda: super(TimedStage, self).backward_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("W", bwd_chunk_id, lambda: super(TimedStage, self).backward_weight_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def _sent(self, ops, mb):
        # gloo and NCCL sends are asynchronous: the box marks when the send was posted.
        for op in ops:
            t = self.recorder.now()
            self.recorder.add("send", self.stage_index, mb, t, t, op.tensor.numel() * op.tensor.element_size(),
                              f"rank:{op.peer}")
        return ops

    # The V's two stages on one rank hand their tensors over in memory (torch's "V-schedule special case"); in
    # eval() torch's runtime still plays the backwards, which skip themselves, but their hand-over raises
    # ("can't steal_bwd_input"): with no backward there is nothing to hand over.
    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._sent(super().get_fwd_send_ops(fwd_chunk_id), fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._sent(super().get_bwd_send_ops(bwd_chunk_id), bwd_chunk_id)
