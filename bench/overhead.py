"""Runtime overhead per action, with near-empty stages so bookkeeping is visible.

    python bench/overhead.py [--micro-batches 32] [--repeats 60]

The step's measured timeline says how long each action's own compute took. Playing
the same actions, in the same order, with those durations and free hand-offs
(`schedules.run_order`) gives the makespan of a runtime that costs nothing. The
pipeline's wall-clock step time minus that ideal, divided by the actions on the
critical device, is what mpedu's machinery (worker hand-offs, mailbox, timing,
transfers, splitting the batch, collecting the loss) adds per action.

The headline `us_per_action` is the worst run whose devices each have a core of
their own. A run with more virtual devices than cores is printed too, apart
(`us_per_action_oversubscribed`): its gaps also hold the time its threads wait
for a free core and for Python's interpreter lock, which grows with the threads
per core rather than with mpedu's bookkeeping.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, random_batch  # noqa: E402

from mpedu.devices import usable_cores  # noqa: E402
from mpedu.model import LSTMLM, LMConfig  # noqa: E402
from mpedu.pipeline import Pipeline  # noqa: E402
from mpedu.schedules import run_order  # noqa: E402


def overhead_per_action(pipe, batch, repeats: int) -> tuple[float, float, int]:
    """Median over steps of (wall time - ideal replay) / actions per device."""
    for _ in range(3):
        pipe.train_step(batch)
    samples, walls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tl = pipe.train_step(batch).timeline
        wall = time.perf_counter() - start
        took = {(e.device, e.kind, e.stage, e.mb, e.chunk): e.duration for e in tl.compute()}
        names = tl.devices
        ideal = max(end for *_, end in run_order(
            pipe.schedule, cost=lambda d, a: took[names[d], a.kind, a.stage, a.mb, a.chunk]))
        per_device = len(tl.compute()) / len(names)
        samples.append((wall - ideal) / per_device)
        walls.append(wall)
    return statistics.median(samples), statistics.median(walls), len(tl.compute())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=60)   # steps of ~30 ms: a second per run
    args = parser.parse_args(argv)
    m = args.micro_batches
    model = LSTMLM(8, LMConfig(embed_size=1, hidden_size=1, num_layers=2))   # width 1, T = 1: near-empty
    batch = random_batch(8, T=1, B=m)
    cores = len(usable_cores())
    rows = []
    for schedule, placement in [("gpipe", 1), ("gpipe", 2), ("1f1b", 2), ("zb1", 2), ("gpipe", 4)]:
        with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
            per, wall, actions = overhead_per_action(pipe, batch, args.repeats)
            rows.append((f"{schedule}, {len(pipe.devices)} device(s)", actions, wall, per, len(pipe.devices) > cores))
    print(f"near-empty stages (width 1, T=1), m={m}; overhead = (step wall time - ideal replay) / actions per device")
    print(f"{'run':<24}{'actions':>9}{'step (ms)':>11}{'us/action':>11}")
    for name, actions, wall, per, shared in rows:
        note = f"  (more devices than the {cores} cores)" if shared else ""
        print(f"{name:<24}{actions:>9}{wall * 1e3:>11.2f}{per * 1e6:>11.1f}{note}")
    own = [r[3] for r in rows if not r[4]]
    shared = [r[3] for r in rows if r[4]]
    finish("overhead", {"benchmark": "overhead", "micro_batches": m, "cores": cores,
                        "us_per_action": max(own) * 1e6,
                        "us_per_action_oversubscribed": max(shared) * 1e6 if shared else None,
                        "runs": {r[0]: r[3] * 1e6 for r in rows}, "machine": machine()})


if __name__ == "__main__":
    main()
