"""Check a claim the course makes from a measurement: runs taken in turn, medians, a margin, a one-line verdict.

A claim such as "the balanced split is faster than the even one" is judged from
runs of both sides taken in turn (A B, B A, A B, ...), so that a machine whose
speed drifts slows both alike. Its verdict is one printable line:

    HOLDS           the faster side wins by at least the margin;
    DOES NOT HOLD   it does not;
    CANNOT SHOW NOW the claim needs two virtual devices running at once, and
                    fewer cores were free: the devices took turns, so the
                    measurement shows the total work, not the effect.

A deterministic claim (bytes, counts, simulator times) uses the same Verdict
with needs_cores=0: no core count can spoil it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


# What a timing claim about two virtual devices needs: nearly two cores' worth of work at once.
NEEDS_CORES = 1.8


def in_turn(runs: Mapping[str, Callable], rounds: int = 5, warmup: int = 1,
            seconds: Callable | None = None) -> dict[str, list[float]]:
    """Run each callable once per round, taking turns; return {label: [seconds of each round]}.

    The order flips every round (A B, then B A) so that neither side always runs
    just after the other. `seconds(result)`, when given, turns what a callable
    returns into its time (e.g. `lambda r: r.timeline.makespan`); otherwise the
    wall time of the call is used. Warm-up rounds are run and not recorded.
    """
    if rounds < 1:
        raise ValueError(f"in_turn needs rounds >= 1 to measure anything, got rounds={rounds}")
    if not runs:
        raise ValueError("in_turn needs at least one callable, e.g. in_turn({'even': fn_a, 'balanced': fn_b})")
    labels = list(runs)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(warmup + rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            start = time.perf_counter()
            result = runs[label]()
            took = time.perf_counter() - start if seconds is None else float(seconds(result))
            if r >= warmup:
                times[label].append(took)
    return times


def free_cores(n: int = 2, **kwargs) -> float:
    """Measure how many virtual devices' worth of work runs at once now, and print it.

    Prints "free cores measured: X.XX" (the exact form the course's tests read in
    committed notebook outputs) and returns X. kwargs go to `mpedu.predict.cores.measure_cores`.
    """
    from ..predict.cores import measure_cores
    cores = round(measure_cores(n, **kwargs), 2)     # what is printed is what the verdicts judge
    print(f"free cores measured: {cores:.2f}")
    return cores


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.1f} ms"
    if unit == "bytes":      # fixed decimals, not format_size's 3 digits: two measures side by side line up
        return f"{value / 1e6:.2f} MB"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.4g}{(' ' + unit) if unit else ''}"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one claim; `str(v)` is its verdict: a line with the ratio it is about, a line of numbers.

    held is True (HOLDS), False (DOES NOT HOLD) or None (CANNOT SHOW NOW: the
    machine had fewer free cores than the claim needs). ratio is how many times
    the faster side beats the slower one (> 1 when it does).
    """

    claim: str
    held: bool | None
    faster: str
    slower: str
    faster_value: float          # median
    slower_value: float          # median
    ratio: float
    margin: float
    cores: float | None
    needs_cores: float
    unit: str = "s"
    rounds: int = 1
    tolerance: float | None = None   # set by `within`: the ratio must lie within 1 +- tolerance
    paired: bool = False             # the ratio is the median of each round's own ratio, not of the medians
    smaller_wins: bool = True        # a time or a size; False: a speed-up or a rate

    @property
    def status(self) -> str:
        return {True: "HOLDS", False: "DOES NOT HOLD", None: "CANNOT SHOW NOW"}[self.held]

    def __str__(self) -> str:
        """Two lines: the verdict and the ratio it is about; then the numbers that ratio comes from."""
        need = (f"within {self.tolerance:.0%} of 1" if self.tolerance is not None else f">= {self.margin:.2f}x")
        numbers = (f"{self.faster} {_fmt(self.faster_value, self.unit)} vs {self.slower} "
                   f"{_fmt(self.slower_value, self.unit)}" + (f", medians of {self.rounds} rounds in turn"
                                                              if self.rounds > 1 else ""))
        if self.paired:          # say which ratio: the medians' own may differ (447.5 vs 511.2 ms and 1.23x)
            a, b = (self.slower_value, self.faster_value) if self.smaller_wins else (self.faster_value,
                                                                                       self.slower_value)
            medians = a / b if b else float("nan")
            numbers += (f"; {self.ratio:.2f}x is the median of each round's own ratio, the medians' ratio "
                        f"is {medians:.2f}x")
        cores = "" if self.needs_cores <= 0 or self.cores is None else f"; free cores {self.cores:.2f}"
        if self.held is None:
            return (f"CANNOT SHOW NOW: {self.claim} (only {self.cores:.2f} free cores measured, needs "
                    f"{self.needs_cores:.2f}: other programs are using a core, so the two virtual devices "
                    "take turns instead of running at once; run again on a quieter machine)\n"
                    f"  what the runs showed, the total work and not the effect: {self.ratio:.2f}x ({numbers})")
        return f"{self.status}: {self.claim}: {self.ratio:.2f}x (needs {need}{cores})\n  {numbers}"

    def to_dict(self) -> dict:
        return {"claim": self.claim, "status": self.status, "held": self.held, "faster": self.faster,
                "slower": self.slower, "faster_value": self.faster_value, "slower_value": self.slower_value,
                "ratio": self.ratio, "margin": self.margin, "cores": self.cores, "needs_cores": self.needs_cores,
                "unit": self.unit, "rounds": self.rounds, "tolerance": self.tolerance}


