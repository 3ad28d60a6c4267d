"""Stream mode's carried state: each micro-batch's LSTM (h, c) kept from one batch to the next.

In stream mode (--bptt) a batch continues the sequences of the one before it, so each LSTM starts
where it stopped. Micro-batch i is the same columns of every batch (i*B/m .. (i+1)*B/m - 1, or, with
unequal sizes, sum(sizes[:i]) .. sum(sizes[:i+1]) - 1): its state belongs to the same sequences
whatever T is, and each stage keeps the state of its own layers, per micro-batch. A batch of
another width B starts from zeros again, as SingleDevice does.
"""
from __future__ import annotations

import itertools

import torch

from .runner import check_carried


class CarriedState:
    """What a Pipeline's stages carry between stream-mode batches, in and out of the runner-neutral
    form {layer: (h, c)} with each (1, B, H) for the whole batch width, on the host."""

    def __init__(self, stages, micro_batches: int, sizes: tuple[int, ...] | None = None):
        self.stages, self.micro_batches, self.sizes = stages, micro_batches, sizes
        self.shape = None        # the (T, B) of the batch whose state the stages hold, or None

    def begin(self, batch, chunks: int) -> dict:
        """Before a step: keep the state when this batch carries it on at the same width, else zeros. Returns
        Stage.reset's arguments for the step: each device's worker resets its own stages as its job starts
        (mpedu.core.device_step), the others' meanwhile, not one after the other on the step's critical path."""
        carry = bool(getattr(batch, "carry_state", False))
        keep = carry and self.shape is not None and self.shape[1] == batch.inputs.shape[1]
        self.shape = tuple(batch.inputs.shape) if carry else None
        return {"keep_state": keep, "carry": carry, "chunks": chunks}

    def forget(self) -> None:
        self.shape = None
        for stage in self.stages:
            stage.reset()

    def collect(self) -> dict | None:
        """{layer: (h, c)}, the micro-batches side by side; None when nothing is carried. B is the width
        the pipeline ran: a batch widened by empty columns (mpedu.core.runner.fitted) leaves them at the
        end; keep the first columns, the stream's (mpedu.training.loop.stream_columns)."""
        if self.shape is None:
            return None
        out = {}
        for stage in self.stages:
            for name in stage.names:
                parts = [stage.state.get(mb, {}).get(name) for mb in range(self.micro_batches)]
                if parts and all(p is not None for p in parts):
                    out[name] = tuple(torch.cat([p[i].detach().cpu() for p in parts], dim=1)
                                      for i in range(len(parts[0])))
        return out or None

    def load(self, state: dict | None, model, worker_streams: dict) -> None:
        """Carry `state` (collect's form, from any runner) into the next batch of its width, widened by
        empty columns when the micro-batches do not divide it (their state is zeros, and no loss or
        gradient depends on it). `worker_streams`: {device name: its worker's GPU stream}."""
        self.forget()
        if not state:
            return
        m, sizes = self.micro_batches, self.sizes
        width = check_carried(state, model)
        if sizes is not None and width > sum(sizes):
            raise ValueError(f"the carried state is {width} sequences wide, more than the micro-batches of sizes "
                             f"{list(sizes)} hold together ({sum(sizes)}); build the Pipeline with sizes that add "
                             f"up to {width}")
        extra = -width % m if sizes is None else sum(sizes) - width
        state = {name: tuple(torch.cat([t, t.new_zeros(t.shape[0], extra, t.shape[2])], 1) for t in ts)
                 for name, ts in state.items()}
        width += extra
        sizes = sizes or (width // m,) * m
        starts = list(itertools.accumulate(sizes, initial=0))
        for stage in self.stages:
            stream = worker_streams.get(stage.device.name)
            for name in (n for n in stage.names if n in state):
                for mb in range(m):
                    lo, hi = starts[mb], starts[mb + 1]
                    parts = tuple(t[:, lo:hi].to(stage.device.torch_device).contiguous() for t in state[name])
                    if stream is not None:
                        # the copies ran on this thread's stream; the worker frees the state once its kernels
                        # are queued, and the memory could be handed out again before they ran
                        for part in parts:
                            part.record_stream(stream)
                    stage.state.setdefault(mb, {})[name] = parts
        self.shape = (0, width)
