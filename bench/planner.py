"""The planner on `mxnet8`: the Pareto front on 2 and 4 virtual devices under a memory cap that excludes
the fastest plan, and its top candidates run for real (targets on a quiet 2-core machine, 2 devices:
Kendall tau >= 0.8, worst error <= 10%, planning under 1 s).

    python bench/planner.py [--steps 15] [--top 5] [--schedules all|default]

The search takes every schedule the planner knows (`all`): the explorer's six, and the V-shapes (ZB-V,
DualPipeV, V-Half, V-Min on every V split) and zero bubble under every memory cap from 1 to 2p micro-batches per
device (`zb_cap1` ...), searched only when asked for; `default` searches the six alone. The JSON names the
candidates of each kind (`candidates_by_schedule`) and which of them reach the front.

One profile (a CostCurve: every micro-batch width the search tries, and the time-chunk lengths the
wavefront schedule runs) serves both device counts. The cap is the geometric middle of the uncapped
front's largest and smallest peaks, so the fastest plan does not fit. `seconds_to_plan` is the
search alone (median of 3), the profile is timed apart. The top candidates run in turn, one step
each per round (the order reversed every other round), so drifting load falls on all of them alike;
each round waits for a quiet moment and runs again if other processes took more than a tenth of a
core meanwhile (bench/quiet.py); each device count's predictions use
the cores the virtual devices got at once (cores.measure_cores), as bench/fidelity.py does.
On a shared machine the load drifts between the profile and the runs: after each device count's runs
the layers are profiled again, and the measured plans predicted again from the median of the profiles
so far and the mean of the cores measured before and after. `kendall_tau` and `worst_error` are those;
the plan-time profile's are kept beside them (`..._plan_profile`). The top plans can lie within a few
percent of each other, where a ranking is noise: plans spread along the front (Plans.spread) are
measured and ranked too (`kendall_tau_spread`), and the top plans' tau is also given over the pairs the
rounds tell apart (one plan faster in at least 80% of the rounds: `kendall_tau_told_apart`).
Last, an epoch of mixed buckets (T = 5, 10, 20) is predicted with one plan per bucket length
(plan_buckets) against the longest bucket's plan for all (predictions only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, random_batch  # noqa: E402
from quiet import quiet_rounds, wait_quiet  # noqa: E402

from mpedu.lm import LSTMLM  # noqa: E402
from mpedu.predict import (SCHEDULES, CostCurve, kendall_tau, measure_cores, plan, planner,  # noqa: E402
    plan_buckets, predict, predict_epoch, profile_curve, tau_apart)

VOCAB, T, B = 10_000, 20, 16          # smaller than the how-to's batch: a step here takes ~0.2 s on 2 cores
DEVICES = (2, 4)



def _kind(schedule: str) -> str:
    """A candidate's schedule family: zb_cap3 counts as zb_cap."""
    return "zb_cap" if schedule.startswith("zb_cap") else schedule

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="measured steps per candidate (median)")
    parser.add_argument("--top", type=int, default=5, help="candidates to run for real")
    parser.add_argument("--schedules", choices=("all", "default"), default="all",
                        help="all: the V-shapes and capped zero bubble too; default: the explorer's six")
    args = parser.parse_args(argv)
    searched = SCHEDULES + (planner.EXTRA_SCHEDULES if args.schedules == "all" else ())
    torch.manual_seed(0)
    model = LSTMLM.from_config("mxnet8", VOCAB, dropout=0.0)
    batch = random_batch(VOCAB, T, B)
    widths = [b for b in range(1, B + 1) if B % b == 0]
    def profile_all():
        wait_quiet()
        return profile_curve(model, batch, "vgpu:0", widths=widths, lengths=[T // 2, T // 4], length_widths=widths,
                             warmup=1, repeats=3)

    start = time.perf_counter()
    curve = profile_all()
    profile_s = time.perf_counter() - start
    curves = [curve]
    print(f"mxnet8 (embed 200, 8 LSTM layers of 400, vocab {VOCAB}, dropout 0); batch T={T} B={B}; "
          f"profiled {len(curve.widths) + len(curve.lengths)} shapes in {profile_s:.1f} s")
    loads, results, other = [os.getloadavg()[0]], {}, []

    def quiet(one_round, count):
        """Each round after a quiet moment; one that other processes disturbed runs again (bench/quiet.py)."""
        other.extend(c for c in quiet_rounds(one_round, count) if c is not None)
    for p in DEVICES:
        cores = measure_cores(p, repeats=3, model=model, batch=batch.split(B // widths[0])[0])
        free = plan(model, batch, p, costs=curve, cores=cores, schedules=searched)
        cap = int((free.front[0].peak_bytes * free.front[-1].peak_bytes) ** 0.5)
        times = []
        for _ in range(3):
            capped = plan(model, batch, p, costs=curve, cores=cores, memory_cap=cap, schedules=searched)
            times.append(capped.seconds)
        print(f"\n{p} virtual devices ({cores:.2f} cores' worth of work at once)")
        print(f"uncapped, the fastest: {free.best}")
        print(capped)
        measured = capped.measure(model, batch, top=args.top, steps=args.steps, rounds=quiet)
        loads.append(os.getloadavg()[0])
        print(measured)
        # The load drifts over minutes: predict the measured plans again from the median of the profiles
        # taken so far (before and after the runs) and the cores measured before and after.
        curves.append(profile_all())
        after = measure_cores(p, repeats=3, model=model, batch=batch.split(B // widths[0])[0])
        steady, both = CostCurve.median(curves), statistics.mean([cores, after])
        again = [predict(c, steady, T, B, cores=both) for c in measured_plans(capped, measured)]
        rows = [dict(r, predicted_s=t, error=t / r["measured_s"] - 1) for r, t in zip(measured.rows, again)]
        tau = kendall_tau(again, [r["measured_s"] for r in rows])
        tau_told, apart, pairs = tau_apart(again, [r["steps_s"] for r in rows])
        worst = max(abs(r["error"]) for r in rows)
        # the top 5 may lie within a few percent of each other: rank 5 plans spread along the front too
        spread = capped.measure(model, batch, candidates=capped.spread(args.top), steps=args.steps, rounds=quiet)
        print("plans spread along the front that fits:\n" + spread.table())
        print(f"predicted again from the median of {len(curves)} profiles and {both:.2f} cores (before "
              f"{cores:.2f}, after {after:.2f}): " + ", ".join(f"{r['error']:+.1%}" for r in rows)
              + f"; Kendall tau {tau:+.2f} ({tau_told:+.2f} over the {apart} of {pairs} pairs the rounds tell "
              f"apart), worst error {worst:.1%}")
        kinds = {}
        for c in capped.simulated:
            kinds[_kind(c.schedule)] = kinds.get(_kind(c.schedule), 0) + 1
        on_front = sorted({_kind(c.schedule) for c in capped.front})
        print(f"candidates simulated by schedule: {kinds}; on the front: {', '.join(on_front)}")
        results[p] = {"devices": p, "cores": cores, "memory_cap": cap, "seconds_to_plan": statistics.median(times),
                      "schedules_searched": list(searched), "candidates_by_schedule": kinds,
                      "schedules_on_front": on_front,
                      "searched": capped.searched, "simulated": len(capped.simulated),
                      "fastest_uncapped": {"plan": free.best.label, "placement": str(free.best.placement),
                                           "step_s": free.best.step_s, "peak_bytes": free.best.peak_bytes},
                      "best": {"plan": capped.best.label, "placement": str(capped.best.placement),
                               "step_s": capped.best.step_s, "peak_bytes": capped.best.peak_bytes},
                      "front": [{"plan": c.label, "placement": str(c.placement), "step_s": c.step_s,
                                 "peak_bytes": c.peak_bytes, "fits": c.fits} for c in capped.front],
                      "measured": measured.rows, "kendall_tau_plan_profile": measured.kendall_tau,
                      "worst_error_plan_profile": measured.worst_error, "cores_after": after,
                      "repredicted": rows, "kendall_tau": tau, "worst_error": worst,
                      "kendall_tau_told_apart": tau_told, "pairs_told_apart": [apart, pairs],
                      "spread": spread.rows, "kendall_tau_spread": spread.kendall_tau,
                      "worst_error_spread": spread.worst_error}
    # Buckets: the same cap, one plan per bucket length against the 20-step bucket's plan for all (predicted).
    shapes = [(T // 4, B)] * 6 + [(T // 2, B)] * 10 + [(T, B)] * 4
    cap2 = results[2]["memory_cap"]
    per_bucket = plan_buckets(model, shapes, 2, curve, memory_cap=cap2, cores=results[2]["cores"])
    one_for_all = {L: per_bucket[T] for L in per_bucket}
    mixed = predict_epoch(shapes, curve, per_bucket, cores=results[2]["cores"])
    single = predict_epoch(shapes, curve, one_for_all, cores=results[2]["cores"])
    print("\nan epoch of mixed buckets on 2 devices under the same cap (predicted): one plan per bucket length")
    print(mixed)
    print(f"the T={T} plan for every bucket: {single.total_s:.2f} s; per bucket: {mixed.total_s:.2f} s "
          f"({single.total_s / mixed.total_s:.2f}x)")
    buckets = {"epoch_s_per_bucket_plans": mixed.total_s, "epoch_s_one_plan": single.total_s,
               "plans": {str(L): {"plan": c.label, "placement": str(c.placement), "step_s": c.step_s}
                         for L, c in per_bucket.items()}}
    two = results[2]
    print(f"\n2 devices: Kendall tau {two['kendall_tau']:+.2f} (top {args.top}; {two['kendall_tau_told_apart']:+.2f} over "
          f"the {two['pairs_told_apart'][0]} of {two['pairs_told_apart'][1]} pairs the rounds tell apart; "
          f"{two['kendall_tau_spread']:+.2f} "
          f"for {args.top} plans spread along the front; target >= 0.8), worst error "
          f"{two['worst_error']:.1%} (target <= 10%), planning {two['seconds_to_plan'] * 1e3:.0f} ms (target < 1 s); "
          f"4 devices: tau {results[4]['kendall_tau']:+.2f}, worst error {results[4]['worst_error']:.1%}, "
          f"planning {results[4]['seconds_to_plan'] * 1e3:.0f} ms (4 devices share {os.cpu_count()} cores); "
          f"load average {min(loads):.1f}-{max(loads):.1f}; other processes used "
          + (f"{min(other):.2f}-{max(other):.2f} cores" if other else "(unknown)") + " during the rounds kept")
    finish("planner", {"benchmark": "planner", "model": "mxnet8", "vocab": VOCAB, "T": T, "B": B,
                       "profile_seconds": profile_s, "kendall_tau": two["kendall_tau"],
                       "kendall_tau_told_apart": two["kendall_tau_told_apart"],
                       "worst_error": two["worst_error"], "seconds_to_plan": two["seconds_to_plan"],
                       "targets_met": two["kendall_tau"] >= 0.8 and two["worst_error"] <= 0.10
                       and two["seconds_to_plan"] < 1.0,
                       "load_average": [min(loads), max(loads)], "other_processes_cores": other,
                       "steps": args.steps, "by_devices": results, "buckets": buckets,
                       "machine": machine()})


def measured_plans(plans, measured):
    """The candidates behind a Measurement's rows, in its order."""
    by_key = {(c.label, str(c.placement)): c for c in plans.simulated + plans.front}
    return [by_key[r["label"], r["placement"]] for r in measured.rows]


if __name__ == "__main__":
    main()
