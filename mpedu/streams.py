"""Around a pipeline step: pinned host blocks of the micro-batches, and GPU workers' streams after the caller's."""
from __future__ import annotations

import torch


def host_micro_batches(batch, m: int, chunk_bounds, pin_inputs: bool, pin_targets: bool):
    """[micro-batch][chunk] -> (inputs, targets), each (t, b), views of the micro-batch's block.

    A block a GPU reads (the first stage's token ids, the last stage's targets) is copied once
    into page-locked memory: a copy from there does not block the worker, so it can queue
    work ahead of the GPU; from pageable memory every copy would wait for the GPU.
    On the hot path of every step: one copy per tensor (T, B) -> (m, T, b), then one unbind per
    time chunk (not m x chunks slices), and the padding mask is not cut (the loss skips id 0).
    The caller has checked that m divides B.
    """
    T, B = batch.inputs.shape

    def cut(x, pin):
        blocks = x.reshape(T, m, B // m).transpose(0, 1).contiguous()        # (m, T, b)
        if pin:
            blocks = blocks.pin_memory()
        return [blocks[:, lo:hi].unbind(0) for lo, hi in chunk_bounds]       # [chunk][micro-batch]

    inputs, targets = cut(batch.inputs, pin_inputs), cut(batch.targets, pin_targets)
    return [[(inputs[c][i], targets[c][i]) for c in range(len(chunk_bounds))] for i in range(m)]


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
