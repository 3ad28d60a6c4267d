"""Plan memory and time together: the Pareto front of partition x schedule x micro-batches x recomputation.

    plans = plan(model, batch, ["vgpu:0", "vgpu:1"], memory_cap="60MB")
    print(plans)                      # the front: no plan both faster and smaller than another
    plans.best                        # the fastest plan that fits the cap
    plans.measure(model, batch)       # run the top plans for real: did the ranking hold?

Letters as in mpedu.core.schedules: p devices, n stages, m micro-batches, b = B / m columns
per micro-batch. Every candidate is predicted, never run: its step time by
mpedu.predict.simulator on profiled per-layer costs (a CostCurve, so each m gets the costs of
its own micro-batch width), its memory per device by the footprint model.

The search is exact but pruned. Two cheap lower bounds (mpedu.predict.bounds) come first: on the step time
(a device must wait for micro-batch 0 to reach its first stage, do all its work, then
let the last gradient go back; naive runs m whole trips; devices sharing cores share
the work), and on the memory (weights, gradients and the units held after each forward
at the bytes they keep). Candidates are visited in order of their time bound, and one is
simulated, with its footprint from the one memory model (mpedu.predict.footprint), only if no
candidate already simulated is both at least as fast as its bound and at most as large:
anything skipped is dominated, so the front is the one simulating every candidate gives
(tests/test_planner.py checks that against brute force).
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

from ..core import schedules
from ..core.placement import Placement
from ..core.recompute import check_mode
from ..core.schedules import Schedule
from ..core.schedules import make as make_schedule
from ..runtime.devices import device_list
from ..runtime.streams import chunk_bounds
from ..runtime.values import check_number, format_size, parse_size
from .bounds import held_units, memory_floor, time_bound
from .costcurve import CostCurve, profile_curve
from .footprint import device_footprints
from .plans import Candidate, NoPlanFits, Plans, PlanStopped, as_choices
from .profiling import Costs, StageCost
from .simulator import simulate

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1", "wavefront")
# Searched only when asked for (schedules=...): the explorer's best-plans table searches SCHEDULES, and a V search
# (every split of 2p stages) costs as much again.
# "zb_cap" is zero bubble under a memory cap, every cap from 1 to 2p micro-batches per device (zb_cap1, zb_cap2, ..).
V_SCHEDULES = schedules.V_SHAPED        # zbv, dualpipev, v_half, v_min
EXTRA_SCHEDULES = V_SCHEDULES + ("zb_cap",)
RECOMPUTE = (None, "all", "all-but-last")


def predict(candidate: Candidate, costs: CostCurve, T: int, B: int, link=None, cores=None) -> float:
    """A candidate's step time on (T, B) batches predicted again, from other costs (a fresh profile, or
    another bucket length)."""
    m, chunks = candidate.micro_batches, candidate.chunks
    schedule = make_schedule(candidate.schedule, candidate.placement.stage_devices, m, chunks)
    return simulate(schedule, costs.at(T, B // m, chunks), candidate.placement, link=link, cores=cores,
                    recompute=candidate.recompute).makespan


# -- the search --------------------------------------------------------------------------------------
def plan(model, batch, devices, memory_cap=None, costs: Costs | CostCurve | None = None, *,
         schedules: tuple[str, ...] = SCHEDULES, recompute: tuple = RECOMPUTE, micro_batches=None,
         chunks: tuple[int, ...] | None = None, cores: float | None = None, link=None, should_stop=None,
         optimizer_bytes_per_param: float = 0.0, **profile_args) -> Plans:
    """Search partitions, schedules, micro-batch counts and recomputation for `model` on `batch`
    over `devices` (a count or names), and return the Pareto front of step time against the
    largest device's peak memory.

    memory_cap: bytes (or "60MB") every device may hold; the fastest candidate within it is
    `Plans.best`. costs: a CostCurve (profile_curve) or one Costs (then other micro-batch
    widths' times are scaled in proportion); bytes are weighed by a dry run at every shape the
    search meets (a CostCurve keeps them for the next call); None profiles every width the search
    needs on the first device (slow for big models: profile once and pass it). micro_batches: the
    counts to try (default: every divisor of the batch width); chunks: the wavefront's time-chunk
    counts (those over the batch's T are skipped; default 2 and 4). cores and link go to simulate.
    optimizer_bytes_per_param: optimizer state per byte of trainable weights in every footprint
    (SGD 0, momentum 1, Adam 2).
    should_stop: a function of no arguments, asked before each candidate is simulated; when it
    returns true the search raises PlanStopped (a search in the background, cancelled because a
    newer one waits).
    """
    T, B = batch.inputs.shape
    devs = device_list(devices)
    # one value where a tuple of choices goes: plan for that one
    given_chunks = chunks is not None
    schedules, recompute, chunks = (as_choices(v) for v in (schedules, recompute, chunks if given_chunks else (2, 4)))
    micro_batches = as_choices(micro_batches) if micro_batches is not None else None
    p = len(devs)
    names = list(model.layer_names)
    n = len(names)
    if p > n:
        raise ValueError(f"{p} devices but the model has {n} layers: every device needs one; use at most {n}")
    if p > 1 and getattr(model.config, "tie_weights", False):
        raise ValueError("the model ties embed and decode weights, so both must sit on one device, which no "
                         f"split over {p} devices in layer order allows; build it with tie_weights=False")
    if micro_batches is not None:
        wrong = [m for m in micro_batches if isinstance(m, bool) or not isinstance(m, int)]
        if not micro_batches or wrong:
            raise ValueError(f"micro_batches={micro_batches if not wrong else wrong[0]!r}: give one whole number "
                             f"or a list of them, divisors of the batch width {B}, or None to try every divisor")
    ms = sorted(set(micro_batches)) if micro_batches else [d for d in range(1, B + 1) if B % d == 0]
    bad = [m for m in ms if m < 1 or B % m]
    if bad:
        raise ValueError(f"micro_batches={bad[0]} does not divide the batch width {B}; "
                         f"use divisors such as {[d for d in range(1, B + 1) if B % d == 0]}")
    unknown = [s for s in schedules if s not in SCHEDULES + EXTRA_SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; the planner knows "
                         f"{', '.join(SCHEDULES + EXTRA_SCHEDULES)}")
    for mode in recompute:
        check_mode(mode, "recompute")
    if not schedules or not recompute:
        raise ValueError(_why_none(schedules, recompute, ms, p, n))
    odd = [c for c in chunks if isinstance(c, bool) or not isinstance(c, int) or c < 1]
    if odd:
        raise ValueError(f"chunks={tuple(chunks)}: {odd[0]!r} is not a time-chunk count; give whole numbers >= 1")
    if "wavefront" in schedules and not any(c <= T for c in chunks) and (given_chunks or schedules == ("wavefront",)):
        raise ValueError(f"chunks={tuple(chunks)}: the wavefront needs a chunk count from 1 to the batch's "
                         f"{T} time steps; give such counts, or leave 'wavefront' out of schedules")
    if isinstance(memory_cap, dict):
        raise ValueError("plan takes one memory_cap for every device (e.g. '60MB'); a cap per device is for "
                         "cap_memory(pipe, {device: size})")
    cap = parse_size(memory_cap) if isinstance(memory_cap, str) else \
        check_number("memory_cap", memory_cap, minimum=1, none_ok=True)
    check_number("optimizer_bytes_per_param", optimizer_bytes_per_param)
    check_number("cores", cores, above=True, none_ok=True)
    if costs is None:
        widths = [B // m for m in ms]
        lengths = [T // c for c in chunks if c <= T] if "wavefront" in schedules else []
        costs = profile_curve(model, batch, devs[0], widths=widths, lengths=lengths, length_widths=widths,
                              **profile_args)
    curve = costs if isinstance(costs, CostCurve) else CostCurve([costs], [])   # one profile: times in proportion
    for measured in curve.widths + curve.lengths:
        measured.check_model(model)
    # activation bytes grow in blocks, not in proportion: weighed at every shape the search meets (a dry run per
    # shape not weighed yet; a curve keeps them, so pass the same CostCurve to plan again)
    curve.weigh(model, search_shapes(T, B, ms, chunks if "wavefront" in schedules else ()), devs[0])

    start = time.perf_counter()
    candidates = list(_enumerate(names, devs, ms, curve, schedules, recompute, chunks, T, B, cores,
                                 optimizer_bytes_per_param))
    if not candidates:
        raise ValueError(_why_none(schedules, recompute, ms, p, n))
    candidates.sort(key=lambda c: (c.bound, c.memory_floor))
    simulated: list[Candidate] = []
    # every simulated candidate's step time, sorted, and the smallest peak among those up to each one
    times: list[float] = []
    smallest_so_far: list[float] = []

    def dominated(bound, memory):
        """Has a simulated candidate taken at most `bound` seconds with at most `memory` bytes?"""
        i = bisect.bisect_right(times, bound)
        return i > 0 and smallest_so_far[i - 1] <= memory

    def keep(step, peak):
        i = bisect.bisect_right(times, step)
        times.insert(i, step)
        smallest_so_far.insert(i, min(peak, smallest_so_far[i - 1]) if i else peak)
        for j in range(i + 1, len(times)):
            if smallest_so_far[j] <= smallest_so_far[j - 1]:
                break
            smallest_so_far[j] = smallest_so_far[j - 1]

    pending: list[_Option] = []                         # skipped: dominated by a simulated candidate
    for c in candidates:
        if should_stop is not None and should_stop():
            raise PlanStopped(f"the search stopped after {len(simulated)} of {len(candidates)} candidates "
                              "(should_stop said so)")
        if dominated(c.bound, c.memory_floor):
            pending.append(c)                           # something simulated is as fast and as small
            continue
        totals = _footprint(c)
        if dominated(c.bound, max(totals)):
            pending.append(c)
            continue
        simulated.append(_predict(c, link, cores, cap, totals))
        keep(simulated[-1].step_s, max(totals))
    simulated.sort(key=lambda c: (c.step_s, c.peak_bytes))
    front, smallest = [], float("inf")
    for c in simulated:                                 # fastest first: on the front iff smaller than all faster
        if c.peak_bytes < smallest:
            front.append(c)
            smallest = c.peak_bytes
    fitting = [c for c in front if c.fits]
    plans = Plans(front, fitting[0] if fitting else None, cap, len(candidates), simulated,
                  time.perf_counter() - start, pending, (link, cores), _predict)
    if plans.best is not None:
        plans.split = propose_split(plans.best, curve, T, B, link, cores, cap, optimizer_bytes_per_param)
    if plans.best is None:
        small = front[-1]
        raise NoPlanFits(f"no plan fits memory_cap={format_size(cap)} on {p} devices: the smallest footprint "
                         f"found is {format_size(small.peak_bytes)} ({small.label}, '{small.placement}'). "
                         f"Raise the cap to at least {format_size(small.peak_bytes, up=True)}, use more devices, "
                         "or a smaller batch or shorter buckets"
                         + ("" if "all" in recompute else "; or allow recomputation: recompute=(None, 'all')"),
                         small, cap)
    return plans


@dataclass
class _Option:
    """A candidate before simulation: its schedule, stage costs, and lower bounds on its time and memory."""

    placement: Placement
    schedule_obj: Schedule
    m: int
    chunks: int
    recompute: str | None
    costs: Costs
    stage_costs: list[StageCost]
    memory_floor: int               # <= the footprint model's peak (exact without recomputation)
    bound: float                    # <= the simulated step time
    optimizer: float = 0.0          # optimizer state per byte of trainable weights
    chunk_costs: list | None = None  # time chunks of unequal lengths: each chunk's own Costs


def _compositions(n: int, k: int):
    """Every way to cut n layers into k non-empty runs, as run lengths."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0,) + cuts + (n,)
        yield [edges[i + 1] - edges[i] for i in range(k)]


def _enumerate(names, devs, ms, curve, schedule_names, recompute, chunk_options, T, B, cores, optimizer=0.0):
    p, n = len(devs), len(names)
    layouts = [(list(range(p)), counts) for counts in _compositions(n, p)]
    interleaved = []
    if p > 1 and n >= 2 * p:                            # v = 2 stages per device, dealt round-robin
        interleaved = [([s % p for s in range(2 * p)], counts) for counts in _compositions(n, 2 * p)]
    v_layouts = []
    if n >= 2 * p:                                      # the V: stage s on device min(s, 2p - 1 - s)
        v_layouts = [([min(s, 2 * p - 1 - s) for s in range(2 * p)], counts) for counts in _compositions(n, 2 * p)]
    # each searched name with its caps: zb_cap stands for zb_cap1 .. zb_cap<2p>
    searched = [(f"zb_cap{k}" if name == "zb_cap" else name) for name in schedule_names
                for k in (range(1, 2 * p + 1) if name == "zb_cap" else [None])]
    shapes: dict = {}
    for m in ms:
        for name in searched:
            if name == "interleaved":
                if m % p or not interleaved:
                    continue
                pool, chunk_list = interleaved, [1]
            elif name in V_SCHEDULES:
                if not v_layouts or m < schedules.fewest_micro_batches(name, p):   # DualPipeV m >= 2p, ...
                    continue
                pool, chunk_list = v_layouts, [1]
            else:
                pool, chunk_list = layouts, ([c for c in chunk_options if c <= T] if name == "wavefront" else [1])
            for chunks in chunk_list:
                costs = curve.at(T, B // m, chunks)             # with time chunks: what one chunk costs
                stage_cache = shapes.setdefault(("stages", m, chunks), {})
                # T not a multiple of the chunk count: chunks of two lengths, each holding its own bytes
                lengths = [hi - lo for lo, hi in chunk_bounds(T, chunks)]
                by_length = {L: curve.at(L, B // m) for L in set(lengths)} if len(set(lengths)) > 1 else None
                per_chunk = [by_length[L] for L in lengths] if by_length else None
                for stage_devices, counts in pool:
                    key = (name, tuple(stage_devices), m, chunks)
                    if key not in shapes:
                        sched = make_schedule(name, stage_devices, m, chunks)
                        shapes[key] = (sched, held_units(sched))
                    sched, held = shapes[key]
                    groups, stage_costs, smallest, at = [], [], [], 0
                    for c in counts:
                        groups.append(names[at:at + c])
                        if (at, c) not in stage_cache:          # a run of layers costs the same in every plan
                            stage_cache[at, c] = (costs.stages([groups[-1]])[0], by_length and min(
                                (each.stages([groups[-1]])[0] for each in by_length.values()),
                                key=lambda sc: sc.activation_bytes))
                        stage_costs.append(stage_cache[at, c][0])
                        smallest.append(stage_cache[at, c][1])
                        at += c
                    # (two neighbouring stages of one device, the V's middle, stay two: a cut between them)
                    cuts = [g[0] for k, g in enumerate(groups) if k and stage_devices[k] == stage_devices[k - 1]]
                    placement = Placement(names, {nm: devs[d] for d, g in zip(stage_devices, groups) for nm in g},
                                          cuts)
                    for rc in recompute:
                        if rc == "all-but-last" and m == 1:
                            continue                    # its one micro-batch is the last: the same as None
                        yield _Option(placement, sched, m, chunks, rc, costs, stage_costs,
                                      memory_floor(stage_costs, stage_devices, held, rc, chunks, optimizer,
                                                   smallest if per_chunk else None),
                                      time_bound(sched, stage_costs, p, cores, rc), optimizer, per_chunk)


def split_shapes(B: int, m: int) -> list[tuple[int, ...]]:
    """Unequal splits of B sentences into m micro-batches worth trying: the first and the last smaller (they are
    the pipeline's fill and drain, which the other devices wait through), the rest as equal as can be.

        B = 32, m = 4:   (4, 12, 12, 4), (6, 10, 10, 6), (2, 14, 14, 2)"""
    if m < 3:
        return []
    out = []
    for end in sorted({max(1, B // (2 * m)), max(1, B // (4 * m)), max(1, 3 * B // (4 * m))}):
        middle, extra = divmod(B - 2 * end, m - 2)
        if middle < 1 or end * m == B:
            continue
        sizes = (end, *[middle + (1 if k < extra else 0) for k in range(m - 2)], end)
        out.append(sizes)
    return out


def propose_split(best: Candidate, curve: CostCurve, T: int, B: int, link=None, cores=None, cap=None,
                  optimizer: float = 0.0) -> Candidate | None:
    """`best` with unequal micro-batches (split_shapes), if one is predicted faster (by over 1%) and fits the cap:
    each micro-batch's costs and bytes read at its own width. None where no split beats it."""
    if best.chunks > 1 or best.micro_batches < 3:
        return None
    schedule = make_schedule(best.schedule, best.placement.stage_devices, best.micro_batches)
    found = None
    for sizes in split_shapes(B, best.micro_batches):
        per_mb = [curve.at(T, b) for b in sizes]
        step = simulate(schedule, per_mb, best.placement, micro_batches=list(sizes), link=link, cores=cores,
                        recompute=best.recompute).makespan
        totals = tuple(f.total for f in device_footprints(per_mb[0], best.placement, schedule, recompute=best.recompute,
                                                         optimizer_bytes_per_param=optimizer,
                                                         micro_batch_costs=per_mb))
        fits = cap is None or max(totals) <= cap
        if fits and step < 0.99 * best.step_s and (found is None or step < found.step_s):
            found = Candidate(best.placement, best.schedule, best.micro_batches, 1, best.recompute, step, totals,
                              True, sizes)
    return found


def _why_none(schedules, recompute, ms, p: int, n: int) -> str:
    """Why the choices leave no candidate at all."""
    if not schedules or not recompute:
        return (f"nothing to search: schedules={tuple(schedules)}, recompute={tuple(recompute)}; give at least "
                "one of each (recompute=(None,) keeps activations)")
    reasons = []
    if "interleaved" in schedules:
        unmet = ([f"2 or more devices (here {p})"] if p < 2 else []) + (
            [f"2 layers per device ({n} layers for {p} devices)"] if n < 2 * p else []) + (
            [f"a micro-batch count divisible by {p} (tried {', '.join(map(str, ms))})"]
            if not any(m % p == 0 for m in ms) else [])
        if unmet:
            reasons.append("interleaved needs " + " and ".join(unmet))
    if set(recompute) == {"all-but-last"}:
        reasons.append("all-but-last recomputation needs 2 or more micro-batches (with 1 it is no recomputation)")
    return ("no candidate to search for schedules=" + repr(tuple(schedules)) + ": " + "; ".join(reasons)
            + "; add other schedules, micro-batch counts or recomputation modes")


def _footprint(option: _Option) -> tuple[int, ...]:
    """Peak bytes per device, from the one memory model."""
    return tuple(f.total for f in device_footprints(option.costs, option.placement, option.schedule_obj,
                                                    recompute=option.recompute,
                                                    optimizer_bytes_per_param=option.optimizer,
                                                    chunk_costs=option.chunk_costs))


def _predict(option: _Option, link, cores, cap, totals=None) -> Candidate:
    """Simulate one candidate: its predicted step time and footprint, and whether it fits the cap."""
    totals = totals if totals is not None else _footprint(option)
    return Candidate(option.placement, option.schedule_obj.name, option.m, option.chunks, option.recompute,
                     _simulate(option, link, cores), totals, cap is None or max(totals) <= cap)


def _simulate(option: _Option, link, cores) -> float:
    """The predicted makespan (simulate charges each recomputed micro-batch's re-run forward)."""
    return simulate(option.schedule_obj, option.stage_costs, option.placement, link=link, cores=cores,
                    recompute=option.recompute).makespan


def plan_buckets(model, batches, devices, curve: CostCurve, memory_cap=None, **plan_args) -> dict:
    """The fastest plan within the cap for each bucket length of `batches` (a BucketIterator, Batches
    or (T, B) shapes): {T: Candidate}. Costs come from `curve` at each length, so short buckets may
    prefer more micro-batches or another schedule. Hand the result to predict_epoch (epochs)."""
    widths: dict = {}
    for b in batches:
        T, B = tuple(b.inputs.shape) if hasattr(b, "inputs") else tuple(b)
        widths.setdefault(T, {}).setdefault(B, 0)
        widths[T][B] += 1
    choice = {}
    for T, counts in sorted(widths.items()):
        B = max(counts, key=counts.get)                 # the bucket's usual width (its last batch may be short)
        # plan weighs each bucket's activation bytes as measured (they grow in blocks, not with T)
        choice[T] = plan(model, _Shape(T, B), devices, memory_cap, costs=curve, **plan_args).best
    return choice


def search_shapes(T: int, B: int, ms, chunks=(2, 4)) -> set[tuple[int, int]]:
    """The micro-batch shapes (length, width) a search over these counts meets: whole micro-batches, and
    the wavefront's time chunks (two lengths where T is not a multiple of the count)."""
    widths = [B // m for m in ms if isinstance(m, int) and m >= 1 and B % m == 0]
    lengths = {T} | {hi - lo for c in chunks if isinstance(c, int) and 1 <= c <= T for lo, hi in chunk_bounds(T, c)}
    return {(L, b) for L in lengths for b in widths}


class _Shape:
    """What plan reads of a batch: its shape, (T, B)."""

    def __init__(self, T: int, B: int):
        import torch
        self.inputs = torch.empty((T, B), dtype=torch.long)
