"""The machine's free cores: how many virtual devices' worth of work it does at once, measured now."""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .devices import Worker, get_device, own_cores
from .model import nll_sum


def measure_cores(n: int = 2, repeats: int = 5, model=None, batch=None, steps: int = 4) -> float:
    """How many virtual devices' worth of work this machine does at once, now.

    Times some work on one worker alone, then the same work on n workers together:
    n x alone / together. About n on an idle machine with n cores (less when the
    cores fight over memory bandwidth), nearer 1 when other work takes the cores.
    The work is a copy of `model`'s forward and backward on `batch` (one
    micro-batch: the pipeline's own work) or, without them, a 256-wide LSTM layer.
    Each measurement runs `steps` forward-and-backward steps (long enough that timer
    and thread start-up noise do not count); the result is the median of `repeats`.
    Pass the result as simulate(..., cores=...).
    """
    if n < 2:
        raise ValueError(f"measure_cores needs n >= 2 workers to compare with one, got {n}")
    if model is not None:
        copies = [copy.deepcopy(model).train() for _ in range(n)]     # backward writes each copy's .grad
        step = lambda m: nll_sum(m(batch.inputs)[0], batch.targets).backward()    # noqa: E731
    else:
        copies = [torch.nn.LSTM(256, 256) for _ in range(n)]
        x = torch.randn(35, 8, 256)                                   # (T, b, H), like a micro-batch
        step = lambda m: m(x)[0].sum().backward()                     # noqa: E731
    devices = [get_device(f"vgpu:{k}") for k in range(n)]
    cores = own_cores(devices)                  # pinned as a pipeline pins them
    workers = [Worker(d, core=cores and cores[k]) for k, d in enumerate(devices)]

    def job(m):
        def run():
            start = time.perf_counter()
            for _ in range(steps):
                step(m)
            return time.perf_counter() - start
        return run

    ratios = []
    try:
        # Warm every worker up, together: a worker's first steps fault in its own allocator arena,
        # which would count as "the cores are busy" in the first measurement.
        for f in [w.submit(job(m)) for w, m in zip(workers, copies)]:
            f.result()
        for _ in range(repeats):
            alone = workers[0].submit(job(copies[0])).result()
            together = max(f.result() for f in [w.submit(job(m)) for w, m in zip(workers, copies)])
            ratios.append(min(n * alone / together, float(n)))
    finally:
        for w in workers:
            w.stop()
    return statistics.median(ratios)
