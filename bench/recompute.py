"""Activation recomputation per schedule: memory saved and time paid, measured and predicted.

    python bench/recompute.py [--repeats 5] [--schedules gpipe 1f1b ...]

Two virtual devices, one model, one batch. For every schedule, three pipelines: keep
activations (None), recompute every micro-batch ("all"), and every one but the last
("all-but-last"). Measured: the activation peak of the fuller device (the one a memory
cap binds; the JSON has every device's), as the step's
saved-tensor hooks count it (the timeline's memory), and the step's wall time, timed in
turn round after round so a drifting machine slows every mode alike. Predicted: the
same peak from mpedu.predict.footprint on profiled per-layer bytes, and the step from the
simulator (a recomputed B costs B + F), with the machine's usable cores.

Times taken on a machine shared with other work are noisy: the JSON says how many
cores were usable, and the medians of paired rounds are what to compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, paired_rounds, random_batch  # noqa: E402

from mpedu.runtime import usable_cores  # noqa: E402
from mpedu.predict import device_footprints, profile, simulate  # noqa: E402
from mpedu.lm import LSTMLM, LMConfig  # noqa: E402
from mpedu.core import Pipeline  # noqa: E402

VOCAB, T, B, M = 2000, 32, 32, 4
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=3, dropout=0.2)
TWO = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
FOUR = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu0 | lstm2,decode:vgpu1"     # interleaved: two stages a device
# schedule -> (placement, micro-batches, time chunks)
CASES = {"naive": (TWO, M, 1), "gpipe": (TWO, M, 1), "1f1b": (TWO, M, 1), "interleaved": (FOUR, M, 1),
         "zb1": (TWO, M, 1), "wavefront": (TWO, 1, 4)}
MODES = (None, "all", "all-but-last")


def run_case(model, batch, schedule, placement, m, chunks, repeats, cores, costs) -> dict:
    # a time chunk saves more than 1/chunks of the sequence: its bytes are profiled at its own length
    chunk_costs = (profile(model, batch.steps(0, T // chunks), micro_batches=m, warmup=0, repeats=1)
                   if chunks > 1 else None)
    pipes = {mode: Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks, recompute=mode)
             for mode in MODES}
    try:
        peaks, predicted, per_device, predicted_per_device = {}, {}, {}, {}
        for mode, pipe in pipes.items():
            model.zero_grad(set_to_none=True)
            timeline = pipe.train_step(batch).timeline
            per_device[mode] = {d: timeline.peak_memory(d) for d in timeline.devices}
            peaks[mode] = max(per_device[mode].values())
            footprints = device_footprints(costs[m], pipe.placement, pipe.schedule, mode, chunk_costs=chunk_costs)
            predicted_per_device[mode] = {f.device: f.activations for f in footprints}
            predicted[mode] = (max(f.activations for f in footprints),
                               simulate(pipe, costs[m], cores=cores).makespan)

        def stepper(pipe):
            def step():
                model.zero_grad(set_to_none=True)
                pipe.train_step(batch)
            return step

        rounds = paired_rounds({str(mode): stepper(p) for mode, p in pipes.items()}, repeats)
    finally:
        for pipe in pipes.values():
            pipe.close()
    keep = str(None)
    out = {"placement": placement, "micro_batches": m, "chunks": chunks, "modes": {}}
    for mode in MODES:
        key = str(mode)
        wall = statistics.median(rounds[key])
        paid = statistics.median(a / b for a, b in zip(rounds[key], rounds[keep]))
        pred_peak, pred_step = predicted[mode]
        out["modes"][key] = {
            "measured_peak_bytes": peaks[mode], "predicted_peak_bytes": pred_peak,
            "peak_error": pred_peak / peaks[mode] - 1,
            "measured_peak_per_device": per_device[mode], "predicted_peak_per_device": predicted_per_device[mode],
            "measured_step_s": wall, "predicted_step_s": pred_step,
            "memory_saved_measured": 1 - peaks[mode] / peaks[None],
            "memory_saved_predicted": 1 - pred_peak / predicted[None][0],
            "time_paid_measured": paid - 1,
            "time_paid_predicted": pred_step / predicted[None][1] - 1}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LSTMLM(VOCAB, CONFIG)
    batch = random_batch(VOCAB, T, B)
    cores = len(usable_cores())
    # per-layer costs of one micro-batch, once per micro-batch size (the simulator and the memory model share them)
    costs = {m: profile(model, batch, micro_batches=m, warmup=1, repeats=3) for m in {c[1] for c in CASES.values()}}
    results = {}
    for schedule in args.schedules:
        placement, m, chunks = CASES[schedule]
        results[schedule] = run_case(model, batch, schedule, placement, m, chunks, args.repeats, cores, costs)
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, vocab {VOCAB}, "
          f"dropout {CONFIG.dropout}; batch T={T} B={B}; {cores} usable cores (timing on a shared machine is noisy)")
    print("activation peak of the fuller device (MB, measured by the step's hooks, predicted by mpedu.predict.footprint), "
          "memory saved; step time, time paid")
    print(f"{'schedule':<12}{'recompute':<14}{'peak MB':>9}{'pred MB':>9}{'saved':>8}{'pred':>7}"
          f"{'step ms':>9}{'pred ms':>9}{'paid':>7}{'pred':>7}")
    for schedule, r in results.items():
        for mode, x in r["modes"].items():
            mode = {"None": "keep"}.get(mode, mode)
            print(f"{schedule:<12}{mode:<14}{x['measured_peak_bytes'] / 1e6:>9.2f}"
                  f"{x['predicted_peak_bytes'] / 1e6:>9.2f}"
                  f"{x['memory_saved_measured']:>8.0%}{x['memory_saved_predicted']:>7.0%}"
                  f"{x['measured_step_s'] * 1e3:>9.1f}{x['predicted_step_s'] * 1e3:>9.1f}"
                  f"{x['time_paid_measured']:>+7.0%}{x['time_paid_predicted']:>+7.0%}")
    worst_peak = max(abs(x["peak_error"]) for r in results.values() for x in r["modes"].values())
    finish("recompute", {"machine": machine(), "usable_cores": cores, "repeats": args.repeats,
                         "load_average_1min": os.getloadavg()[0],    # above the core count: the timings are busy
                         "model": {"vocab": VOCAB, **CONFIG.to_dict()}, "batch": [T, B],
                         "worst_peak_error": worst_peak, "schedules": results,
                         "note": "peaks: the step's saved-tensor hooks (exact, no timing noise); times: medians of "
                                 "paired rounds on the machine as it was (shared machines are noisy)"})


if __name__ == "__main__":
    main()
