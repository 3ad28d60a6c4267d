"""Optimal partitioning: cut the layer list into p contiguous stages so the slowest stage is as fast as possible."""
from __future__ import annotations

import math
from typing import Sequence

from ..core import schedules
from ..core.placement import Placement
from ..core.recompute import recompute_modes
from ..runtime.devices import get_device, get_devices
from ..runtime.values import format_size, parse_size
from .footprint import stage_footprint
from .profiling import Costs, profile


def balance(costs_per_layer: Sequence[float], p: int, memory: Sequence[float] | None = None,
            memory_cap: float | None = None, names: Sequence[str] | None = None) -> list[int]:
    """Layer counts per device, e.g. [3, 2, 1]: the contiguous split of `costs_per_layer`
    into p non-empty stages whose largest stage cost is the smallest possible.

    With `memory` (per layer) and `memory_cap` (per device), only splits where every
    stage's memory sum is at most the cap count. `names` only make errors readable.
    Exact by dynamic programming over (stages used, layers covered): O(p n^2).
    """
    n = len(costs_per_layer)
    names = list(names) if names is not None else [f"layer {k}" for k in range(n)]
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a whole number of devices >= 1, got {p!r}")
    if n == 0:
        raise ValueError("no layers to balance: costs_per_layer is empty")
    if p > n:
        raise ValueError(f"{p} devices but only {n} layers: every device needs at least one layer; "
                         f"use p <= {n}")
    _check(costs_per_layer, "costs_per_layer", names)
    if (memory is None) != (memory_cap is None):
        raise ValueError("give both memory (bytes per layer) and memory_cap (bytes per device), or neither")
    if memory is not None:
        if len(memory) != n:
            raise ValueError(f"memory has {len(memory)} entries for {n} layers; give one per layer")
        _check(memory, "memory", names)
        _fits_or_explain(memory, p, memory_cap, names)
    counts = _min_max_split(costs_per_layer, p, memory, memory_cap)
    assert counts is not None   # _fits_or_explain proved a feasible split exists
    return counts


def _check(values, what, names):
    for name, v in zip(names, values):
        if not v >= 0:
            raise ValueError(f"{what} for {name} is {v}; costs and memory must be >= 0")


def _min_max_split(costs, p, memory=None, cap=None) -> list[int] | None:
    """Layer counts minimising the largest stage cost, each stage's memory under `cap`; None: nothing fits."""
    S, M = [0.0], [0.0]                                 # prefix sums: stage i..j-1 costs S[j] - S[i]
    for k in range(len(costs)):
        S.append(S[-1] + costs[k])
        M.append(M[-1] + (memory[k] if memory is not None else 0.0))
    inf = float("inf")
    found = min_max_split(len(costs), p, lambda i, j, k: (
        inf if cap is not None and _over(M[j] - M[i], cap) else S[j] - S[i]))
    return found[1] if found is not None else None


