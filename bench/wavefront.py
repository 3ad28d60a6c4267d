"""Wavefront (time-chunk) pipelining vs plain model parallelism, measured and predicted.

    python bench/wavefront.py [--repeats 5]

One batch, no batch micro-batching (m = 1), 2 virtual devices. "naive" is MXNet's
plain model parallelism: device 1 waits for device 0 to finish the whole sequence.
"wavefront" cuts the sequence into c time chunks: device 1 starts chunk 0 while
device 0 runs chunk 1. The prediction profiles per-layer costs of the whole sequence
and plays the schedule in the simulator, each chunk costing 1/c of it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, median_time, random_batch  # noqa: E402

from mpedu.lm import LSTMLM, LMConfig  # noqa: E402
from mpedu.core import Pipeline  # noqa: E402
from mpedu.predict import profile, simulate  # noqa: E402

VOCAB, T, B = 2000, 64, 32
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=3)
PLACEMENT = "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LSTMLM(VOCAB, CONFIG)
    batch = random_batch(VOCAB, T, B)

    def measure(schedule, chunks):
        with Pipeline(model, PLACEMENT, schedule, micro_batches=1, chunks=chunks) as pipe:
            def step():
                model.zero_grad()
                pipe.train_step(batch)
            wall = median_time(step, args.repeats)
            costs = profile(model, batch, device="vgpu:0")   # whole sequence; the simulator divides by chunks
            predicted = simulate(pipe, costs).makespan
        return wall, predicted

    naive_wall, naive_pred = measure("naive", 1)
    rows = []
    for c in args.chunks:
        wall, pred = measure("wavefront", c)
        rows.append((c, wall, naive_wall / wall, naive_pred / pred, 2 * c / (c + 1)))
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, vocab {VOCAB}; "
          f"one batch T={T} B={B}, m=1; placement {PLACEMENT}")
    print(f"naive model parallelism: {naive_wall * 1e3:.1f} ms per step (predicted {naive_pred * 1e3:.1f} ms)")
    print(f"{'chunks':>7}{'step (ms)':>11}{'measured':>10}{'predicted':>11}{'ideal':>8}   (speedup over naive)")
    for c, wall, measured, predicted, ideal in rows:
        print(f"{c:>7}{wall * 1e3:>11.1f}{measured:>9.2f}x{predicted:>10.2f}x{ideal:>7.2f}x")
    best = max(rows, key=lambda r: r[2])
    finish("wavefront", {"benchmark": "wavefront", "devices": 2, "T": T, "B": B,
                         "naive_step_s": naive_wall,
                         "runs": [{"chunks": c, "step_s": w, "speedup": s, "predicted_speedup": p, "ideal": i}
                                  for c, w, s, p, i in rows],
                         "best_chunks": best[0], "speedup": best[2], "predicted_speedup": best[3],
                         "machine": machine()})


if __name__ == "__main__":
    main()
