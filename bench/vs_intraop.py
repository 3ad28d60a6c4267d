"""mpedu's pipeline against PyTorch's own use of two cores (intra-op threads), under two malloc settings.

    python bench/vs_intraop.py [--rounds 3] [--steps 4]

The how-to's model (`mxnet8`: embed 200, 8 LSTM layers of 400, vocab 10,000; T=35, B=64,
dropout off on both sides so the work is the same) is trained four ways:
  plain1  one plain PyTorch module (embedding, one 8-layer nn.LSTM, linear), 1 thread
  plain2  the same module with 2 intra-op threads: what a user gets from two cores without mpedu
  mpedu1  mpedu on 1 virtual device (its worker thread, one core)
  mpedu2  mpedu on 2 virtual devices: 1F1B, zero bubble, wavefront (time chunks of the whole
          batch) and interleaved 1F1B, each time-balanced (1F1B also with the cut moved one layer
          either way); the fastest measured counts
Each allocator setting runs in fresh processes: `default` (glibc as shipped) and `tuned`
(MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 in the environment). The plain runs
never import mpedu, so mpedu's own malloc settings (mpedu/allocator.py) cannot help them;
mpedu's runs get them under both. A round runs the plain process and the mpedu process one
after the other (the order alternates); ratios are medians over rounds of same-round pairs.
JSON: per setting `pipeline_vs_2core_limit` (best mpedu2 / plain2) and `one_device_vs_plain`
(mpedu1 / plain1), tokens/s, minor page faults per step.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB, T, B = 10_000, 35, 64
TUNED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
SETTINGS = ("default", "tuned")
# (schedule, micro-batches, time chunks, stages): stages > 2 places them round-robin on the two devices.
# 1F1B also runs with its cut moved one layer either way: the profile's balance is a prediction,
# and "mpedu's best" here means the best measured.
PIPELINES = (("1f1b", 4, 1, 2), ("1f1b", 8, 1, 2), ("zb1", 4, 1, 2), ("wavefront", 1, 7, 2), ("interleaved", 4, 1, 4))


def batch_tensors():
    import torch
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(3, VOCAB, (T, B), generator=g)
    inputs = torch.cat([torch.full((1, B), 2), targets[:-1]])
    return inputs, targets


def timed(step, steps: int) -> dict:
    """Median seconds of `steps` steps after one warm-up, and minor faults per step (the whole process)."""
    step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    return {"tokens_per_s": T * B / statistics.median(times), "faults_per_step": faults}


def run_plain(steps: int) -> dict:
    import torch
    from torch import nn
    torch.manual_seed(0)
    embed, lstm, decode = nn.Embedding(VOCAB, 200), nn.LSTM(200, 400, 8), nn.Linear(400, VOCAB)
    inputs, targets = batch_tensors()

    def step():
        for module in (embed, lstm, decode):
            module.zero_grad()
        logits = decode(lstm(embed(inputs))[0])
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), reduction="sum") / (T * B)
        loss.backward()

    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out[f"plain{threads}"] = timed(step, steps)
    return out


def run_mpedu(steps: int) -> dict:
    import torch
    from mpedu import allocator
    from mpedu.balance import balance, to_placement
    from mpedu.bucketing import Batch
    from mpedu.model import LSTMLM
    from mpedu.pipeline import Pipeline
    from mpedu.profile import profile
    torch.manual_seed(0)
    model = LSTMLM.from_config("mxnet8", VOCAB, dropout=0.0)
    inputs, targets = batch_tensors()
    batch = Batch(inputs, targets, targets != 0, T, False)
    out = {"allocator": allocator.state()}

    def measure(name, placement, schedule, m, chunks=1):
        with Pipeline(model, placement, schedule, m, chunks) as pipe:
            out[name] = timed(lambda: (model.zero_grad(), pipe.train_step(batch)), steps)
            out[name]["placement"] = str(pipe.placement)

    measure("mpedu1", ",".join(model.layer_names) + ":vgpu0", "gpipe", 1)
    per_layer = {}
    for schedule, m, chunks, stages in PIPELINES:
        if m not in per_layer:
            costs = profile(model, batch, "vgpu:0", micro_batches=m, repeats=3)
            per_layer[m] = [f + b for f, b in zip(costs.forward, costs.backward)]
        devices = [f"vgpu:{k % 2}" for k in range(stages)]
        counts = balance(per_layer[m], stages, names=model.layer_names)
        shifts = (0, -1, 1) if schedule == "1f1b" else (0,)
        for shift in shifts:
            moved = [counts[0] + shift, counts[1] - shift] if shift else counts
            if min(moved) < 1:
                continue
            name = f"mpedu2 {schedule} m={m}" + (f" chunks={chunks}" if chunks > 1 else "") + (
                f", cut {shift:+d}" if shift else "")
            measure(name, to_placement(model, moved, devices), schedule, m, chunks)
    return out


def run_alloc(steps: int) -> dict:
    """1, 2 and 4 workers allocating at once, each round a 20 MB tensor written and freed and 200 small
    ones (40 kB, an LSTM time step's gates): seconds per round, the workers' rounds overlapping."""
    import torch
    from mpedu import allocator
    from mpedu.devices import Worker, get_device, stop_workers

    def rounds(n):
        for _ in range(n):
            torch.ones(5_000_000).mul_(2)
            for _ in range(200):
                torch.ones(10_000)

    out = {"allocator": allocator.state()}
    for workers in (1, 2, 4):
        pool = [Worker(get_device(f"vgpu:{k}")) for k in range(workers)]
        try:
            for job in [w.submit(lambda: rounds(2)) for w in pool]:
                job.result()                                     # warm-up: heaps at their peak
            start = time.perf_counter()
            for job in [w.submit(lambda: rounds(40 * steps)) for w in pool]:
                job.result()
            out[f"alloc {workers} workers"] = {"s_per_round": (time.perf_counter() - start) / (40 * steps)}
        finally:
            stop_workers(pool)
    return out


def child(kind: str, setting: str, steps: int, allocator: str = "keep") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["MPEDU_ALLOCATOR"] = allocator
    if setting == "tuned":
        env.update(TUNED)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(steps)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", choices=("plain", "mpedu", "alloc"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"plain": run_plain, "mpedu": run_mpedu, "alloc": run_alloc}[args.child](args.steps)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import finish, machine

    result = {"benchmark": "vs_intraop", "machine": machine(), "model": "mxnet8 (dropout 0)", "T": T, "B": B,
              "rounds": args.rounds, "steps": args.steps, "load_average": list(os.getloadavg()[:2])}
    for setting in SETTINGS:
        rounds = []
        for r in range(args.rounds):
            kinds = ("plain", "mpedu") if r % 2 == 0 else ("mpedu", "plain")
            row = {}
            for kind in kinds:
                row.update(child(kind, setting, args.steps))
            rounds.append(row)
        names = [k for k in rounds[0] if k.startswith(("plain", "mpedu"))]
        tps = {n: statistics.median(r[n]["tokens_per_s"] for r in rounds) for n in names}
        faults = {n: statistics.median(r[n]["faults_per_step"] for r in rounds) for n in names}
        pipes = [n for n in names if n.startswith("mpedu2")]
        best = max(pipes, key=tps.get)
        ratio = lambda a, b: statistics.median(r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rounds)  # noqa: E731
        result[setting] = {
            "allocator_in_mpedu": rounds[0]["allocator"], "tokens_per_s": tps, "faults_per_step": faults,
            "best_pipeline": best, "placements": {n: rounds[0][n]["placement"] for n in pipes},
            "one_device_vs_plain": ratio("mpedu1", "plain1"),
            "pipeline_vs_2core_limit": ratio(best, "plain2"),
            "two_core_limit_vs_plain": ratio("plain2", "plain1"),
            "pipeline_vs_one_device": ratio(best, "mpedu1"),
        }
        print(f"\n{setting} malloc (mpedu: {rounds[0]['allocator']})")
        print(f"  {'run':26s} {'tokens/s':>9s} {'faults/step':>12s}")
        for n in names:
            print(f"  {n:26s} {tps[n]:9.0f} {faults[n]:12.0f}")
        s = result[setting]
        print(f"  one device vs plain {s['one_device_vs_plain']:.3f}; best pipeline ({best}) vs 2-core limit "
              f"{s['pipeline_vs_2core_limit']:.3f}; 2 threads vs 1: {s['two_core_limit_vs_plain']:.2f}x")
    # What keeping freed memory costs or saves when several workers allocate at once (default malloc env)
    result["allocating_at_once"] = {}
    print("\nworkers allocating at once (s per round: a 20 MB tensor and 200 of 40 kB each)")
    for choice in ("keep", "system"):
        rows = [child("alloc", "default", args.steps, choice) for _ in range(args.rounds)]
        per = {k: statistics.median(r[k]["s_per_round"] for r in rows) for k in rows[0] if k != "allocator"}
        result["allocating_at_once"][choice] = per
        print(f"  MPEDU_ALLOCATOR={choice:6s} " + "  ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in per.items()))
    result["targets_met"] = all(result[s]["one_device_vs_plain"] >= 0.97 and
                                result[s]["pipeline_vs_2core_limit"] >= 0.95 for s in SETTINGS)
    finish("vs_intraop", result)


if __name__ == "__main__":
    main()
