"""How much slower a layer computes while the other core computes too: the slowdown the simulator's `cores`
charges on average, here per kind of layer and per partner.

    python bench/contention.py [--rounds 4] [--repeats 60]

Two pinned workers (vgpu:0 and vgpu:1, a core each, as a pipeline pins them). Each round, for every kind
of layer A (an LSTM layer 256 wide, the fidelity model's decoder to 2000 words) and every partner B: A's
forward and backward on one micro-batch (35 steps, 8 sentences), timed alone on vgpu:0, then again while
vgpu:1 runs B's in a loop. The result per pair is the median over rounds of (together / alone - 1): per
round, since a core's own speed drifts between rounds on a shared host. `measure_cores` on the same LSTM
layer is printed beside it: n / (mean slowdown), the number `simulate(..., cores=...)` takes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine  # noqa: E402

from mpedu.cores import measure_cores  # noqa: E402
from mpedu.devices import Worker, get_device, own_cores  # noqa: E402
from mpedu.model import nll_sum  # noqa: E402

H, T, b, V = 256, 35, 8, 2000


def _job(kind: str):
    """One forward and backward of a fresh copy of the layer, on its own input: (T, b, H) in."""
    x = torch.randn(T, b, H, requires_grad=True)
    if kind == "lstm":
        layer = torch.nn.LSTM(H, H)
        return lambda: layer(x)[0].sum().backward()
    layer, targets = torch.nn.Linear(H, V), torch.randint(0, V, (T, b))
    return lambda: nll_sum(layer(x), targets).backward()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=60, help="timed runs of A per measurement (median)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    devices = [get_device("vgpu:0"), get_device("vgpu:1")]
    cores = own_cores(devices)
    if cores is None:
        sys.exit("contention.py needs two cores this process may pin a worker to each (Linux)")
    workers = [Worker(d, core=c) for d, c in zip(devices, cores)]
    kinds = ("lstm", "decode")
    jobs = {(kind, w): _job(kind) for kind in kinds for w in (0, 1)}

    def timed(fn):
        def run():
            fn()                                                    # warm
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
            return statistics.median(seconds)
        return run

    def looping(fn, stop):
        def run():
            while not stop.is_set():
                fn()
        return run

    slower = {(a, p): [] for a in kinds for p in kinds}
    alone_ms = {a: [] for a in kinds}
    try:
        for _ in range(args.rounds):
            for a in kinds:
                alone = workers[0].submit(timed(jobs[a, 0])).result()
                alone_ms[a].append(alone * 1e3)
                for p in kinds:
                    stop = threading.Event()
                    partner = workers[1].submit(looping(jobs[p, 1], stop))
                    together = workers[0].submit(timed(jobs[a, 0])).result()
                    stop.set()
                    partner.result()
                    slower[a, p].append(together / alone - 1)
    finally:
        for w in workers:
            w.stop()
    shared = measure_cores(2, repeats=3)
    print(f"{'layer':<8}{'alone ms':>16}" + "".join(f"{'with ' + p:>24}" for p in kinds))
    for a in kinds:
        cells = "".join(f"{statistics.median(slower[a, p]):>+10.1%} ({min(slower[a, p]):+.0%} to {max(slower[a, p]):+.0%})"
                        for p in kinds)
        print(f"{a:<8}{min(alone_ms[a]):>7.2f}-{max(alone_ms[a]):<7.2f} {cells}")
    print(f"slowdown of each layer's forward and backward on vgpu:0 while vgpu:1 computes the partner (median over "
          f"{args.rounds} rounds, range in brackets); measure_cores on an LSTM layer each: {shared:.2f} cores "
          f"(each worker {2 / shared - 1:+.1%})")
    finish("contention", {"benchmark": "contention", "rounds": args.rounds, "repeats": args.repeats,
                          "alone_ms": alone_ms,
                          "slowdown": {f"{a} with {p}": slower[a, p] for a in kinds for p in kinds},
                          "measure_cores_lstm": shared, "machine": machine()})


if __name__ == "__main__":
    main()
