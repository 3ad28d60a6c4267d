"""Soak: hundreds of pipeline steps over bucket shapes and schedules, with failures; threads, memory and files stay flat."""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, random_batch  # noqa: E402
from mpedu.lm import LSTMLM  # noqa: E402
from mpedu.core import Pipeline  # noqa: E402

VOCAB = 500
PLACEMENT = "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"
# (schedule, micro-batches, time chunks): every kind of executor path, one Pipeline each
SCHEDULES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("zb1", 4, 1), ("wavefront", 2, 2)]
SHAPES = [(6, 8), (10, 16), (16, 8), (24, 16)]      # (T, B) buckets: each Pipeline caches one plan per shape
REBUILD_EVERY = 40       # close one schedule's Pipeline and build it again: workers must end, not pile up
FAIL_EVERY = 25          # a stage raises mid-step: the error reaches us and the step's tensors are dropped
SAMPLE_EVERY = 10
RSS_SLACK_MB = 8.0       # allocator noise on a 2-core machine; a leak of one batch a step is far more
# Memory that grows in a step and then stays (a rebuilt pipeline's new worker threads get glibc arenas of their own,
# which mpedu's `keep` never trims) is no leak: a leak goes on. Over the last half of the run the RSS must rise by
# less than this per 1,000 steps (a kilobyte a step; one leaked micro-batch's activations are tens of kilobytes).
RSS_TREND_MB_PER_1000 = 1.0


class Injected(RuntimeError):
    pass


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def build(model, schedule, m, chunks) -> Pipeline:
    return Pipeline(model, PLACEMENT, schedule, micro_batches=m, chunks=chunks)


def fail_once(pipe: Pipeline) -> None:
    """The next forward of stage 1 raises; the patch removes itself."""
    stage = pipe.stages[1]

    def broken(*args, **kwargs):
        del stage.forward
        raise Injected("injected failure")

    stage.forward = broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--seconds", type=float, default=100.0, help="stop early after this long")
    parser.add_argument("--warmup", type=int, default=40, help="steps before the first sample")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=VOCAB)
    batches = {shape: random_batch(VOCAB, *shape, seed=k) for k, shape in enumerate(SHAPES)}
    pipes = [build(model, *spec) for spec in SCHEDULES]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples, failures, rebuilds = [], 0, 0
    started = time.perf_counter()
    step = 0
    print(f"{'step':>5} {'threads':>8} {'RSS MB':>8} {'open files':>10} {'seconds':>8}")
    for step in range(1, args.steps + 1):
        k = step % len(SCHEDULES)
        (name, m, chunks), shape = SCHEDULES[k], SHAPES[(step // len(SCHEDULES)) % len(SHAPES)]
        if step % REBUILD_EVERY == 0:
            pipes[k].close()
            pipes[k] = build(model, name, m, chunks)
            rebuilds += 1
        if step % FAIL_EVERY == 0:
            fail_once(pipes[k])
        optimizer.zero_grad(set_to_none=True)
        try:
            pipes[k].train_step(batches[shape])
            optimizer.step()
        except Injected:
            failures += 1
        if step >= args.warmup and step % SAMPLE_EVERY == 0:
            gc.collect()
            samples.append((step, threading.active_count(), rss_mb(), open_files()))
            if len(samples) % 20 == 1:
                print(f"{step:>5} {samples[-1][1]:>8} {samples[-1][2]:>8.1f} {samples[-1][3]:>10} "
                      f"{time.perf_counter() - started:>8.1f}")
        if time.perf_counter() - started > args.seconds:
            break
    for pipe in pipes:
        pipe.close()

    quarter = max(1, len(samples) // 4)
    first, last = samples[:quarter], samples[-quarter:]
    start = {key: statistics.median(s[i] for s in first) for i, key in enumerate(("step", "threads", "rss", "fds"))}
    end = {key: statistics.median(s[i] for s in last) for i, key in enumerate(("step", "threads", "rss", "fds"))}
    half = samples[len(samples) // 2:]       # least squares; a run too short for two samples has no trend
    trend = (statistics.linear_regression([s[0] for s in half], [s[2] for s in half]).slope * 1000
             if len(half) > 1 else 0.0)
    flat = (end["threads"] <= start["threads"] and end["fds"] <= start["fds"]
            and (end["rss"] - start["rss"] <= max(RSS_SLACK_MB, 0.05 * start["rss"])
                 or trend < RSS_TREND_MB_PER_1000))
    print(f"\n{step} steps in {time.perf_counter() - started:.1f} s over {len(SCHEDULES)} schedules x "
          f"{len(SHAPES)} bucket shapes; {failures} injected failures, {rebuilds} pipelines rebuilt")
    print(f"first quarter of samples (median) vs last: threads {start['threads']} -> {end['threads']}, "
          f"RSS {start['rss']:.1f} -> {end['rss']:.1f} MB (last half {trend:+.2f} MB per 1,000 steps), open files "
          f"{start['fds']} -> {end['fds']}: {'flat' if flat else 'GROWING'}")
    print(f"after closing every pipeline: {threading.active_count()} threads")
    finish("soak", {
        "steps": step, "schedules": [s for s, _, _ in SCHEDULES], "shapes": [list(s) for s in SHAPES],
        "failures_injected": failures, "pipelines_rebuilt": rebuilds,
        "threads_start": start["threads"], "threads_end": end["threads"],
        "rss_mb_start": round(start["rss"], 1), "rss_mb_end": round(end["rss"], 1),
        "rss_mb_per_1000_steps_last_half": round(trend, 3),
        "fds_start": start["fds"], "fds_end": end["fds"], "threads_after_close": threading.active_count(),
        "seconds": round(time.perf_counter() - started, 1), "flat": flat, "machine": machine(),
    })


if __name__ == "__main__":
    main()