def min_max_split(n: int, p: int, cost) -> tuple[float, list[int]] | None:
    """The DP behind every partition here: cut n layers into p contiguous non-empty stages so the
    largest cost(i, j, k) (stage k holds layers i..j-1; inf = not allowed) is as small as possible.

    best[k][j]: the smallest possible largest-stage cost when the first j layers form k stages;
    cut[k][j] the start of the k-th stage in that split. Returns (that cost, layer counts per
    stage), or None when every split has a stage that is not allowed."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):             # leave at least one layer per later stage
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                value = max(best[k - 1][i], cost(i, j, k - 1))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[p][n] == inf:
        return None
    counts, j = [], n
    for k in range(p, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return best[p][n], counts[::-1]


def _fits_or_explain(memory, p, cap, names) -> None:
    """Raise a ValueError that says what would fit when no split keeps every device under cap."""
    biggest = max(range(len(memory)), key=lambda k: memory[k])
    if _over(memory[biggest], cap):
        raise ValueError(f"{names[biggest]} alone needs {_size(memory[biggest])}, more than "
                         f"memory_cap={_size(cap)}: no number of devices helps. Raise the cap to at least "
                         f"{_size(memory[biggest])} or shrink the layer (fewer micro-batch columns, smaller vocab)")
    need, used = 1, 0.0                                 # greedy: fewest contiguous stages under the cap
    for m in memory:
        if _over(used + m, cap):
            need, used = need + 1, 0.0
        used += m
    if need > p:
        counts = _min_max_split(memory, p)
        smallest = max(sum(memory[a:a + c]) for a, c in zip(_starts(counts), counts))
        raise ValueError(f"no split of {len(memory)} layers over {p} devices keeps every device within "
                         f"memory_cap={_size(cap)}: over {p} devices the smallest cap that fits is "
                         f"{_size(smallest)}; at {_size(cap)} you need {need} devices: pass p={need}")


def _over(total: float, cap: float) -> bool:
    """total > cap, forgiving the rounding of adding floats in a different order."""
    return total > cap + 1e-9 * abs(cap)


def _starts(counts):
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _size(amount: float) -> str:
    """balance() takes memory in any unit: a small amount is shown as given, a large one as bytes."""
    return format_size(amount) if amount >= 1e5 else f"{amount:g}"


def to_placement(model, counts: Sequence[int], devices) -> Placement:
    """Layers in order, counts[k] of them on devices[k]: `to_placement(model, [3, 2], ['vgpu:0', 'vgpu:1'])`."""
    devs = _devices(devices)
    names = model.layer_names
    if len(counts) != len(devs) or sum(counts) != len(names) or min(counts) < 1:
        raise ValueError(f"counts {list(counts)} must give each of the {len(devs)} devices at least one layer "
                         f"and add up to the model's {len(names)} layers")
    assignment = {name: dev for dev, start, c in zip(devs, _starts(counts), counts) for name in names[start:start + c]}
    return Placement(names, assignment)


def balance_by_time(model, batch, devices, micro_batches: int = 1, memory_cap: float | None = None,
                    costs: Costs | None = None, schedule: str = "gpipe", recompute=None,
                    optimizer_bytes_per_param: float = 0.0, **profile_args) -> Placement:
    """Profile every layer (forward + backward of one micro-batch) on the first device, then
    split for the smallest slowest stage. With `memory_cap` (bytes per device) a stage must fit
    its footprint (mpedu.predict.footprint: weights, gradients, optimizer state, and the activations
    `schedule` holds at its peak over `micro_batches`, with `recompute`) under the cap.
    """
    devs = _devices(devices)
    _refuse_tied(model, len(devs))
    if costs is None:
        costs = profile(model, batch, devs[0], micro_batches=micro_batches, **profile_args)
    time_per_layer = [f + b for f, b in zip(costs.forward, costs.backward)]
    if memory_cap is None:
        return to_placement(model, balance(time_per_layer, len(devs), names=costs.names), devs)
    _check(time_per_layer, "costs_per_layer", costs.names)
    memory_cap = parse_size(memory_cap)
    T, B = batch.inputs.shape
    if tuple(costs.micro_batch) != (T, B // micro_batches):
        # a micro-batch of another shape saves other activation bytes: the cap test would pass splits that do not fit
        raise ValueError(f"costs were profiled on micro-batches of (T, b) = {tuple(costs.micro_batch)}, but "
                         f"{micro_batches} micro-batch{'es' if micro_batches != 1 else ''} of this batch are "
                         f"{(T, B // micro_batches)}: profile with micro_batches={micro_batches} (or leave costs out)")
    p, n = len(devs), len(costs.names)
    if p > n:
        raise ValueError(f"{p} devices but only {n} layers: every device needs at least one layer; use p <= {n}")
    plan = schedules.make(schedule, list(range(p)), micro_batches)
    mode = recompute_modes(recompute, p)

    def need(i, j, k) -> float:               # bytes of layers i..j-1 as stage k
        stage = costs.stages([costs.names[i:j]])[0]
        return stage_footprint(stage, plan.actions[k], k, mode[k], micro_batches, 1, plan.split_backward,
                               optimizer_bytes_per_param=optimizer_bytes_per_param).total

    S = [0.0]
    for t in time_per_layer:
        S.append(S[-1] + t)
    found = min_max_split(n, p, lambda i, j, k: float("inf") if _over(need(i, j, k), memory_cap) else S[j] - S[i])
    if found is None:
        smallest = min_max_split(n, p, need)[0]
        recomputing = all(m == "all" for m in mode)
        raise ValueError(f"no split of {n} layers over {p} device{'s' if p != 1 else ''} keeps every device within "
                         f"memory_cap={_size(memory_cap)} under {schedule} with {micro_batches} micro-batch"
                         f"{'es' if micro_batches != 1 else ''}: the smallest cap that fits is {_size(smallest)}; "
                         "raise the cap" + (" or use more devices" if recomputing else
                                            ", use more devices, or recompute activations (recompute='all')"))
    return to_placement(model, found[1], devs)


V_CANDIDATES_MAX = 2_000_000     # cut choices a V balance tries one by one (the course's models: under 100,000)


def balance_v(costs_per_layer: Sequence[float], p: int, names: Sequence[str] | None = None,
              fits=lambda sizes: True) -> list[int]:
    """Layer counts of the 2p stages of a V shape (stage s on device min(s, 2p - 1 - s)), e.g. [2, 1, 1, 2]:
    the split whose busiest device, stage r and stage 2p - 1 - r together, is the least busy. A device's two
    stages are not neighbours, so the contiguous dynamic program of `balance` does not apply; every choice of
    the 2p - 1 cuts is tried, cheapest first while `fits(sizes)` says no (a memory cap)."""
    from itertools import combinations
    n = len(costs_per_layer)
    names = list(names) if names is not None else [f"layer {k}" for k in range(n)]
    _check(costs_per_layer, "costs_per_layer", names)
    if not isinstance(p, int) or p < 1 or 2 * p > n:
        raise ValueError(f"a V shape on {p!r} devices needs {2 * p if isinstance(p, int) else 'twice as many'} "
                         f"stages of at least one layer, and the model has {n} layers: use p <= {n // 2}")
    count = math.comb(n - 1, 2 * p - 1)
    if count > V_CANDIDATES_MAX:
        raise ValueError(f"a V shape of {n} layers on {p} devices has {count:,} ways to cut: too many to try; "
                         "write the sizes by hand (Placement.v_shape(model, devices, sizes=...))")
    S = [0.0]
    for c in costs_per_layer:
        S.append(S[-1] + c)

    def cost(cuts) -> float:
        bounds = (0, *cuts, n)
        stage = [S[b] - S[a] for a, b in zip(bounds, bounds[1:])]
        return max(stage[r] + stage[2 * p - 1 - r] for r in range(p))

    ranked = sorted(combinations(range(1, n), 2 * p - 1), key=cost)
    for cuts in ranked:
        bounds = (0, *cuts, n)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        if fits(sizes):
            return sizes
    raise ValueError(f"no V shape of {n} layers over {p} devices fits")


def balance_v_by_time(model, batch, devices, micro_batches: int = 1, memory_cap: float | None = None,
                      costs: Costs | None = None, schedule: str = "gpipe", recompute=None,
                      optimizer_bytes_per_param: float = 0.0, **profile_args) -> Placement:
    """`balance_by_time` for the V shape (Placement.v_shape): 2p stages, device r holding stages r and 2p - 1 - r,
    the busiest device as little busy as possible; with `memory_cap`, the fastest whose every device's footprint
    under `schedule` (device_footprints: the step's peak, both stages together) fits. Tied embed and decode
    weights are fine: both sit on device 0."""
    from .footprint import device_footprints
    devs = _devices(devices)
    if costs is None:
        costs = profile(model, batch, devs[0], micro_batches=micro_batches, **profile_args)
    time_per_layer = [f + b for f, b in zip(costs.forward, costs.backward)]
    cap = None if memory_cap is None else parse_size(memory_cap)
    need = {}

    def fits(sizes) -> bool:
        if cap is None:
            return True
        placement = Placement.v_shape(model, devs, sizes)
        plan = schedules.make(schedule, placement.stage_devices, micro_batches)
        need[tuple(sizes)] = max(f.total for f in device_footprints(costs, placement, plan, recompute=recompute,
                                 optimizer_bytes_per_param=optimizer_bytes_per_param))
        return not _over(need[tuple(sizes)], cap)
    try:
        sizes = balance_v(time_per_layer, len(devs), costs.names, fits)
    except ValueError as e:
        if not need:
            raise
        raise ValueError(f"no V shape of {len(costs.names)} layers over {len(devs)} devices keeps every device "
                         f"within memory_cap={_size(cap)} under {schedule} with {micro_batches} micro-batch"
                         f"{'es' if micro_batches != 1 else ''}: the smallest footprint is {_size(min(need.values()))};"
                         " raise the cap, use more micro-batches, or recompute activations") from e
    return Placement.v_shape(model, devs, sizes)


def balance_by_params(model, devices) -> Placement:
    """Split so the device holding the most parameters holds as few as possible (a proxy for
    compute that needs no profiling, blind to what each layer does with its weights)."""
    devs = _devices(devices)
    _refuse_tied(model, len(devs))
    sizes = [sum(p.numel() for p in model.layers[name].parameters()) for name in model.layer_names]
    return to_placement(model, balance(sizes, len(devs), names=model.layer_names), devs)


def _devices(devices) -> list:
    return get_devices(devices) if isinstance(devices, int) else [get_device(d) for d in devices]


def _refuse_tied(model, p: int) -> None:
    if p > 1 and getattr(model.config, "tie_weights", False):
        raise ValueError("the model ties embed and decode weights, so both must sit on one device, which no "
                         f"contiguous split over {p} devices allows; build it with tie_weights=False "
                         "or write the placement by hand")
