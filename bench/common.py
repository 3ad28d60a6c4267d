"""Shared bits of the benchmarks: a random batch, timing by median, the closing JSON line."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mpedu.lm import Batch
from mpedu.course import in_turn


def random_batch(vocab: int, T: int, B: int, seed: int = 0) -> Batch:
    """A full (no padding) time-major batch of random tokens: benchmarks time compute, not data."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(3, vocab, (T, B), generator=g)
    inputs = torch.cat([torch.full((1, B), 2), targets[:-1]])
    return Batch(inputs, targets, targets != 0, T, False)


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_rounds(runs: dict, repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each callable per round, timed in turn round after round (A B C, C B A, ...).

    Compare runs by `median_ratio` of the same rounds: a machine whose speed drifts
    (other tenants on a shared host) then slows both sides of each ratio alike.
    (mpedu.course.claims.in_turn does the timing; the course's verdicts use it too.)
    """
    return in_turn(runs, rounds=repeats, warmup=warmup)


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of numerator / denominator (both timed in the same round)."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def machine() -> dict:
    return {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available()}


def pinned_workers(names) -> list:
    """One mpedu Worker per virtual device in `names`, each pinned to a core of its own as a Pipeline pins its
    workers (mpedu.runtime.workers.own_cores), or unpinned where it cannot be (macOS, more devices than cores)."""
    from mpedu.runtime import Worker, get_device, own_cores
    devices = [get_device(n) for n in names]
    cores = own_cores(devices)
    return [Worker(d, core=cores[k] if cores else None) for k, d in enumerate(devices)]


def finish(name: str, result: dict) -> None:
    """Write bench/results/<name>.json and print the result as the last line."""
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
