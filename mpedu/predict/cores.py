"""The machine's free cores: how many virtual devices' worth of work it does at once, measured now."""
from __future__ import annotations

import copy
import statistics
import threading
import time

import torch

from ..lm.model import nll_sum
from ..runtime.devices import get_device
from ..runtime.workers import Worker, own_cores, result_of


def measure_cores(n: int = 2, repeats: int = 5, model=None, batch=None, steps: int = 4) -> float:
    """How many virtual devices' worth of work this machine does at once, now.

    Times each worker's work alone, then all n workers' together: n / (the workers' mean
    slowdown together). About n on an idle machine with n cores (less when the cores fight
    over memory bandwidth), nearer 1 when other work takes the cores. With `model` and
    `batch` (one micro-batch), the work is the pipeline's own: worker k runs the forward and
    backward of the k-th of n consecutive shares of the layers, as pipeline stages would, so
    the workers stream different weights, as stages do (n copies of the whole model would
    overstate how much they slow each other: `mxnet8`, whose weights fill the shared cache,
    read 1.65 that way and 1.72-1.79 this way, on micro-batches of one sentence). Without
    them, a 256-wide LSTM layer each. Each worker's work runs `steps` forward-and-backward
    steps alone; together, every worker repeats its work until the slowest has had that long,
    so all of them overlap throughout. The result is the median of `repeats`. Pass it as
    simulate(..., cores=...).
    """
    if n < 2:
        raise ValueError(f"measure_cores needs n >= 2 workers to compare with one, got {n}")
    jobs = _model_shares(model, batch, n) if model is not None else _lstm_layers(n)
    devices = [get_device(f"vgpu:{k}") for k in range(n)]
    cores = own_cores(devices)                  # pinned as a pipeline pins them
    workers = [Worker(d, core=cores[k] if cores else None) for k, d in enumerate(devices)]

    def alone(step):
        def run():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            return (time.perf_counter() - start) / steps
        return run

    def until(step, stop):
        def run():
            start, count = time.perf_counter(), 0
            while True:
                step()
                count += 1
                if stop.is_set():
                    return (time.perf_counter() - start) / count
        return run

    def together(seconds):
        stop = threading.Event()
        futures = [w.submit(until(step, stop)) for w, step in zip(workers, jobs)]
        time.sleep(seconds)
        stop.set()
        return [result_of(f) for f in futures]

    ratios = []
    try:
        # Warm every worker up, together: a worker's first steps fault in its own allocator arena,
        # which would count as "the cores are busy" in the first measurement.
        for f in [w.submit(alone(step)) for w, step in zip(workers, jobs)]:
            result_of(f)
        for _ in range(repeats):
            solo = [result_of(w.submit(alone(step))) for w, step in zip(workers, jobs)]
            slower = [t / s for t, s in zip(together(max(solo) * steps), solo)]
            ratios.append(min(n / statistics.mean(slower), float(n)))
    finally:
        for w in workers:
            w.stop()
    return statistics.median(ratios)


def _lstm_layers(n: int):
    """n copies of one job: a 256-wide LSTM layer's forward and backward on a (35, 8) micro-batch."""
    x = torch.randn(35, 8, 256)                                       # (T, b, H), like a micro-batch
    copies = [torch.nn.LSTM(256, 256) for _ in range(n)]
    return [lambda m=m: m(x)[0].sum().backward() for m in copies]


def _model_shares(model, batch, n: int):
    """n jobs: job k runs forward and backward of the k-th of n consecutive shares of a copy of `model`'s layers
    (as a stage would: its input detached, the last share ending in the loss). More workers than layers: the
    shares repeat."""
    names = model.layer_names
    cuts = [round(k * len(names) / min(n, len(names))) for k in range(min(n, len(names)) + 1)]
    shares = [names[a:b] for a, b in zip(cuts, cuts[1:])]
    # a copy per round of shares: backward writes the copy's .grad (never the model's), one thread per copy
    twins = [copy.deepcopy(model).train() for _ in range(-(-n // len(shares)))]
    inputs, x = [], batch.inputs
    with torch.no_grad():
        for share in shares:
            inputs.append(x)
            for name in share:
                x, _ = twins[0].layers[name](x)

    def job(twin, share, x0, last):
        def step():
            x = x0.detach().requires_grad_(True) if x0.is_floating_point() else x0
            for name in share:
                x, _ = twin.layers[name](x)
            (nll_sum(x, batch.targets) if last else x.sum()).backward()
        return step
    return [job(twins[k // len(shares)], shares[k % len(shares)], inputs[k % len(shares)],
                k % len(shares) == len(shares) - 1) for k in range(n)]
