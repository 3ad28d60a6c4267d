"""How well the simulator predicts measured pipeline steps on 2 virtual devices (target: within 15%).

    python bench/fidelity.py [--rounds 9]

Profile each layer alone, single-threaded, on vgpu:0; run balanced, unbalanced
and non-contiguous placements under GPipe and 1F1B; calibrate the link from the
measured hand-offs; compare the predicted makespan with the median measured one.
Each virtual device is one worker thread; how many of them the CPU runs at full
speed at once (about 1.8 of 2 on an idle 2-core machine, nearer 1 when other work
takes the cores) is measured alongside and given to the simulator as `cores`.
Rounds interleave profiling, that measurement and every case, so load that drifts
over minutes falls on all of them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, random_batch  # noqa: E402

from mpedu.balance import balance_by_time  # noqa: E402
from mpedu.model import LSTMLM, LMConfig  # noqa: E402
from mpedu.pipeline import Pipeline  # noqa: E402
from mpedu.placement import Placement  # noqa: E402
from mpedu.profile import Costs, measure_cores, profile  # noqa: E402
from mpedu.simulate import Link, simulate  # noqa: E402

VOCAB, T, B, M = 2000, 35, 64, 8
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=4)
DEVICES = ["vgpu:0", "vgpu:1"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LSTMLM(VOCAB, CONFIG)
    batch = random_batch(VOCAB, T, B)
    micro = batch.split(M)[0]
    first = profile(model, batch, DEVICES[0], micro_batches=M, warmup=2, repeats=3)
    placements = {
        "balanced": balance_by_time(model, batch, DEVICES, micro_batches=M, costs=first),
        "unbalanced": Placement.parse("embed:vgpu0 | lstm0-3,decode:vgpu1", model),
        "non-contiguous": Placement.parse("embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | lstm3,decode:vgpu1",
                                          model),
    }
    cases = [(pname, schedule) for pname in placements for schedule in ("gpipe", "1f1b")]
    pipes = {case: Pipeline(model, placements[case[0]], case[1], M) for case in cases}
    for pipe in pipes.values():
        pipe.train_step(batch)                      # warm-up
    # Rounds: a profile, then one step of every case. Load from other work drifts over
    # minutes; interleaving spreads it evenly over the profile and all cases.
    profiles, measured = [first], {case: [] for case in cases}
    loads, cores = [], []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        cores.append(measure_cores(len(DEVICES), repeats=1, model=model, batch=micro))
        profiles.append(profile(model, batch, DEVICES[0], micro_batches=M, warmup=1, repeats=1))
        for case in cases:
            model.zero_grad()
            measured[case].append(pipes[case].train_step(batch).timeline)
    costs = Costs.median(profiles)
    link = Link(statistics.median(Link.fit(tl).latency_s for tls in measured.values() for tl in tls))
    share = statistics.median(cores)
    rows = []
    for case in cases:
        pipe, tls = pipes[case], sorted(measured[case], key=lambda tl: tl.makespan)
        tl = tls[len(tls) // 2]                      # the median step
        predicted = simulate(pipe, costs, link=link, cores=share)
        busy_m = sum(tl.busy(d) for d in tl.devices)
        busy_p = sum(predicted.busy(d) for d in predicted.devices)
        rows.append({"placement": case[0], "layout": str(pipe.placement), "schedule": pipe.schedule.name,
                     "measured_ms": tl.makespan * 1e3, "predicted_ms": predicted.makespan * 1e3,
                     "error": predicted.makespan / tl.makespan - 1, "busy_error": busy_p / busy_m - 1,
                     "bubble_measured": tl.bubble_fraction, "bubble_predicted": predicted.bubble_fraction})
        pipe.close()
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, vocab {VOCAB}; "
          f"batch T={T} B={B}, m={M}; 2 virtual devices, one core each")
    print(costs.table())
    print(f"link calibrated from the measured hand-offs: latency {link.latency_s * 1e6:.0f} us, "
          "bandwidth " + ("unlimited (no copy between virtual devices)" if link.bandwidth_Bps == float("inf")
                          else f"{link.bandwidth_Bps / 1e9:.2f} GB/s"))
    print(f"the two virtual devices ran {share:.2f} cores' worth of work at once (measure_cores, median of "
          f"{args.rounds}: {', '.join(f'{c:.2f}' for c in cores)})")
    print(f"{'placement':<16}{'schedule':<13}{'measured ms':>12}{'predicted ms':>13}{'error':>8}{'busy err':>9}"
          f"{'bubble m/p':>13}")
    for r in rows:
        print(f"{r['placement']:<16}{r['schedule']:<13}{r['measured_ms']:>12.1f}{r['predicted_ms']:>13.1f}"
              f"{r['error']:>+8.1%}{r['busy_error']:>+9.1%}   "
              f"{r['bubble_measured']:>4.0%} / {r['bubble_predicted']:.0%}")
    for pname, placement in placements.items():
        print(f"  {pname}: {placement}")
    print("busy err: the same comparison for compute time summed over the devices (the cost model without the "
          "schedule); bubble m/p: measured / predicted")
    worst = max(abs(r["error"]) for r in rows)
    if share < 1.5:
        print(f"note: the two workers ran only {share:.2f} cores' worth at once (other work on the machine); "
              "what they get swings within seconds, more than the profile can follow")
    print(f"worst error {worst:.1%} (target 15%); error = predicted / measured - 1, median of {args.rounds} steps; "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    finish("fidelity", {"benchmark": "fidelity", "micro_batches": M, "link_latency_s": link.latency_s, "cores": share,
                        "rounds": args.rounds, "load_average": [min(loads), max(loads)],
                        "rows": rows, "worst_error": worst, "within_15_percent": worst <= 0.15,
                        "machine": machine()})


if __name__ == "__main__":
    main()
