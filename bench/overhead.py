"""Runtime overhead per action, with near-empty stages so bookkeeping is visible.

    python bench/overhead.py [--micro-batches 32] [--repeats 30] [--rounds 5]

The step's measured timeline says how long each action's own compute took. Playing
the same actions, in the same order, with those durations and free hand-offs
(`schedules.run_order`) gives the makespan of a runtime that costs nothing. The
pipeline's wall-clock step time minus that ideal, divided by the actions on the
critical device, is what mpedu's machinery (worker hand-offs, mailbox, timing,
transfers, splitting the batch, collecting the loss) adds per action.

The headline `us_per_action` is the worst schedule whose devices each have a core of
their own, each schedule's figure the median over `--rounds` rounds run in turn (every
round builds every pipeline afresh: new worker threads). Two threads' overhead on this
VM comes in phases: for seconds at a time the same 1F1B run takes ~25-30 us per action
instead of ~17, its actions' own times swelling alike, while one device's run beside it
does not change (cross-core traffic of two threads: hand-overs of the interpreter lock,
reference counts of shared objects). Rounds in turn let one phase touch every schedule
alike, and the median keeps it from being the headline; each round's figures are printed.
Beside mpedu's 1F1B, the floor under the two-device figures (`floor_us_per_action`): the same
layers in the same 1F1B order on two pinned workers, hand-rolled with nothing of mpedu's
(no stages, mailbox keys, timeline, dropout positions; a hand-off is a dict polled with the
Mailbox's naps), timed and replayed the same way. It is what two Python threads handing
near-empty work back and forth cost on this machine at that moment, mostly hand-overs of the
interpreter lock; in this VM's slow phases it rises from ~8-10 to ~18-20 us itself, and mpedu's
figures with it. Its steps are taken in turn with mpedu's 1F1B steps (mpedu, floor, floor at 10 us,
mpedu, ...), so that each pair sees the same seconds of the VM: timed a round apart, a round's
difference moved from -6 to 30 us within one run. `over_floor_us_per_action` is mpedu's 1F1B minus
the floor, round by round (each side the median of its steps in the round).
mpedu's step differs from the floor's harness in two ways it chose (mpedu.runtime.workers): the caller's thread
plays the first device (CallerThread: two thread wake-ups a step fewer), and during a step the interpreter
lock changes hands after 10 us instead of 5 ms (QuickSwitching: a receiver no longer waits for the sender's
next long kernel). So the floor is also timed with that switch interval (`floor_quick_switch_us_per_action`,
and mpedu's 1F1B over it, `over_quick_floor_us_per_action`): what the interval alone gives two bare threads.
A run with more virtual devices than cores is printed too, apart
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, pinned_workers, random_batch  # noqa: E402

from mpedu.runtime import STEP_SWITCH_S, stop_workers, usable_cores  # noqa: E402
from mpedu.core import Pipeline, POLL_NAP_S, one_f_one_b, run_order  # noqa: E402
from mpedu.lm import LSTMLM, LMConfig, nll_sum  # noqa: E402


def step_overhead(pipe, batch) -> tuple[float, float, int]:
    """One step's (wall time - ideal replay) / actions per device, its wall time and its actions."""
    start = time.perf_counter()
    tl = pipe.train_step(batch).timeline
    wall = time.perf_counter() - start
    took = {(e.device, e.kind, e.stage, e.mb, e.chunk): e.duration for e in tl.compute()}
    names = tl.devices
    ideal = max(end for *_, end in run_order(
        pipe.schedule, cost=lambda d, a: took[names[d], a.kind, a.stage, a.mb, a.chunk]))
    actions = len(tl.compute())
    return (wall - ideal) / (actions / len(names)), wall, actions


class Floor:
    """The floor: `model`'s layers as two stages (embed, lstm0 | lstm1, decode) in 1F1B order on `workers`,
    each action only its layers' calls, each hand-off a dict entry the receiver polls for with the Mailbox's
    naps. `step(switch_s)` gives one step's (wall time - ideal replay of its own action times) / actions per
    device, the interpreter lock changing hands after `switch_s` (None: Python's own interval)."""

    def __init__(self, model, batch, m: int, workers):
        self.layers, self.workers = model.layers, workers
        self.schedule = one_f_one_b([0, 1], m)
        self.tokens, self.targets = (t.reshape(t.shape[0], m, -1).transpose(0, 1).unbind(0)
                                     for t in (batch.inputs, batch.targets))
        self.weights = [[p for n in names for p in self.layers[n].parameters()]
                        for names in (("embed", "lstm0"), ("lstm1", "decode"))]

    def _device_job(self, d, box, took):
        layers, tokens, targets, weights = self.layers, self.tokens, self.targets, self.weights

        def receive(key):
            while key not in box:
                time.sleep(POLL_NAP_S)
            return box.pop(key)

        def run():
            kept = {}
            for a in self.schedule.actions[d]:
                start = time.perf_counter()
                if a.kind == "F" and d == 0:
                    kept[a.mb] = out = layers["lstm0"](layers["embed"](tokens[a.mb])[0])[0]
                    took[d, a] = time.perf_counter() - start
                    box["act", a.mb] = out
                elif a.kind == "F":
                    x = receive(("act", a.mb)).detach().requires_grad_(True)
                    start = time.perf_counter()
                    kept[a.mb] = (x, nll_sum(layers["decode"](layers["lstm1"](x)[0])[0], targets[a.mb]))
                    took[d, a] = time.perf_counter() - start
                elif d == 0:
                    grad = receive(("grad", a.mb))
                    start = time.perf_counter()
                    torch.autograd.backward([kept.pop(a.mb)], [grad], inputs=weights[0])
                    took[d, a] = time.perf_counter() - start
                else:
                    x, loss = kept.pop(a.mb)
                    torch.autograd.backward([loss], inputs=[x] + weights[1])
                    took[d, a] = time.perf_counter() - start
                    box["grad", a.mb] = x.grad
        return run

    def step(self, switch_s: float | None = None) -> float:
        before = sys.getswitchinterval()
        sys.setswitchinterval(switch_s or before)
        try:
            box, took = {}, {}
            start = time.perf_counter()
            for job in [w.submit(self._device_job(d, box, took)) for d, w in enumerate(self.workers)]:
                job.result()
            wall = time.perf_counter() - start
        finally:
            sys.setswitchinterval(before)
        ideal = max(end for *_, end in run_order(self.schedule, cost=lambda d, a: took[d, a]))
        return (wall - ideal) / len(self.schedule.actions[0])


