"""Shared bits of the benchmarks: a random batch, timing by median, the closing JSON line."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mpedu.bucketing import Batch


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


def machine() -> dict:
    return {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available()}


def finish(name: str, result: dict) -> None:
    """Write bench/results/<name>.json and print the result as the last line."""
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
