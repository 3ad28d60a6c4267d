"""How well the simulator predicts measured pipeline steps on virtual devices (targets: within 15% on
every case; within 5% on a quiet machine where each device has a core of its own).

    python bench/fidelity.py [--rounds 21]

Profile each layer alone, single-threaded, on vgpu:0, at the full length and at two shorter ones (a
CostCurve); run balanced, unbalanced and non-contiguous placements under GPipe and 1F1B, then the
balanced one under ZB-H1, wavefront (time chunks), recomputation (all, all-but-last) and a shorter
bucket than any profiled, and 3 devices (which share the 2 cores); calibrate the link from the
measured hand-offs; compare the predicted makespan with the median measured one. Wavefront chunks
are charged what a chunk-length profile costs (CostCurve.at(T, b, chunks)); the bucket is read off
the curve between its profiled lengths.
Each virtual device is one worker thread; how many of them the CPU runs at full speed at once
(about 1.8 of 2 on an idle 2-core machine, nearer 1 when other work takes the cores) is measured
alongside and given to the simulator as `cores`.
Rounds interleave profiling, that measurement and every case, so load that drifts
over minutes falls on all of them alike; each round waits for a quiet moment and runs again if
other processes took more than a tenth of a core meanwhile (bench/quiet.py). A run in which the two
cores' relative speed moved more than 1.2x between rounds (a VM's neighbours) cannot judge the 5%
target, and says so (`within_5_percent_core_per_device` null). A recomputed micro-batch's
forward is charged twice: its first run (autograd on, keeping nothing) and R before its backward.
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
from common import finish, machine, pinned_workers, random_batch  # noqa: E402
from quiet import quiet_rounds  # noqa: E402

from mpedu.predict import CostCurve, Costs, balance_by_time, fit_link, measure_cores, profile, simulate  # noqa: E402
from mpedu.runtime import Link  # noqa: E402
from mpedu.lm import LSTMLM, LMConfig  # noqa: E402
from mpedu.core import Pipeline, Placement  # noqa: E402

VOCAB, T, B, M = 2000, 35, 64, 8
BUCKET = 20                 # a shorter bucket than the batch, predicted from the curve between profiled lengths
CHUNKS = 5                  # wavefront time chunks: 7 steps each
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=4)
DEVICES = ["vgpu:0", "vgpu:1"]
STEADY = 1.2                # the most the cores' relative speed may move between rounds for the 5% target to be judged
DEVICES3 = ["vgpu:0", "vgpu:1", "vgpu:2"]


def _profiles(model, batch, warmup, repeats):
    """One round's profiles: the full batch's micro-batch, then the chunk length and a shorter one, same width."""
    full = profile(model, batch, DEVICES[0], micro_batches=M, warmup=warmup, repeats=repeats)
    short = [profile(model, batch.steps(0, L), DEVICES[0], micro_batches=M, warmup=warmup, repeats=repeats)
             for L in (T // CHUNKS, 14)]
    return [full] + short


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 21: with 9 the medians still moved 2-3% from run to run (worst case 3.7-7.7% over 15 quiet runs, 5% met in 6);
    # with 21 every case's median is steadier (worst 3.4-5.5% over 11 runs, 5% met in 9), at about 2 minutes
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--retries", type=int, default=None,
                        help="rounds run again when other work came in the middle (default: --rounds)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LSTMLM(VOCAB, CONFIG)
    batch = random_batch(VOCAB, T, B)
    bucket = random_batch(VOCAB, T, B, seed=1).steps(0, BUCKET)
    micro = batch.split(M)[0]
    first = _profiles(model, batch, warmup=2, repeats=3)
    balanced = balance_by_time(model, batch, DEVICES, micro_batches=M, costs=first[0])
    placements = {
        "balanced": balanced,
        "unbalanced": Placement.parse("embed:vgpu0 | lstm0-3,decode:vgpu1", model),
        "non-contiguous": Placement.parse("embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | lstm3,decode:vgpu1",
                                          model),
        "balanced-3": balance_by_time(model, batch, DEVICES3, micro_batches=M, costs=first[0]),
    }
    # (name, placement, schedule, Pipeline options, the batch it runs)
    cases = [(f"{pname} {schedule}", pname, schedule, {}, "batch")
             for pname in ("balanced", "unbalanced", "non-contiguous") for schedule in ("gpipe", "1f1b")]
    cases += [("balanced zb1", "balanced", "zb1", {}, "batch"),
              (f"balanced wavefront c={CHUNKS}", "balanced", "wavefront", {"chunks": CHUNKS}, "batch"),
              ("balanced 1f1b recompute=all", "balanced", "1f1b", {"recompute": "all"}, "batch"),
              ("balanced gpipe recompute=all-but-last", "balanced", "gpipe", {"recompute": "all-but-last"}, "batch"),
              (f"balanced gpipe bucket T={BUCKET}", "balanced", "gpipe", {}, "bucket"),
              (f"balanced 1f1b bucket T={BUCKET}", "balanced", "1f1b", {}, "bucket"),
              ("3 devices gpipe", "balanced-3", "gpipe", {}, "batch"),
              ("3 devices 1f1b", "balanced-3", "1f1b", {}, "batch")]
    data = {"batch": batch, "bucket": bucket}
    pipes = {case[0]: Pipeline(model, placements[case[1]], case[2], M, **case[3]) for case in cases}
    for name, *_, which in cases:
        pipes[name].train_step(data[which])             # warm-up
    # Rounds: the profiles, then one step of every case. Load from other work drifts over
    # minutes; interleaving spreads it evenly over the profiles and all cases.
    # Each round waits for a quiet moment and is run again if other processes took more than a tenth
    # of a core meanwhile (bench/quiet.py): the prediction is for cores this benchmark has to itself.
    profiles, measured = [first], {case[0]: [] for case in cases}
    loads, cores, cores3, speeds = [], [], [], []
    probe = _CoreSpeeds()
    faults = {case[0]: [] for case in cases}         # minor page faults per step (fresh memory the kernel zeroes)
    lists = [loads, cores, cores3, speeds, profiles] + list(measured.values()) + list(faults.values())

    def one_round(r):
        loads.append(os.getloadavg()[0])
        cores.append(measure_cores(len(DEVICES), repeats=3, model=model, batch=micro))
        cores3.append(measure_cores(len(DEVICES3), repeats=3, model=model, batch=micro))
        speeds.append(probe.ratio())
        profiles.append(_profiles(model, batch, warmup=1, repeats=1))
        for name, *_, which in cases:
            model.zero_grad()
            before = _minor_faults()
            measured[name].append(pipes[name].train_step(data[which]).timeline)
            faults[name].append(_minor_faults() - before)
        return lambda: [values.pop() for values in lists]

    other = quiet_rounds(one_round, args.rounds, retries=args.retries)
    probe.close()
    costs = [Costs.median([run[k] for run in profiles]) for k in range(len(first))]
    curve = CostCurve([costs[0]], costs[1:])
    link = Link(statistics.median(fit_link(tl).latency_s for tls in measured.values() for tl in tls))
    share, share3 = statistics.median(cores), statistics.median(cores3)
    rows = []
    for name, pname, _, options, which in cases:
        pipe, tls = pipes[name], sorted(measured[name], key=lambda tl: tl.makespan)
        tl = tls[len(tls) // 2]                      # the median step
        p = len(pipe.devices)
        length = data[which].inputs.shape[0]
        predicted = simulate(pipe, curve.at(length, B // M, pipe.chunks), link=link, cores=share if p == 2 else share3)
        busy_m = sum(tl.busy(d) for d in tl.devices)
        busy_p = sum(predicted.busy(d) for d in predicted.devices)
        rows.append({"case": name, "placement": pname, "layout": str(pipe.placement), "schedule": pipe.schedule.name,
                     "devices": p, "core_per_device": p <= os.cpu_count(), "T": length, "chunks": pipe.chunks,
                     "recompute": options.get("recompute"),
                     "measured_ms": tl.makespan * 1e3, "predicted_ms": predicted.makespan * 1e3,
                     "error": predicted.makespan / tl.makespan - 1, "busy_error": busy_p / busy_m - 1,
                     "bubble_measured": tl.bubble_fraction, "bubble_predicted": predicted.bubble_fraction,
                     "page_faults_per_step": statistics.median(faults[name])})
        pipe.close()
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, vocab {VOCAB}; "
          f"batch T={T} B={B}, m={M}; bucket T={BUCKET}; 2 virtual devices (one core each) and 3 (sharing "
          f"{os.cpu_count()} cores)")
    print(costs[0].table())
    print(f"link calibrated from the measured hand-offs: latency {link.latency_s * 1e6:.0f} us, "
          "bandwidth " + ("unlimited (no copy between virtual devices)" if link.bandwidth_Bps == float("inf")
                          else f"{link.bandwidth_Bps / 1e9:.2f} GB/s"))
    print(f"the virtual devices ran {share:.2f} (2 devices) and {share3:.2f} (3 devices) cores' worth of work at "
          f"once (measure_cores, median of {args.rounds}: {', '.join(f'{c:.2f}' for c in cores)})")
    print(f"{'case':<40}{'measured ms':>12}{'predicted ms':>13}{'error':>8}{'busy err':>9}{'bubble m/p':>13}"
          f"{'faults':>8}")
    for r in rows:
        print(f"{r['case']:<40}{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}"
              f"{r['error']:>+8.1%}{r['busy_error']:>+9.1%}   "
              f"{r['bubble_measured']:>4.0%} / {r['bubble_predicted']:.0%}{r['page_faults_per_step']:>8.0f}")
    for pname, placement in placements.items():
        print(f"  {pname}: {placement}")
    print("busy err: the same comparison for compute time summed over the devices (the cost model without the "
          "schedule); bubble m/p: measured / predicted; faults: minor page faults per step (median)")
    worst = max(abs(r["error"]) for r in rows)
    own = [abs(r["error"]) for r in rows if r["core_per_device"]]
    worst_own = max(own) if own else float("nan")
    print(f"vgpu:1's core against vgpu:0's (the same LSTM layer alone on each, per round; not given to the "
          f"simulator): {min(speeds):.2f}-{max(speeds):.2f}x the speed, median {statistics.median(speeds):.2f}")
    # How far the cores' relative speed moved between rounds (90th over 10th percentile of the per-round ratio). A
    # hypervisor's neighbours can slow one core by half for minutes; a run whose hardware moved more than the 5%
    # being judged cannot judge it (as a claim with too few free cores CANNOT SHOW NOW): steady runs read 1.03,
    # the drifting ones that missed 1.44-1.87 (docs/measurements.md).
    tenths = statistics.quantiles(speeds, n=10) if len(speeds) > 1 else [1.0, 1.0]
    drift = tenths[-1] / tenths[0]
    steady = drift <= STEADY
    if not steady:
        print(f"note: the cores' relative speed moved {drift:.2f}x between rounds (10th to 90th percentile; "
              f"steady: at most {STEADY:g}), more than the 5% being judged: this run cannot judge that target")
    if share < 1.5:
        print(f"note: the two workers ran only {share:.2f} cores' worth at once (other work on the machine); "
              "what they get swings within seconds, more than the profile can follow")
    verdict = ("met" if worst_own <= 0.05 else "not met") if steady else "cannot judge: the cores drifted"
    print(f"worst error {worst:.1%} over all cases (target 15%); {worst_own:.1%} where each device has a core "
          f"(target 5% on a quiet machine: {verdict}); error = predicted / measured - 1, median of {args.rounds} "
          f"steps; "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores; other processes used "
          f"{_cores_text(other)} cores during the rounds kept")
    finish("fidelity", {"benchmark": "fidelity", "micro_batches": M, "link_latency_s": link.latency_s, "cores": share,
                        "cores_3_devices": share3, "core_speed_ratio": speeds, "rounds": args.rounds, "load_average": [min(loads), max(loads)],
                        "other_processes_cores": other,
                        "rows": rows, "worst_error": worst, "within_15_percent": worst <= 0.15,
                        "worst_error_core_per_device": worst_own, "core_speed_drift": drift, "cores_steady": steady,
                        "within_5_percent_core_per_device": (worst_own <= 0.05) if steady else None,
                        "machine": machine()})


class _CoreSpeeds:
    """How fast vgpu:1's core runs against vgpu:0's, now: one LSTM layer's forward and backward at the
    micro-batch's shape, timed alone on each pinned worker in turn (0 1 1 0). On a shared host a core's speed
    drifts with what its neighbours run; with a core per device, both cores count."""

    def __init__(self):
        self.workers = pinned_workers(DEVICES)
        self.lstm, self.x = torch.nn.LSTM(CONFIG.hidden_size, CONFIG.hidden_size), torch.randn(T, B // M, CONFIG.hidden_size)

    def _seconds(self, k: int) -> float:
        def run():
            self.lstm(self.x)[0].sum().backward()                       # warm
            start = time.perf_counter()
            for _ in range(3):
                self.lstm(self.x)[0].sum().backward()
            return time.perf_counter() - start
        return self.workers[k].submit(run).result()

    def ratio(self) -> float:
        """vgpu:1's speed / vgpu:0's (above 1: vgpu:1 runs faster)."""
        t = [self._seconds(k) for k in (0, 1, 1, 0)]
        return (t[0] + t[3]) / (t[1] + t[2])

    def close(self):
        for w in self.workers:
            w.stop()


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cores_text(other) -> str:
    known = [c for c in other if c is not None]
    return f"{min(known):.2f}-{max(known):.2f}" if known else "(unknown: not Linux)"


if __name__ == "__main__":
    main()