def _values(times: Mapping[str, float | Sequence[float]], label: str) -> list[float]:
    if label not in times:
        raise KeyError(f"no measurements labelled {label!r}; labels given: {sorted(times)}")
    v = times[label]
    values = [float(v)] if isinstance(v, (int, float)) else [float(x) for x in v]
    if not values:
        raise ValueError(f"no measurements in {label!r}: run in_turn with rounds >= 1")
    return values


def _cores_now(cores: float | None, needs_cores: float) -> float | None:
    """The free cores given, or measured now when a claim needs them and none were given."""
    if needs_cores > 0 and cores is None:
        from ..predict.cores import measure_cores
        cores = measure_cores(2)
    return None if cores is None else round(cores, 2)     # judged as printed: 1.7999 is not "1.80 >= 1.80"


def compare(claim: str, times: Mapping[str, float | Sequence[float]], faster: str, slower: str,
            margin: float = 1.05, cores: float | None = None, needs_cores: float = NEEDS_CORES,
            unit: str = "s", smaller_wins: bool = True) -> Verdict:
    """Judge "`faster` beats `slower` by at least `margin`" from measurements.

    times maps labels to a list of values (one per round, as `in_turn` returns)
    or a single number (a deterministic result). With lists of equal length the
    ratio is the median over rounds of the per-round ratio (both sides measured
    in the same round); otherwise the ratio of the medians. smaller_wins: a time,
    bytes or count is better when smaller; pass False for a speedup or a rate.

    cores: the free cores measured next to the runs (`free_cores()`); a claim
    with needs_cores > 0 and fewer free cores than that cannot be shown now.
    Without cores, they are measured here (after the runs: better pass them).
    """
    a, b = _values(times, faster), _values(times, slower)
    paired = len(a) == len(b) and len(a) > 1
    if paired:
        pairs = [(y / x if smaller_wins else x / y) for x, y in zip(a, b)]
        ratio = statistics.median(pairs)
    else:
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = mb / ma if smaller_wins else ma / mb
    cores = _cores_now(cores, needs_cores)
    held = None if needs_cores > 0 and cores < needs_cores else ratio >= margin
    return Verdict(claim, held, faster, slower, statistics.median(a), statistics.median(b), ratio, margin,
                   cores, needs_cores, unit, min(len(a), len(b)), paired=paired, smaller_wins=smaller_wins)


def within(claim: str, predicted: float, measured: float | Sequence[float], tolerance: float = 0.10,
           cores: float | None = None, needs_cores: float = NEEDS_CORES, unit: str = "s") -> Verdict:
    """Judge "the prediction is within `tolerance` of the measurement" (e.g. the simulator's step time).

    The verdict's ratio is predicted / median measured; it holds when that lies
    in [1 - tolerance, 1 + tolerance]. Cores as in `compare`.
    """
    values = [float(measured)] if isinstance(measured, (int, float)) else [float(x) for x in measured]
    m = statistics.median(values)
    ratio = predicted / m
    cores = _cores_now(cores, needs_cores)
    held = None if needs_cores > 0 and cores < needs_cores else abs(ratio - 1) <= tolerance
    return Verdict(claim, held, "predicted", "measured", predicted, m, ratio, 1.0, cores, needs_cores, unit,
                   len(values), tolerance)


