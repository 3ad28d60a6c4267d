"""Other work on the machine, measured: how many cores other processes used while a benchmark round ran.

A prediction is made for a machine whose cores are this benchmark's; a round during which another
process took part of a core measures that process as much as the pipeline. The benchmarks that
compare predicted with measured times (fidelity, planner) wait for a quiet moment before each
round and run a round again when other work came in the middle of it.

    with OtherWork() as other:
        ...                              # one round
    other.cores                          # cores' worth of CPU other processes used meanwhile

Linux only (/proc/stat); elsewhere `cores` is None and nothing waits.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float | None:
    """CPU seconds every process has spent (all cores, idle and iowait left out), or None off Linux."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]             # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _HZ


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system                           # every thread of this process


class OtherWork:
    """Context manager: `cores` = CPU seconds other processes used / wall seconds of the block."""

    def __init__(self):
        self.cores: float | None = None

    def __enter__(self):
        self._busy, self._own, self._wall = _busy_seconds(), _own_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy = _busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is not None and self._busy is not None and wall > 0:
            self.cores = max(0.0, (busy - self._busy) - (_own_seconds() - self._own)) / wall
        return False


def wait_quiet(threshold: float = 0.1, sample_s: float = 1.0, timeout_s: float = 120.0) -> float | None:
    """Wait (at most `timeout_s`) until other processes use under `threshold` cores for `sample_s`;
    return what they used in the last sample (None off Linux, without waiting)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        with OtherWork() as other:
            time.sleep(sample_s)
        if other.cores is None or other.cores < threshold or time.perf_counter() > deadline:
            return other.cores


def quiet_rounds(run_round, rounds: int, threshold: float = 0.1, retries: int | None = None,
                 timeout_s: float = 120.0) -> list[float | None]:
    """Call `run_round(r)` for r in 0..rounds-1, each after a quiet moment; a round during which other
    processes used more than `threshold` cores is run again (its results are the caller's to drop:
    `run_round` returns a function that undoes them, or None), at most `retries` times in all
    (default: `rounds`). Returns the other work measured in each kept round."""
    retries = rounds if retries is None else retries
    kept: list[float | None] = []
    r = 0
    while r < rounds:
        wait_quiet(threshold, timeout_s=timeout_s)
        with OtherWork() as other:
            undo = run_round(r)
        if other.cores is not None and other.cores > threshold and retries > 0 and undo is not None:
            undo()
            retries -= 1
            continue
        kept.append(other.cores)
        r += 1
    return kept
