"""Lower bounds on a plan's step time and peak memory: cheap enough to prune the planner's search."""
from __future__ import annotations

from ..core.schedules import Schedule


def held_units(schedule: Schedule) -> list[list[list[tuple[int, int]]]]:
    """Per device, the (micro-batch, chunk) units each of its stages holds just after each forward,
    as [(stage, units), ...] over the device's own stages, keeping only those no other one covers."""
    out = []
    for d, row in enumerate(schedule.actions):
        own = sorted({a.stage for a in row})
        held, seen = dict.fromkeys(own, 0), set()
        for a in row:
            if a.kind == "F":
                held[a.stage] += 1
                seen.add(tuple(held[s] for s in own))
            elif a.kind == "W" or a.stage not in schedule.split_backward:
                held[a.stage] -= 1
        top = [v for v in seen if not any(w != v and all(x >= y for x, y in zip(w, v)) for w in seen)]
        out.append([list(zip(own, v)) for v in top])
    return out


def memory_floor(stage_costs, stage_devices, held, recompute, chunks, optimizer_bytes_per_param=0.0,
                 smallest_chunk=None) -> int:
    """A cheap lower bound on the largest device's footprint (mpedu.predict.footprint has the real count):
    weights, gradients, optimizer state, and the units held after each forward at the bytes they keep
    (all of their activations, or with recomputation their input only). Without recomputation, with
    time chunks of equal length and no split backward (zero bubble also keeps each output's gradient
    from B to W), this is the peak. smallest_chunk: per stage, the StageCost of
    its smallest time chunk (chunks of unequal lengths: every unit counted at that one's bytes)."""
    def kept(s):
        c, share = (stage_costs[s], chunks) if smallest_chunk is None else (smallest_chunk[s], 1)
        return (c.activation_bytes if recompute is None else min(c.input_bytes, c.activation_bytes)) / share

    worst = 0.0
    for d, vectors in enumerate(held):
        trains = sum(c.trainable_bytes for s, c in enumerate(stage_costs) if stage_devices[s] == d)
        fixed = (sum(c.param_bytes for s, c in enumerate(stage_costs) if stage_devices[s] == d) + trains
                 + int(optimizer_bytes_per_param * trains))
        act = max((sum(units * kept(s) for s, units in v) for v in vectors), default=0.0)
        worst = max(worst, fixed + act)
    return int(worst)


def time_bound(schedule, stage_costs, p, cores, recompute) -> float:
    """A lower bound on the step time, from what must happen whatever the order:
    - device d cannot start before micro-batch 0 has gone forward through the stages before its first
      stage (head), must do all its work, and after its last fused backward the gradient must still go
      back through those stages (tail; 0 where a W may come last);
    - naive runs one micro-batch's whole trip after another: m trips;
    - devices sharing `cores` cores: all the work spread over them.
    Recomputation adds a forward per recomputed micro-batch (R). With time chunks the head, tail and
    trip are one chunk's (cost / chunks)."""
    split, m, chunks = schedule.split_backward, schedule.micro_batches, schedule.chunks
    again = {None: 0, "all": m, "all-but-last": m - 1}[recompute]
    work = [0.0] * p
    first = [None] * p
    for s, c in enumerate(stage_costs):
        d = schedule.stage_devices[s]
        back = c.backward_input + c.backward_weight if s in split else c.backward
        # m forwards and backwards, and a forward again (R) per recomputed micro-batch
        work[d] += m * (c.forward + back) + again * c.forward
        first[d] = s if first[d] is None else first[d]
    fwd = [0.0]                                         # fwd[s]: one chunk's forward through stages < s
    bwd = [0.0]
    for s, c in enumerate(stage_costs):
        fwd.append(fwd[-1] + c.forward / chunks)
        bwd.append(bwd[-1] + (c.backward_input if s in split else c.backward) / chunks)
    bound = 0.0
    for d in range(p):
        s = first[d]
        tail = bwd[s] if not split and schedule.name != "interleaved" else 0.0
        bound = max(bound, fwd[s] + work[d] + tail)
    bound = max(bound, fwd[-1] + bwd[-1])
    if schedule.name == "naive":
        trip = sum(c.forward + (c.backward_input if s in split else c.backward) for s, c in enumerate(stage_costs))
        bound = max(bound, m * trip / chunks + again * fwd[-1])     # and the recomputed forwards
    if cores is not None and cores < p:
        # simulate runs a device alone at full speed whatever `cores` says (cores < 1 is two workers doing
        # less than one between them, but never one worker slower than alone): the work needs at least
        # sum / max(1, cores)
        bound = max(bound, sum(work) / max(1.0, cores))
    return bound
