"""Around a pipeline step: time chunks, pinned host blocks of the micro-batches, and GPU workers' streams."""
from __future__ import annotations

import torch


def chunk_bounds(T: int, chunks: int) -> list[tuple[int, int]]:
    """Where a wavefront cuts T time steps into `chunks` time chunks: [(start, end), ...], lengths within one."""
    edges = [round(k * T / chunks) for k in range(chunks + 1)]
    return list(zip(edges, edges[1:]))


class MicroBatches:
    """A bucket's micro-batches on the host: per tensor one block, made once per batch shape, that each
    step's batch is copied into, and its (t, b) views per time chunk, cut once. Equal micro-batches: an
    (m, T, b) block, micro-batch i being columns i*b .. (i+1)*b - 1 of the batch. Unequal ones (`sizes`):
    one buffer holding each micro-batch's (T, b_i) columns as a contiguous block, one after the other, so
    that every micro-batch's views are contiguous as the equal split's are.

        sizes (1, 3, 2, 2) of a (T, 8) batch:   buffer [ (T, 1) | (T, 3) | (T, 2) | (T, 2) ]

    A block a GPU reads (the first stage's token ids, the last stage's targets) is page-locked: a copy
    from there does not block the worker, so it can queue work ahead of the GPU; from pageable memory
    every copy would wait for the GPU.

    On the hot path of every step: `load(batch)` on the caller's thread (no torch call), then, at its
    first read, the worker that reads a tensor (stage 0's the inputs, the last stage's the targets)
    copies it into its block: one copy (one per micro-batch when unequal), no new tensor. The last
    stage's worker does it while the first stage computes, off the step's critical path. Every torch call
    lets go of Python's interpreter lock, and with two workers computing, a call the other is waiting to
    run after costs the pair several microseconds (five slices per action made near-empty 1F1B 18 us per
    action slower; cutting a step's 32 views afresh each step cost its first action 50 us). Reusing the
    blocks is safe because a pipeline runs one step at a time and every graph that reads a view ends with
    its step (a stage's reset drops a failed step's before the next copy).
    """

    def __init__(self, T: int, B: int, m: int, chunk_bounds, pin_inputs: bool, pin_targets: bool, sizes=None):
        self._shape, self._m, self._sizes = (T, B), m, sizes
        self._pin = {"inputs": pin_inputs, "targets": pin_targets}
        self.chunk_bounds = chunk_bounds
        self._blocks: dict[str, tuple] = {}     # "inputs" / "targets" -> (block, [chunk][mb] (t, b) views)
        self._batch, self._fresh = None, {}

    def load(self, batch) -> "MicroBatches":
        """This step's batch (the caller has checked its shape): each tensor is copied at its first read."""
        self._batch, self._fresh = batch, {}
        return self

    def inputs(self, mb: int, chunk: int = 0) -> torch.Tensor:
        views = self._fresh.get("inputs")
        return (views if views is not None else self._copy("inputs"))[chunk][mb]

    def targets(self, mb: int, chunk: int = 0) -> torch.Tensor:
        views = self._fresh.get("targets")
        return (views if views is not None else self._copy("targets"))[chunk][mb]

    def _copy(self, name: str) -> list:
        """Copy the step's `name` into its block (made at the first step, or when the dtype changes); its views."""
        x = getattr(self._batch, name)
        block, views = self._blocks.get(name, (None, None))
        if block is None or block[0].dtype != x.dtype:
            block, views = self._blocks[name] = self._make(x.dtype, self._pin[name])
        (T, B), m = self._shape, self._m
        if self._sizes is None:
            block[0].copy_(x.reshape(T, m, B // m).transpose(0, 1))          # (m, T, b) from the (T, B) batch
        else:
            lo = 0
            for part, b in zip(block, self._sizes):          # (T, b) of the buffer, from columns lo .. lo+b-1
                part.copy_(x[:, lo:lo + b])
                lo += b
        self._fresh[name] = views
        return views

    def _make(self, dtype, pin: bool) -> tuple[list, list]:
        """([the (m, T, b) block] or the (T, b_i) blocks of one buffer, [chunk][mb] (t, b) views of them)."""
        (T, B), m, sizes = self._shape, self._m, self._sizes
        lengths = [hi - lo for lo, hi in self.chunk_bounds]
        if sizes is None:
            block = torch.empty((m, T, B // m), dtype=dtype, pin_memory=pin)
            chunks = [block] if len(lengths) == 1 else block.split(lengths, dim=1)     # (m, t, b) each
            return [block], [c.unbind(0) for c in chunks]
        flat, parts, lo = torch.empty(T * B, dtype=dtype, pin_memory=pin), [], 0
        for b in sizes:
            parts.append(flat[T * lo:T * (lo + b)].view(T, b))
            lo += b
        return parts, [list(c) for c in zip(*(part.split(lengths) for part in parts))]


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


class HostCopies:
    """How one device's worker moves tensors in a step when every stage lives in the host's memory
    (virtual devices): nothing to copy and nothing to wait for, so each call gives back what it got.
    DeviceCopies does the same with GPUs; the worker's loop calls these and never asks which it has."""

    def loader(self, read):
        """`read(mb, chunk)` (a slice of the batch on the host) made to give it where this device computes."""
        return read

    def send(self, tensor: torch.Tensor, dst: int):
        """(tensor as the receiver will read it, an event it must wait for or None)."""
        return tensor, None

    def receive(self, moved: torch.Tensor, ready) -> torch.Tensor:
        return moved

    def finish(self) -> None:
        """The step's work on this device has run (a GPU's queued kernels too)."""


class DeviceCopies(HostCopies):
    """Copies with GPUs in the placement: a send to a stage on another device copies without blocking and
    records an event on the stream that runs the copy; the receiver's stream waits for that event (or,
    on the host, the thread does)."""

    def __init__(self, here: torch.device, homes: list[torch.device]):
        self.here, self.homes = here, homes

    def loader(self, read):
        here = self.here
        return lambda mb, chunk: read(mb, chunk).to(here, non_blocking=True)

    def send(self, tensor, dst: int):
        home = self.homes[dst]
        if home == self.here:         # two stages sharing the host's memory: nothing to move
            return tensor, None
        moved = tensor.detach().to(home, non_blocking=True)
        ready = None
        if moved.is_cuda or tensor.is_cuda:
            # the copy is queued on the source GPU's current stream (this worker's), or on the target
            # GPU's when the source is the host; mark its end there
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device if tensor.is_cuda else moved.device))
        return moved, ready

    def receive(self, moved, ready):
        if ready is not None and moved.is_cuda:      # this device's stream waits for the copy
            stream = torch.cuda.current_stream()
            stream.wait_event(ready)
            moved.record_stream(stream)
        elif ready is not None:                      # GPU -> host: the thread itself must wait for it
            ready.synchronize()
        return moved

    def finish(self):
        if self.here.type == "cuda":
            torch.cuda.current_stream().synchronize()


def copies_for(here: torch.device, homes: list[torch.device]) -> HostCopies:
    """The copies one device's worker makes in a step, given where each stage lives."""
    if here.type == "cpu" and all(home.type == "cpu" for home in homes):
        return HostCopies()
    return DeviceCopies(here, homes)


def wait_for_workers(callers: dict, workers) -> None:
    """After a step: the caller's next work on each GPU (clip, optimizer step, zero_grad) waits for the
    workers' streams. Each worker also waits for its stream before it reports, so this costs nothing;
    after a failure this wait alone orders them. Off a GPU there is nothing to order."""
    for worker in workers:
        if worker.stream is not None:
            callers[worker.device.name].wait_stream(worker.stream)


def settle(devices) -> None:
    """Let the calling thread's work on each GPU finish (the layers' copies to it, the LSTM's weight
    flattening): the workers' streams do not wait for this thread's, and will read those weights."""
    for device in devices:
        if device.is_cuda:
            torch.cuda.current_stream(device.torch_device).synchronize()
