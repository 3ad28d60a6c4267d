"""How fast one layer computes depending on what runs around it: the other core computing at the same time,
or other work on its own core since it last ran. Both are why a layer inside a pipeline does not run at
the speed `mpedu.predict.profiling` measures it alone, warm.

    python bench/layer_context.py [--rounds 4] [--repeats 60]

Two pinned workers (vgpu:0 and vgpu:1, a core each, as a pipeline pins them); the work is one micro-batch
(35 steps, 8 sentences) through an LSTM layer 256 wide or the fidelity model's decoder to 2000 words.
- The other core: each round, for every layer A and partner B, A's forward and backward timed alone on
  vgpu:0, then again while vgpu:1 runs B's in a loop. Per pair: the median over rounds of
  (together / alone - 1), per round since a core's own speed drifts between rounds on a shared host.
  `measure_cores` on the same LSTM layer is printed beside it (the number `simulate(..., cores=...)` takes).
- Its own cache: the LSTM layer's forward and its backward, each timed right after the layer last ran
  (warm, as the profile times it), after three other LSTM layers' forward and backward (as in a stage of
  several layers, or between two micro-batches' actions), and after writing 16 MB (nothing of it cached).
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
from common import finish, machine, median_time  # noqa: E402

from mpedu.predict import measure_cores  # noqa: E402
from mpedu.runtime import Worker, get_device, own_cores  # noqa: E402
from mpedu.lm import nll_sum  # noqa: E402

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
        sys.exit("layer_context.py needs two cores this process may pin a worker to each (Linux)")
    workers = [Worker(d, core=c) for d, c in zip(devices, cores)]
    kinds = ("lstm", "decode")
    jobs = {(kind, w): _job(kind) for kind in kinds for w in (0, 1)}

    def timed(fn):
        return lambda: median_time(fn, args.repeats, warmup=1)

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
        cache = _cache_warmth(workers[0], args.rounds, args.repeats)     # vgpu:1 idle
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
    warm = cache["warm"]
    for where, (f, bw) in cache.items():
        print(f"LSTM layer, {where:<28} forward {statistics.median(f) * 1e3:5.2f} ms "
              f"({statistics.median(f) / statistics.median(warm[0]) - 1:+.1%})  backward "
              f"{statistics.median(bw) * 1e3:5.2f} ms ({statistics.median(bw) / statistics.median(warm[1]) - 1:+.1%})")
    print(f"its own cache: medians over {args.rounds} rounds, against the warm times")
    finish("layer_context", {"benchmark": "layer_context", "rounds": args.rounds, "repeats": args.repeats,
                             "alone_ms": alone_ms,
                             "slowdown": {f"{a} with {p}": slower[a, p] for a in kinds for p in kinds},
                             "measure_cores_lstm": shared,
                             "cache_ms": {where: {"forward": [t * 1e3 for t in f], "backward": [t * 1e3 for t in bw]}
                                          for where, (f, bw) in cache.items()},
                             "machine": machine()})


def _cache_warmth(worker, rounds: int, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per round, the LSTM layer's median forward and backward seconds on `worker`, with each of three things
    run just before each of them: nothing, three other LSTM layers' forward and backward, writing 16 MB."""
    lstm, x = torch.nn.LSTM(H, H), torch.randn(T, b, H, requires_grad=True)
    others, other_x = [torch.nn.LSTM(H, H) for _ in range(3)], torch.randn(T, b, H, requires_grad=True)
    scratch = torch.zeros(4 << 20)                                  # 16 MB, more than the caches hold

    def other_layers():
        for layer in others:
            layer(other_x)[0].sum().backward()

    before = {"warm": lambda: None, "after 3 other LSTM layers": other_layers,
              "after writing 16 MB": lambda: scratch.add_(1.0)}

    def timed(first):
        def run():
            f, bw = [], []
            for _ in range(repeats):
                first()
                start = time.perf_counter()
                y = lstm(x)[0]
                f.append(time.perf_counter() - start)
                first()
                start = time.perf_counter()
                y.backward(torch.ones_like(y))
                bw.append(time.perf_counter() - start)
            return statistics.median(f), statistics.median(bw)
        return run

    out = {where: ([], []) for where in before}
    for _ in range(rounds):
        for where, first in before.items():
            f, bw = worker.submit(timed(first)).result()
            out[where][0].append(f)
            out[where][1].append(bw)
    return out


if __name__ == "__main__":
    main()
