"""Clock: one device's timestamps during a step, the same for the thread engine and the torchrun engine."""
from __future__ import annotations

import time

import torch


class Clock:
    """Timestamps for one device during one step: perf_counter on CPU, CUDA events on a GPU
    (read after the step, so timing never blocks the stream).

    A GPU event's time is relative to a reference event on the same stream; the reference is
    tied to the CPU's clock by waiting until the GPU reaches it. Taking the CPU time when the
    reference is merely queued would shift every GPU time by the work queued before it (the
    previous optimizer step, which this device's stream now waits for).
    """

    def __init__(self, device, t0: float):
        # device: an mpedu Device (the thread engine) or a torch.device (a torchrun rank)
        self.cuda = device.is_cuda if hasattr(device, "is_cuda") else torch.device(device).type == "cuda"
        self.t0 = t0
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.ref.synchronize()
            self.ref_cpu = time.perf_counter()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark) -> float:
        if self.cuda:
            return self.ref_cpu - self.t0 + self.ref.elapsed_time(mark) / 1e3
        return mark - self.t0