# -- what a link costs a placement: measured on virtual devices, predicted by the simulator --------

@dataclass
class PlacementRun:
    """One placement's steps on an emulated link: measured (runs taken in turn) and predicted."""

    placement: object               # the Placement
    times: list                     # measured step times (timeline makespans, seconds), one per round
    timeline: object                # the measured step's Timeline with the median time
    predicted: object               # simulate(...)'s Timeline with the profiled costs and the same link

    @property
    def measured(self) -> float:
        """Median measured step time (seconds)."""
        return statistics.median(self.times)

    @property
    def error(self) -> float:
        """predicted / measured - 1: +0.05 means the simulator says 5% slower than measured."""
        return self.predicted.makespan / self.measured - 1


def measure_placements(model, batch, placements, link, schedule: str = "gpipe", micro_batches: int = 4,
                       rounds: int = 5, warmup: int = 1, costs=None, cores: float | None = None) -> dict:
    """Train steps of each placement on virtual devices joined by `link`, taking turns, and predict each.

        runs = measure_placements(model, batch, {"contiguous": "embed,lstm0-1:vgpu0 | lstm2-3,decode:vgpu1",
                                                 "alternating": "embed,lstm0,lstm2:vgpu0 | lstm1,lstm3,decode:vgpu1"},
                                  "10gbe/100")
        runs["alternating"].measured / runs["contiguous"].measured     # what the cuts cost
        runs["alternating"].error                                       # the simulator's error

    placements: {label: Placement or placement string}. The step time is the
    timeline's makespan; rounds go A B, B A, ... (mpedu.course.claims.in_turn). The
    prediction uses per-layer `costs` (profiled here on vgpu:0 if not given) and
    the same link; `cores` (free cores, e.g. measure_cores(2)) as in simulate.
    Only gradients are computed (no update); the model's .grad is cleared after.
    Returns {label: PlacementRun}.
    """
    from ..core.pipeline import Pipeline
    from ..core.placement import Placement
    from ..predict.profiling import profile
    from ..predict.simulator import simulate
    from ..runtime.link import Link
    link = Link.parse(link)
    plans = {label: p if isinstance(p, Placement) else Placement.parse(p, model) for label, p in placements.items()}
    if costs is None:
        costs = profile(model, batch, "vgpu:0", micro_batches=micro_batches)
    pipes = {label: Pipeline(model, p, schedule, micro_batches, link=link) for label, p in plans.items()}
    results: dict = {label: [] for label in pipes}

    def step(label):
        def run():
            model.zero_grad(set_to_none=True)
            result = pipes[label].train_step(batch)
            results[label].append(result.timeline)
            return result
        return run

    try:
        times = in_turn({label: step(label) for label in pipes}, rounds=rounds, warmup=warmup,
                        seconds=lambda r: r.timeline.makespan)
    finally:
        for pipe in pipes.values():
            pipe.close()
        model.zero_grad(set_to_none=True)
    runs = {}
    for label, pipe in pipes.items():
        measured = sorted(results[label][warmup:], key=lambda t: t.makespan)
        predicted = simulate(pipe.schedule, costs, plans[label], link=link, cores=cores)
        runs[label] = PlacementRun(plans[label], times[label], measured[len(measured) // 2], predicted)
    return runs


# The experiment of notebook 05 and bench/claims.py: the `small` model with 4 LSTM layers, one
# (35, 32) batch, GPipe with 4 micro-batches; neighbouring layers together, or alternating.
NEIGHBOURS = {"contiguous": "embed,lstm0-1:vgpu0 | lstm2-3,decode:vgpu1",
              "alternating": "embed,lstm0,lstm2:vgpu0 | lstm1,lstm3,decode:vgpu1"}
SLOW_LINK = "10gbe/100"   # 10 Gb Ethernet slowed 100x: a GPU's compute-to-communication ratio on CPU cores
