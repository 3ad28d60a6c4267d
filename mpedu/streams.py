"""Around a pipeline step: pinned host blocks of the micro-batches, and GPU workers' streams after the caller's."""
from __future__ import annotations

import torch


class MicroBatches:
    """A step's micro-batches on the host: one (m, T, b) block per tensor, micro-batch i being columns
    i*b .. (i+1)*b - 1 of the batch, and a (t, b) view of it cut only when an action asks for it.

    A block a GPU reads (the first stage's token ids, the last stage's targets) is copied once
    into page-locked memory: a copy from there does not block the worker, so it can queue
    work ahead of the GPU; from pageable memory every copy would wait for the GPU.
    On the hot path of every step: one copy per tensor, no mask (the loss skips id 0), and no view
    made (or freed) by the caller's thread: each worker cuts the few it reads.
    """

    def __init__(self, batch, m: int, chunk_bounds, pin_inputs: bool, pin_targets: bool):
        T, B = batch.inputs.shape        # the caller has checked that m divides B

        def block(x, pin):
            x = x.reshape(T, m, B // m).transpose(0, 1)                      # (m, T, b), a view
            return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x) if pin else x.contiguous()

        self._inputs, self._targets = block(batch.inputs, pin_inputs), block(batch.targets, pin_targets)
        self.chunk_bounds = chunk_bounds

    def inputs(self, mb: int, chunk: int = 0) -> torch.Tensor:
        lo, hi = self.chunk_bounds[chunk]
        return self._inputs[mb, lo:hi]

    def targets(self, mb: int, chunk: int = 0) -> torch.Tensor:
        lo, hi = self.chunk_bounds[chunk]
        return self._targets[mb, lo:hi]


def caller_streams(devices) -> dict:
    """{GPU name: the calling thread's stream on it}: where the caller's optimizer step, gradient
    clipping and zero_grad run (the default stream, unless the caller chose another)."""
    return {d.name: torch.cuda.current_stream(d.torch_device) for d in devices if d.is_cuda}


def after(caller_stream, job):
    """`job`, made to start on its GPU worker's stream only after the work already queued on the
    caller's stream. PyTorch's pool streams do not wait for the default stream, so without this
    the step's forward could read weights the previous optimizer step has not yet written, and
    reuse gradient memory that step still reads. Off a GPU (no stream) the job runs as it is."""
    if caller_stream is None:
        return job

    def ordered():
        torch.cuda.current_stream().wait_stream(caller_stream)
        return job()
    return ordered