def timed(pipe, batch, repeats: int, floor: Floor | None = None):
    """Medians over `repeats` steps (after 3 to warm up) of `pipe`'s overhead per action and wall time, and its
    actions; with a floor, each of the pipeline's steps is followed by one of the floor's and one at
    STEP_SWITCH_S, and their medians come too (else None)."""
    mpedu, walls, bare, quick = [], [], [], []
    for k in range(3 + repeats):
        per, wall, actions = step_overhead(pipe, batch)
        if floor is not None:
            bare.append(floor.step())
            quick.append(floor.step(STEP_SWITCH_S))
        if k >= 3:
            mpedu.append(per)
            walls.append(wall)
    median = statistics.median
    return median(mpedu), median(walls), actions, floor and median(bare[3:]), floor and median(quick[3:])


RUNS = [("gpipe", 1), ("gpipe", 2), ("1f1b", 2), ("zb1", 2), ("gpipe", 4)]
PAIRED = "1f1b, 2 device(s)"      # the run whose steps alternate with the floor's


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)   # steps of ~20 ms per pipeline and round
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    m = args.micro_batches
    model = LSTMLM(8, LMConfig(embed_size=1, hidden_size=1, num_layers=2))   # width 1, T = 1: near-empty
    batch = random_batch(8, T=1, B=m)
    cores = len(usable_cores())
    per_round = {}                        # name -> [us per action in each round]
    info = {}                             # name -> (actions, step wall times, more devices than cores)
    floor_workers = pinned_workers(["vgpu:0", "vgpu:1"])
    floor_steps = Floor(model, batch, m, floor_workers)
    floor, quick = [], []
    try:
        for r in range(args.rounds):
            for schedule, placement in (RUNS if r % 2 == 0 else RUNS[::-1]):
                with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
                    name = f"{schedule}, {len(pipe.devices)} device(s)"
                    paired = floor_steps if name == PAIRED else None
                    per, wall, actions, bare, quick_bare = timed(pipe, batch, args.repeats, paired)
                    per_round.setdefault(name, []).append(per * 1e6)
                    info.setdefault(name, (actions, [], len(pipe.devices) > cores))[1].append(wall)
                    if paired is not None:
                        floor.append(bare * 1e6)
                        quick.append(quick_bare * 1e6)
    finally:
        stop_workers(floor_workers)
    print(f"near-empty stages (width 1, T=1), m={m}; overhead = (step wall time - ideal replay) / actions per "
          f"device; median of {args.rounds} rounds in turn (each round's in brackets)")
    print(f"{'run':<24}{'actions':>9}{'step (ms)':>11}{'us/action':>11}")
    median = {name: statistics.median(v) for name, v in per_round.items()}
    for name, (actions, walls, shared) in info.items():
        note = f"  (more devices than the {cores} cores)" if shared else ""
        rounds = ", ".join(f"{v:.1f}" for v in per_round[name])
        print(f"{name:<24}{actions:>9}{statistics.median(walls) * 1e3:>11.2f}{median[name]:>11.1f}  [{rounds}]{note}")
    over = [mpedu - bare for mpedu, bare in zip(per_round[PAIRED], floor)]
    over_quick = [mpedu - bare for mpedu, bare in zip(per_round[PAIRED], quick)]
    print(f"{'floor (1f1b, bare)':<24}{4 * m:>9}{'':>11}{statistics.median(floor):>11.1f}  "
          f"[{', '.join(f'{v:.1f}' for v in floor)}]  two threads and nothing else; 1f1b over it: "
          f"{statistics.median(over):.1f} [{', '.join(f'{v:.1f}' for v in over)}]")
    print(f"{'floor, switch 10 us':<24}{4 * m:>9}{'':>11}{statistics.median(quick):>11.1f}  "
          f"[{', '.join(f'{v:.1f}' for v in quick)}]  the same, the lock changing hands as in mpedu's step; "
          f"1f1b over it: {statistics.median(over_quick):.1f} [{', '.join(f'{v:.1f}' for v in over_quick)}]")
    own = [median[n] for n, i in info.items() if not i[2]]
    shared = [median[n] for n, i in info.items() if i[2]]
    finish("overhead", {"benchmark": "overhead", "micro_batches": m, "cores": cores, "rounds": args.rounds,
                        "us_per_action": max(own), "us_per_action_oversubscribed": max(shared) if shared else None,
                        "floor_us_per_action": statistics.median(floor),
                        "over_floor_us_per_action": statistics.median(over), "rounds_floor_us_per_action": floor,
                        "rounds_over_floor_us_per_action": over,
                        "floor_quick_switch_us_per_action": statistics.median(quick),
                        "over_quick_floor_us_per_action": statistics.median(over_quick),
                        "runs": median, "rounds_us_per_action": per_round, "machine": machine()})


if __name__ == "__main__":
    main()
