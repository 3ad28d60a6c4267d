"""Positional dropout masks against torch's own dropout: training tokens/s of the mxnet8 model.

    PYTHONPATH=. .venv/bin/python bench/dropout.py [--rounds 7] [--threads 1]

mpedu's masks are a hash of (seed, step, layer, sequence, time step, feature) computed with
integer ops (mpedu.lm.dropout), so that every placement and schedule draws the same masks;
torch's nn.Dropout draws from its generator. Both models have the same weights and train
the same batch on the single-device runner; the two are timed in turn, round after round,
and compared by the median of the per-round ratios (bench/common.py). Also timed: one mask
of the mxnet8 LSTM output's shape (T 35, B 64, H 400) on its own. The target is a tokens/s
ratio (positional / torch) of at least 0.97. Other work on a shared machine adds noise.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, median_ratio, paired_rounds, random_batch  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from mpedu.lm import LSTMLM, Position, PositionalDropout, dropout  # noqa: E402
from mpedu.predict import measure_cores  # noqa: E402
from mpedu.core import SingleDevice  # noqa: E402


def with_torch_dropout(model: LSTMLM) -> LSTMLM:
    """A copy of `model` whose dropout layers are torch's nn.Dropout of the same p."""
    twin = copy.deepcopy(model)
    for layer in twin.layers.values():
        if isinstance(getattr(layer, "drop", None), PositionalDropout):
            layer.drop = nn.Dropout(layer.drop.p)
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default: 1, a virtual device)")
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--T", type=int, default=35)
    parser.add_argument("--B", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    free = measure_cores(2)
    torch.manual_seed(0)
    model = LSTMLM.from_config("mxnet8", vocab_size=args.vocab)
    twin = with_torch_dropout(model)
    batch = random_batch(args.vocab, args.T, args.B)
    positional, plain = SingleDevice(model), SingleDevice(twin)

    def step(runner):
        def run():
            runner.model.zero_grad(set_to_none=True)
            runner.train_step(batch)
        return run

    p, shape = model.config.dropout, (args.T, args.B, model.config.hidden_size)
    x, grad = torch.randn(shape, requires_grad=True), torch.randn(shape)
    drop = PositionalDropout(p, layer=1).train()

    def mask():                       # one mask of an LSTM output, forward and backward
        with dropout.at(Position(0, 0)):
            drop(x).backward(grad)

    def torch_mask():
        F.dropout(x, p, True).backward(grad)

    runs = {"positional": step(positional), "torch": step(plain), "mask": mask, "torch_mask": torch_mask}
    for fn in runs.values():          # warm-up
        fn()
    # rounds in turn, the order flipped every round so that neither side always runs first
    times = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for k, ts in paired_rounds({k: runs[k] for k in order}, repeats=1, warmup=0).items():
            times[k] += ts
    tokens = batch.tokens
    rate = {k: tokens / statistics.median(times[k]) for k in ("positional", "torch")}
    ratio = median_ratio(times["torch"], times["positional"])     # = tokens/s positional / tokens/s torch
    mask_ms, torch_mask_ms = (1e3 * statistics.median(times[k]) for k in ("mask", "torch_mask"))
    print(f"mxnet8 (dropout {p}), batch T={args.T} B={args.B}, {args.threads} thread(s), single-device runner; "
          f"{args.rounds} rounds in turn; free cores measured: {free:.1f} (a busy machine adds noise)")
    print(f"{'dropout':<12} {'tokens/s':>10} {'step s':>8}")
    for k in ("positional", "torch"):
        print(f"{k:<12} {rate[k]:>10,.0f} {statistics.median(times[k]):>8.3f}")
    print(f"ratio positional / torch (median of per-round ratios): {ratio:.3f}  (target >= 0.97: "
          f"{'met' if ratio >= 0.97 else 'NOT met'})")
    print(f"one {shape} dropout, forward + backward: positional {mask_ms:.2f} ms, torch's {torch_mask_ms:.2f} ms "
          f"(the mxnet8 model has {1 + model.config.num_layers} dropout layers)")
    finish("dropout", {"model": "mxnet8", "dropout": p, "T": args.T, "B": args.B, "threads": args.threads,
                       "rounds": args.rounds, "free_cores": free, "tokens_per_s": rate, "ratio": ratio,
                       "target": 0.97, "mask_ms": mask_ms, "torch_mask_ms": torch_mask_ms, "machine": machine()})


if __name__ == "__main__":
    main()
