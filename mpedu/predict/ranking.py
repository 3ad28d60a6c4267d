"""Did the predicted ranking hold? Plans run for real beside their predictions, compared by Kendall's tau."""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from ..runtime.values import check_number


@dataclass
class Measurement:
    """Candidates run for real beside their predictions."""

    rows: list[dict]                # label, placement, predicted_s, measured_s (median), error, steps_s (each round)
    kendall_tau: float              # +1: the measured order is the predicted order

    @property
    def worst_error(self) -> float:
        return max(abs(r["error"]) for r in self.rows)

    @property
    def kendall_tau_apart(self) -> tuple[float, int, int]:
        """Kendall's tau over the pairs the measurement tells apart (see told_apart), with how many
        pairs that is out of all: plans within the step-to-step noise of each other have no order to keep."""
        return tau_apart([r["predicted_s"] for r in self.rows], [r["steps_s"] for r in self.rows])

    def table(self) -> str:
        lines = [f"{'plan':<40}{'predicted ms':>13}{'measured ms':>12}{'error':>8}"]
        for r in self.rows:
            lines.append(f"{r['label']:<40}{r['predicted_s'] * 1e3:>13.1f}{r['measured_s'] * 1e3:>12.1f}"
                         f"{r['error']:>+8.1%}")
        tau, apart, pairs = self.kendall_tau_apart
        lines.append(f"Kendall tau of the ranking {self.kendall_tau:+.2f} ({tau:+.2f} over the {apart} of {pairs} "
                     f"pairs the rounds tell apart); worst error {self.worst_error:.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def measure(candidates, model, batch, steps: int = 3, warmup: int = 1, rounds=None, link=None) -> Measurement:
    """Run `candidates` (planner Candidates) for real (median of `steps` steps after `warmup`), one step of
    each in turn per round, the order reversed every other round, so that drifting load falls on all
    alike; compare with their predictions.

    rounds: how to run the measured rounds, `rounds(one_round, steps)`, where `one_round(r)` runs round r
    and returns a function that forgets it (a benchmark waits for a quiet machine and runs again a round
    that other work disturbed); None runs them one after another. link: the link the candidates were
    predicted with (Plans.measure passes the plan's), which their Pipelines then emulate (not on GPUs)."""
    check_number("steps", steps, integer=True, minimum=1)
    check_number("warmup", warmup, integer=True)
    if len(candidates) < 2:
        raise ValueError(f"only {len(candidates)} candidate(s) to measure; a ranking needs two or more "
                         "(ask for top >= 2, raise the memory cap, or allow more schedules)")
    # a link is emulated off GPUs only (a GPU's copies take their real time; Pipeline refuses link= there)
    pipes = [c.pipeline(model, **({"link": link} if link is not None and not any(d.is_cuda for d in
                                                                                c.placement.devices) else {}))
             for c in candidates]
    times = [[] for _ in candidates]

    def one_round(r):
        order = list(enumerate(pipes))
        for k, pipe in (order if r % 2 == 0 else order[::-1]):
            model.zero_grad(set_to_none=True)
            times[k].append(pipe.train_step(batch).timeline.makespan)
        return lambda: [ts.pop() for ts in times]

    try:
        for r in range(warmup):
            one_round(r)()                                  # warm-up rounds: run, then forget
        if rounds is None:
            for r in range(steps):
                one_round(r)
        else:
            rounds(one_round, steps)
    finally:
        for pipe in pipes:
            pipe.close()
        model.zero_grad(set_to_none=True)
    rows = []
    for c, ts in zip(candidates, times):
        measured = statistics.median(ts)
        rows.append({"label": c.label, "placement": str(c.placement), "predicted_s": c.step_s,
                     "measured_s": measured, "error": c.step_s / measured - 1, "steps_s": ts})
    return Measurement(rows, kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]))


def kendall_tau(a, b) -> float:
    """Kendall's tau-b between two orderings of the same items (ties count as neither)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"kendall_tau needs two lists of one equal length >= 2, got {len(a)} and {len(b)}")
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        x, y = _order(a, i, j), _order(b, i, j)
        if x == 0 and y == 0:
            continue
        if x == 0:
            ties_a += 1
        elif y == 0:
            ties_b += 1
        elif x == y:
            concordant += 1
        else:
            discordant += 1
    n = concordant + discordant
    denominator = ((n + ties_a) * (n + ties_b)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def told_apart(steps_a, steps_b, share: float = 0.8) -> bool:
    """Whether rounds run in turn order two plans one way in at least `share` of the rounds (one faster
    in 8 of 10, say): a difference the machine's step-to-step noise did not make."""
    if len(steps_a) != len(steps_b) or not steps_a:
        raise ValueError(f"told_apart needs one step time per round for both plans, got {len(steps_a)} and "
                         f"{len(steps_b)}")
    faster, slower = sum(a < b for a, b in zip(steps_a, steps_b)), sum(a > b for a, b in zip(steps_a, steps_b))
    return max(faster, slower) >= share * len(steps_a)                 # a tied round orders neither way


def tau_apart(predicted, steps, share: float = 0.8) -> tuple[float, int, int]:
    """Kendall's tau between `predicted` times and the measured medians of `steps` (each plan's time per
    round), over the pairs told_apart only; also how many pairs those are, and how many there are in all.
    No pair told apart: tau 0."""
    measured = [statistics.median(ts) for ts in steps]
    pairs = list(itertools.combinations(range(len(predicted)), 2))
    apart = [(i, j) for i, j in pairs if told_apart(steps[i], steps[j], share)]
    agree = sum(_order(predicted, i, j) * _order(measured, i, j) for i, j in apart)
    return (agree / len(apart) if apart else 0.0), len(apart), len(pairs)


def _order(values, i: int, j: int) -> int:
    """+1 when values[i] > values[j], -1 when smaller, 0 when tied."""
    return (values[i] > values[j]) - (values[i] < values[j])
