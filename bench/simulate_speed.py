"""How long the simulator takes to predict a step of 8 devices x 32 micro-batches (target: under 50 ms).

    python bench/simulate_speed.py [--repeats 20]

Times `simulate` on an already-built schedule (the question a notebook slider asks
again and again), and separately building + validating the schedule with
schedules.make, whose deadlock check plays the schedule with run_order.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine  # noqa: E402

from mpedu.predict import StageCost, simulate  # noqa: E402
from mpedu.core import make, run_order  # noqa: E402

P, M = 8, 32
CASES = [("gpipe", list(range(P))), ("1f1b", list(range(P))), ("zb1", list(range(P))),
         ("interleaved", [s % P for s in range(2 * P)])]


def best_of(fn, repeats: int) -> float:
    """Fastest of `repeats` runs: other work on the machine only ever adds time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rows = []
    for name, stage_devices in CASES:
        stage = StageCost(0.010, output_bytes=286_720)        # 10 ms forward, a (35, 8, 256) activation
        schedule = make(name, stage_devices, M)
        actions = sum(len(row) for row in schedule.actions)
        t_sim = best_of(lambda: simulate(schedule, [stage] * len(stage_devices)), args.repeats)
        t_make = best_of(lambda: make(name, stage_devices, M), max(args.repeats // 4, 3))
        t_run_order = best_of(lambda: run_order(schedule), max(args.repeats // 4, 3))
        bubble = simulate(schedule, [stage] * len(stage_devices)).bubble_fraction
        rows.append({"schedule": name, "stages": len(stage_devices), "actions": actions, "simulate_ms": t_sim * 1e3,
                     "make_ms": t_make * 1e3, "run_order_ms": t_run_order * 1e3, "bubble": bubble})
    print(f"p={P} devices, m={M} micro-batches; fastest of {args.repeats} runs")
    print(f"{'schedule':<12}{'stages':>7}{'actions':>9}{'simulate ms':>13}{'make ms':>10}{'run_order ms':>14}"
          f"{'bubble':>8}")
    for r in rows:
        print(f"{r['schedule']:<12}{r['stages']:>7}{r['actions']:>9}{r['simulate_ms']:>13.2f}{r['make_ms']:>10.2f}"
              f"{r['run_order_ms']:>14.2f}{r['bubble']:>8.1%}")
    worst = max(r["simulate_ms"] for r in rows)
    print(f"slowest simulate: {worst:.2f} ms (target < 50 ms); make includes Schedule.validate's run_order")
    finish("simulate_speed", {"benchmark": "simulate_speed", "devices": P, "micro_batches": M, "rows": rows,
                              "worst_simulate_ms": worst, "under_50ms": worst < 50, "machine": machine()})


if __name__ == "__main__":
    main()
