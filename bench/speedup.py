"""Pipelined vs one device, and mpedu's one device vs the same network as a plain PyTorch module.

    python bench/speedup.py [--repeats 15]

One virtual device is one CPU core (its worker runs torch single-threaded), so
"1 vs 2 devices" is one core vs two. Both runs use the same micro-batches (GPipe,
m = 8): the only difference is how many devices share the work.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, median_ratio, paired_rounds, random_batch  # noqa: E402

from mpedu.lm import LSTMLM, LMConfig, nll_sum  # noqa: E402
from mpedu.core import Pipeline, Placement  # noqa: E402

VOCAB, T, B, M = 2000, 35, 64, 8
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=3)   # 3 LSTM + decode split 2|2


class PlainLM(nn.Module):
    """The same network as one PyTorch module: embedding, one 3-layer LSTM, linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CONFIG.embed_size)
        self.lstm = nn.LSTM(CONFIG.embed_size, CONFIG.hidden_size, CONFIG.num_layers)
        self.decode = nn.Linear(CONFIG.hidden_size, VOCAB)

    def forward(self, tokens):
        return self.decode(self.lstm(self.embed(tokens))[0])


def balanced_split(model, batch) -> tuple[Placement, list[float]]:
    """Time each layer's forward + backward on one micro-batch (every layer its own stage)
    and cut where the two halves are closest; mpedu.predict.partition generalises this."""
    names = model.layer_names
    micro = batch.split(M)[0]
    alternating = " | ".join(f"{n}:vgpu{k % 2}" for k, n in enumerate(names))
    with Pipeline(model, alternating, "naive", 1) as pipe:
        for _ in range(3):
            pipe.train_step(micro)
        samples = [pipe.train_step(micro).timeline for _ in range(5)]
    model.zero_grad()
    costs = [statistics.median(sum(e.duration for e in tl.compute() if e.stage == s) for tl in samples)
             for s in range(len(names))]
    total = sum(costs)
    best = min(range(1, len(names)), key=lambda k: abs(sum(costs[:k]) - total / 2))
    return Placement.parse(f"{','.join(names[:best])}:vgpu0 | {','.join(names[best:])}:vgpu1", model), costs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)   # the plain module gets one core, like one virtual device
    model = LSTMLM(VOCAB, CONFIG)
    batch = random_batch(VOCAB, T, B)
    placement, costs = balanced_split(model, batch)

    plain = PlainLM()

    busy: dict[str, list[float]] = {"one": [], "two": []}    # compute seconds summed over devices, per step

    def stepper(pipe, name=None):
        def step():
            model.zero_grad()
            timeline = pipe.train_step(batch).timeline
            if name:
                busy[name].append(sum(timeline.busy(d) for d in timeline.devices))
        return step

    def plain_step():
        plain.zero_grad()
        loss = nll_sum(plain(batch.inputs), batch.targets) / batch.tokens
        loss.backward()

    with Pipeline(model, Placement.single(model), "gpipe", M) as one, \
            Pipeline(model, placement, "gpipe", M) as two, \
            Pipeline(model, Placement.single(model), "naive", 1) as whole:
        # the runs take turns, round after round, so drifting machine speed hits all alike
        rounds = paired_rounds({"one": stepper(one, "one"), "two": stepper(two, "two"), "whole": stepper(whole),
                                "plain": plain_step}, args.repeats)
        bubble = two.train_step(batch).timeline.bubble_fraction
    t1, t2, t_mpedu, t_plain = (statistics.median(rounds[k]) for k in ("one", "two", "whole", "plain"))

    p = 2
    ideal = M * p / (M + p - 1)
    speedup = median_ratio(rounds["one"], rounds["two"])
    vs_plain = median_ratio(rounds["plain"], rounds["whole"])
    # The same F and B actions took this much longer when two cores ran at once (shared caches and
    # memory bandwidth, other tenants of the host): a cost of the machine, which no schedule removes.
    k = args.repeats
    slowdown = median_ratio(busy["two"][-k:], busy["one"][-k:])     # the timed rounds, not the warm-up
    tokens = batch.tokens
    rows = [("1 virtual device, GPipe m=8", t1), ("2 virtual devices, GPipe m=8", t2),
            ("mpedu, 1 device, whole batch", t_mpedu), ("plain PyTorch module, 1 thread", t_plain)]
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, "
          f"vocab {VOCAB}; batch T={T} B={B}; one core per device")
    print("per-layer forward+backward (ms): " + ", ".join(f"{n} {c * 1e3:.1f}" for n, c in
                                                           zip(model.layer_names, costs)))
    print(f"placement: {placement}")
    print(f"{'run':<34}{'step (ms)':>12}{'tokens/s':>12}")
    for name, t in rows:
        print(f"{name:<34}{t * 1e3:>12.1f}{tokens / t:>12.0f}")
    print(f"speedup {speedup:.2f}x, ideal {ideal:.2f}x, efficiency {speedup / ideal:.2f}, "
          f"measured bubble {bubble:.1%}; mpedu vs plain torch {vs_plain:.2f}")
    print(f"the same actions computed {slowdown - 1:+.1%} longer with both cores busy; "
          f"without that, efficiency {speedup * slowdown / ideal:.2f}")
    print(f"(ratios are medians over {args.repeats} rounds of the runs timed in turn)")
    finish("speedup", {"benchmark": "speedup", "placement": str(placement), "micro_batches": M,
                       "step_s_1_device": t1, "step_s_2_devices": t2, "speedup": speedup, "ideal": ideal,
                       "efficiency": speedup / ideal, "bubble_fraction": bubble,
                       "parallel_slowdown": slowdown, "efficiency_without_slowdown": speedup * slowdown / ideal,
                       "tokens_per_s_mpedu": tokens / t_mpedu, "tokens_per_s_plain": tokens / t_plain,
                       "vs_plain_torch": vs_plain, "rounds": args.repeats, "machine": machine()})


if __name__ == "__main__":
    main()
