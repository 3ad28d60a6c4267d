"""Predict a pipeline step: play a schedule with per-stage costs and a link model into a Timeline."""
from __future__ import annotations

from dataclasses import replace
from numbers import Real
from typing import Mapping, Sequence

from ..core import schedules
from ..core.recompute import recompute_modes, recomputes
from ..core.schedules import Schedule, ScheduleError
from ..core.timeline import Event, Timeline
from ..lm import check_sizes
from ..runtime.link import Channel, Link
from .costcurve import CostCurve
from .footprint import output_grad_bytes, peak_held, unit_bytes
from .profiling import Costs, StageCost


def simulate(schedule, costs, placement=None, *, micro_batches: int | Sequence[int] | None = None,
             chunks: int | None = None, link: Link | str | None = None,
             speed: Mapping[str, float] | Sequence[float] | None = None, cores: float | None = None,
             devices: Sequence[str] | None = None, recompute=None, overlap: bool = False) -> Timeline:
    """Play `schedule` with `costs` and return the predicted Timeline (source "predicted").

        simulate(pipe, profile(model, batch, micro_batches=4))          # a Pipeline's own plan
        simulate(schedule, costs, placement)                            # per-layer Costs + Placement
        simulate("1f1b", [1.0] * 8, micro_batches=32)                   # what would 8 GPUs do?
        simulate("1f1b", costs, placement, micro_batches=[8, 16, 24, 16])   # unequal micro-batches

    schedule: a Schedule, a Pipeline (its schedule, placement, link and recompute), or a
    schedule name (then `micro_batches` is needed, `chunks` for wavefront, and stage s
    sits on device s unless a placement says otherwise). A Schedule brings its own
    micro-batch and chunk counts: a different micro_batches= or chunks= is refused.
    costs: per-layer `Costs` (grouped into stages by the placement) or one entry per
    stage: a StageCost, or a number x meaning F = x, B + W = 2x. Costs are for one
    micro-batch of the whole sequence: with c time chunks each chunk's action takes
    1/c of them (so profile the full-length micro-batch, not one chunk).
    micro_batches: a count m, or a list of sizes (sentences per micro-batch, side by side) for micro-batches
    of unequal widths (a Pipeline's own by default); each micro-batch's actions then cost its own width:
        per-layer Costs      read at each width in proportion to the sequences, from the width they were
                             profiled at (CostCurve([costs], []).at: one profile, scaled per sequence)
        a CostCurve          read at each width, at its width profiles' length T0, with the schedule's chunks
        a list of Costs      one per micro-batch, as given (e.g. [curve.at(T, b) for b in sizes])
        per-stage costs      those of a micro-batch of the mean width, scaled in proportion
    and the boxes of the timeline have each micro-batch's own length (Timeline.micro_batch_sizes says them).
    speed: relative speed per device (by name or index); 0.5 is a device twice as
    slow, whose every action takes twice as long.
    cores: for virtual devices sharing a CPU, how many run at full speed at once
    (os.cpu_count(), or mpedu.predict.cores.measure_cores()); while n > 1 devices compute, each
    runs at min(1, cores / n) of its speed. None: devices never slow each other.
    link: a Link, or text for Link.parse ("pcie4", "10gbe/100"); None is the shared-memory
    default. Charged as the Pipeline charges it: the sender goes on, the receiver waits,
    and transfers in one direction between two devices queue for the bandwidth (see Link).
    Device names come from the placement, else `devices`, else gpu:0 … gpu:p-1.
    recompute: as for Pipeline (None, "all", "all-but-last", {stage: mode}; a Pipeline's own by
    default). A recomputed micro-batch's backward first runs the forward again: its B costs B + F,
    drawn as an "R" event (the forward's share) followed by the B; its first forward (autograd on,
    keeping nothing) costs the forward.
    Events carry the activation bytes they add or free (Event.memory, from the costs' activation
    bytes, as mpedu.predict.footprint counts them): the predicted timeline's peak_memory is the model's. With time
    chunks a chunk is charged 1/chunks of the costs' bytes; a chunk keeps more than its share (its state
    comes in), so give costs whose chunks were weighed, CostCurve.at(T, b, chunks), as the planner does.
    overlap: play each overlapped pair (Schedule.overlapped, DualPipeV's F || B) as a GPU would at best: one box
    that starts once both actions' inputs are in, lasts max(F, B) (the shorter one wholly hidden behind the
    longer, as two CUDA streams could), and sends both outputs at its end, as DeepSeek's DualPipe runs its
    overlapped chunk. Drawn as F then B inside the box, each a share in proportion to its cost. A prediction
    only: mpedu's engine (virtual devices, CPU threads) runs the pair one after the other, as overlap=False
    does. No pairs, no change; overlap_saving compares the two.
    """
    sizes = None
    if isinstance(micro_batches, (list, tuple)):
        sizes = check_sizes(micro_batches)
        micro_batches = len(sizes)
    if hasattr(schedule, "schedule") and hasattr(schedule, "placement"):   # a Pipeline
        if _per_layer(costs) is not None and hasattr(schedule, "model"):
            _per_layer(costs).check_model(schedule.model)
        if sizes is None and micro_batches is None:
            sizes = getattr(schedule, "micro_batch_sizes", None)
        placement = placement if placement is not None else schedule.placement
        recompute = recompute if recompute is not None else getattr(schedule, "recompute", None)
        link = link if link is not None else getattr(schedule, "link", None)
        schedule = schedule.schedule
    if not isinstance(schedule, (str, Schedule)):
        raise TypeError(f"simulate's schedule: give a name such as 'gpipe', a Schedule or a Pipeline, got {schedule!r}")
    per_layer = _per_layer(costs)
    if per_layer is not None:
        if placement is None:
            raise ValueError("per-layer Costs need the placement to group layers into stages: "
                             "simulate(pipe, costs) or simulate(schedule, costs, placement)")
        stage_costs = per_layer.stages(placement)      # (a CostCurve's, or a list's, are read per micro-batch below)
    else:
        given = f"text {costs!r}" if isinstance(costs, str) else type(costs).__name__
        try:
            costs = [] if isinstance(costs, (str, bytes)) else list(costs)   # text is no list of costs
        except TypeError:
            costs = []
        if not costs:
            raise ValueError(f"costs: give per-layer Costs (mpedu.predict.profiling) or one cost per stage, e.g. [1.0, 1.0]; "
                             f"got an empty or unusable {given}")
        stage_costs = [_stage_cost(s, c) for s, c in enumerate(costs)]
    if isinstance(schedule, str):
        if micro_batches is None:
            raise ValueError(f"simulate({schedule!r}, ...) needs micro_batches=m to build the schedule")
        stage_devices = placement.stage_devices if placement is not None else list(range(len(stage_costs)))
        schedule = schedules.make(schedule, stage_devices, micro_batches, 1 if chunks is None else chunks)
    else:
        schedule.check_counts(micro_batches, chunks)
        schedule.validated()       # hand-built or edited since its last check: what a Pipeline would refuse, refused here
    if placement is not None and list(schedule.stage_devices) != placement.stage_devices:
        raise ValueError(f"schedule {schedule.name!r} was built for stage devices {list(schedule.stage_devices)}, "
                         f"but the placement {placement} gives {placement.stage_devices}; build the schedule "
                         "from placement.stage_devices")
    if len(stage_costs) != schedule.num_stages:
        raise ValueError(f"{len(stage_costs)} stage costs for a schedule with {schedule.num_stages} stages "
                         f"(stage devices {list(schedule.stage_devices)}); give one cost per stage")
    if placement is not None:
        names = [d.name for d in placement.devices]
    else:
        names = list(devices) if devices is not None else [f"gpu:{d}" for d in range(schedule.num_devices)]
    if len(names) != schedule.num_devices:
        raise ValueError(f"{len(names)} device names {names} for a schedule on {schedule.num_devices} devices")
    if cores is not None and not cores > 0:
        raise ValueError(f"cores={cores}: give a positive number of cores, or None for independent devices")
    modes = recompute_modes(recompute, schedule.num_stages)
    each = _per_micro_batch(costs, stage_costs, placement, sizes, schedule)
    timeline = _play(schedule, stage_costs, names, Link.parse(link), _speeds(speed, names), cores, modes, each,
                     schedule.overlapped if overlap else frozenset())
    timeline.micro_batch_sizes = sizes
    return timeline


def _per_layer(costs) -> Costs | None:
    """The per-layer Costs in `costs` (a Costs, a CostCurve's first profile, a list of Costs' first), else None."""
    if isinstance(costs, Costs):
        return costs
    if isinstance(costs, CostCurve):
        return costs.widths[0]
    if isinstance(costs, (list, tuple)) and costs and all(isinstance(c, Costs) for c in costs):
        return costs[0]
    return None


def _per_micro_batch(costs, stage_costs: list[StageCost], placement, sizes, schedule: Schedule):
    """Each micro-batch's StageCosts at its own width (see simulate), or None when every one costs `stage_costs`."""
    m = schedule.micro_batches          # (sizes, when given, are m: the schedule was checked against their count)
    if isinstance(costs, CostCurve):
        if sizes is None:
            raise ValueError("a CostCurve holds costs at several widths: give the micro-batches' sizes "
                             "(micro_batches=[8, 16, 24, 16]), or read it at one shape yourself, curve.at(T, b)")
        at = {b: costs.at(costs.T0, b, schedule.chunks).stages(placement) for b in set(sizes)}
        return [at[b] for b in sizes]
    if isinstance(costs, (list, tuple)) and costs and all(isinstance(c, Costs) for c in costs):
        if len(costs) != m:
            raise ValueError(f"{len(costs)} per-layer Costs for {m} micro-batches: give one Costs per micro-batch "
                             "(each profiled at its own width), or one Costs for all")
        return [c.stages(placement) for c in costs]
    if sizes is None:
        return None
    if isinstance(costs, Costs):
        T0, b0 = costs.micro_batch
        if b0 < 1:
            raise ValueError(f"these Costs do not say the micro-batch width they were measured at (micro_batch="
                             f"{costs.micro_batch}), so they cannot be read at the sizes {list(sizes)}; profile them")
        curve = CostCurve([costs], [])
        at = {b: stage_costs if b == b0 else curve.at(max(T0, 1), b).stages(placement) for b in set(sizes)}
        return [at[b] for b in sizes]
    mean = sum(sizes) / m
    if len(set(sizes)) == 1:
        return None
    at = {b: [_scaled(c, b / mean) for c in stage_costs] for b in set(sizes)}
    return [at[b] for b in sizes]


def _scaled(c: StageCost, factor: float) -> StageCost:
    """A stage's cost for a micro-batch `factor` times as wide: its times and activations in proportion."""
    times = {k: getattr(c, k) * factor for k in ("forward", "backward", "backward_input", "backward_weight")}
    sizes = {k: round(getattr(c, k) * factor) for k in ("output_bytes", "activation_bytes", "input_bytes",
                                                          "input_saved_bytes")}
    return replace(c, **times, **sizes)


def _stage_cost(s: int, cost) -> StageCost:
    """Stage s's cost: a StageCost, or a number of seconds (F = x, B + W = 2x)."""
    if isinstance(cost, StageCost):
        return cost
    if isinstance(cost, bool) or not isinstance(cost, Real):
        raise ValueError(f"costs[{s}]={cost!r}: give each stage's cost as a number of seconds (its forward) or a "
                         "StageCost, e.g. [1.0, 1.0]")
    return StageCost(float(cost))


def _speeds(speed, names: list[str]) -> list[float]:
    if speed is None:
        return [1.0] * len(names)
    if isinstance(speed, Mapping):
        unknown = [k for k in speed if k not in names]
        if unknown:
            raise ValueError(f"speed names device {unknown[0]!r}, which is not in this plan ({', '.join(names)})")
        factors = [speed.get(n, 1.0) for n in names]
        if not all(isinstance(x, Real) and not isinstance(x, bool) for x in factors):
            raise ValueError(f"speed={speed!r}: give {{device name: number}}, e.g. {{'gpu:1': 0.5}} (twice as slow)")
        factors = [float(x) for x in factors]
    elif isinstance(speed, Real):
        factors = [float(speed)] * len(names)
    else:
        if isinstance(speed, (str, bytes)) or not all(isinstance(x, Real) and not isinstance(x, bool)
                                                       for x in _items(speed)):
            raise ValueError(f"speed={speed!r}: give one number for every device (0.5: twice as slow), a list of "
                             "one per device, or {device name: number}")
        factors = [float(x) for x in speed]
        if len(factors) != len(names):
            raise ValueError(f"{len(factors)} speed factors for {len(names)} devices; give one per device")
    bad = [(n, f) for n, f in zip(names, factors) if not f > 0]
    if bad:
        raise ValueError(f"device {bad[0][0]} has speed {bad[0][1]}; speeds are positive (1 = as profiled, "
                         "0.5 = twice as slow)")
    return factors


def _items(values) -> list:
    try:
        return list(values)
    except TypeError:
        return [values]


def _play(schedule: Schedule, stage_costs: list[StageCost], names: list[str], link: Link,
          speed: list[float], cores: float | None = None, modes=None, each=None, pairs=frozenset()) -> Timeline:
    """Time every action (schedules.run_order, or _run_shared when devices share cores or
    transfers may queue) and turn that into events.

    An action's time is its stage cost / time chunks / the device's speed. A tensor
    crossing devices reaches the receiver when the link's Channel for that direction
    says: link.time(bytes) after the send on an idle link, later behind earlier
    transfers. F's activation goes to stage s+1, B's input gradient (same size as
    stage s-1's output) to stage s-1. `each`: per micro-batch, its own StageCosts (unequal widths); None:
    `stage_costs` for every one. `pairs`: the (device, position) of overlapped pairs to play as one box.
    """
    split, chunks, sd = schedule.split_backward, schedule.chunks, schedule.stage_devices
    n, inf, m = schedule.num_stages, float("inf"), schedule.micro_batches
    each = each or [stage_costs] * m

    def seconds(costs):
        """Seconds per action kind and stage on its own device, before the speed factor."""
        return {"F": [c.forward / chunks for c in costs],
                "B": [(c.backward_input if s in split else c.backward) / chunks for s, c in enumerate(costs)],
                "W": [c.backward_weight / chunks for c in costs]}
    tables: dict = {}                   # one table per distinct StageCosts list: micro-batches of a width share it
    per_kind = [tables.setdefault(id(costs), seconds(costs)) for costs in each]       # [mb][kind][stage]

    def outgoing(a):
        """(receiving stage, bytes per time chunk) of the tensor `a` sends to another stage, else None."""
        peer = a.stage + 1 if a.kind == "F" else a.stage - 1 if a.kind == "B" else -1
        return (peer, int(each[a.mb][min(a.stage, peer)].output_bytes / chunks)) if 0 <= peer < n else None

    recomputed = (lambda a: recomputes(modes[a.stage], a.mb, m)) if modes and any(modes) else (
        lambda a: False)                                            # noqa: E731

    def rerun(a):
        return a.kind == "B" and recomputed(a)

    def cost(d, a):
        # a recomputed micro-batch's B runs its forward again first (its F kept nothing: the same F again)
        own = per_kind[a.mb][a.kind][a.stage] + (per_kind[a.mb]["F"][a.stage] if rerun(a) else 0.0)
        return own / speed[d]

    arrivals: dict = {}                                            # sending action -> when its tensor lands
    sent: dict = {}                                                # sending action -> when its tensor leaves
    if not pairs and link.bandwidth_Bps == inf and (cores is None or cores >= schedule.num_devices):
        # Without a bandwidth limit transfers never queue: each lands link.time(bytes) after its send.
        # The tensor an action waits for: F(s) gets stage s-1's output, B(s) the gradient of stage s's output.
        def landing(costs):
            return {"F": [0.0] + [link.time(costs[s - 1].output_bytes / chunks) for s in range(1, n)],
                    "B": [link.time(c.output_bytes / chunks) for c in costs], "W": [0.0] * n}
        lands: dict = {}
        recv = [lands.setdefault(id(costs), landing(costs)) for costs in each]          # [mb][kind][stage]
        played = schedules.run_order(schedule, cost, lambda a: recv[a.mb][a.kind][a.stage])
    else:
        channels: dict = {}                                        # (from device, to device) -> Channel

        def send(d, a, end):
            out = outgoing(a)
            if out is None or sd[out[0]] == d:
                return None
            channel = channels.setdefault((d, sd[out[0]]), Channel(link))
            sent[a], arrivals[a] = end, channel.arrival(end, out[1])
            return arrivals[a]

        played = _run_shared(schedule, cost, None, inf if cores is None else cores, send=send, pairs=pairs)
    timeline = Timeline(list(names), source="predicted")
    events = timeline.events
    # activation bytes each action adds or frees (mpedu.predict.footprint's units), so that the predicted timeline's
    # memory_over_time and peak_memory are the memory model's
    sizes = unit_bytes(stage_costs, modes or [None] * n, m, chunks, per_micro_batch=[(c, None) for c in each])

    def change(a) -> int:
        kept, full = (round(x) for x in sizes(a.stage, a.mb, a.chunk))
        grad = round(output_grad_bytes(each[a.mb][a.stage]))      # split: B keeps the output's gradient for W
        if a.kind == "F":
            return kept
        if a.kind == "B" and a.stage not in split:
            return -full
        return grad if a.kind == "B" else -(full + grad)

    for d, a, start, end in played:
        if rerun(a):           # the R part takes the forward's share of the action's time
            f, b = per_kind[a.mb]["F"][a.stage], per_kind[a.mb]["B"][a.stage]
            split_at = start + (end - start) * (f / (f + b) if f + b > 0 else 0.0)
            kept, full = (round(x) for x in sizes(a.stage, a.mb, a.chunk))
            events.append(Event(names[d], "R", a.stage, a.mb, start, split_at, a.chunk, memory=full - kept))
            start = split_at
        events.append(Event(names[d], a.kind, a.stage, a.mb, start, end, a.chunk, memory=change(a)))
        out = outgoing(a)
        if out is not None and sd[out[0]] != d:
            peer, nbytes = out
            events.append(Event(names[d], "send", a.stage, a.mb, sent.get(a, end),
                                arrivals.get(a, end + link.time(nbytes)), a.chunk, nbytes, names[sd[peer]]))
    return timeline


def _run_shared(schedule: Schedule, cost, link, cores: float, send=None,
                pairs=frozenset()) -> list[tuple[int, object, float, float]]:
    """Like schedules.run_order, but devices share `cores` processors: while n devices compute, each
    progresses at min(1, cores / n) seconds of work per second (processor sharing; alone, at 1).
    Steps from event to event: an action finishing, or one becoming ready to start.

    A dependency from another device is usable `link(action)` seconds after it ends, or, with
    `send(device, action, end) -> arrival`, when send says: it is called as each action ends,
    in time order, so a Channel can queue the transfers (None: the action sends nothing).
    `pairs`: (device, position) of overlapped pairs, each played as one box (see simulate's overlap)."""
    p, inf = schedule.num_devices, float("inf")
    done: dict = {}                                     # action -> (device, end, arrival elsewhere or None)
    free, pos = [0.0] * p, [0] * p
    current: list = [None] * p                          # [actions, start, work left in seconds, each one's work]
    played, now = [], 0.0
    total = sum(len(row) for row in schedule.actions)
    while len(played) < total:
        next_ready = inf
        for d in range(p):
            if current[d] is not None or pos[d] == len(schedule.actions[d]):
                continue
            group = schedule.actions[d][pos[d]:pos[d] + (2 if (d, pos[d]) in pairs else 1)]
            deps = [(a, dep) for a in group for dep in schedule.dependencies(a)]
            if any(dep not in done for _, dep in deps):
                continue
            ready = max([free[d]] + [end if src == d else arrival if arrival is not None else end + link(a)
                                     for a, (src, end, arrival) in ((a, done[dep]) for a, dep in deps)])
            if ready <= now:
                work = [cost(d, a) for a in group]
                current[d] = [group, now, max(work), work]
            else:
                next_ready = min(next_ready, ready)
        busy = [d for d in range(p) if current[d] is not None]
        if not busy and next_ready == inf:
            schedules.run_order(schedule)               # raises ScheduleError, naming the deadlock
            # (not for a validated schedule: whatever a pair's B waits for that needs its F runs between the two)
            raise ScheduleError(f"{schedule.name!r} deadlocks under overlap=True; play it with overlap=False")
        # one device alone runs as profiled; cores < 1 (two workers do less than one) is a real measurement
        rate = min(1.0, cores / len(busy)) if len(busy) > 1 else 1.0
        finish = min((current[d][2] / rate for d in busy), default=inf)
        step = min(finish, next_ready - now)
        now += step
        for d in busy:
            current[d][2] -= step * rate
            if current[d][2] <= 1e-12 * max(1.0, now):    # finished (up to rounding)
                group, start, _, work = current[d]
                for k, a in enumerate(group):           # a pair's box drawn F then B, in proportion to their costs
                    end = now if k == len(group) - 1 else start + (now - start) * work[k] / (sum(work) or 1.0)
                    played.append((d, a, start, end))
                    start = end
                for a in group:                         # a pair sends both outputs as its box ends
                    done[a] = (d, now, send(d, a, now) if send is not None else None)
                free[d] = now
                pos[d] += len(group)
                current[d] = None
    played.sort(key=lambda x: (x[2], x[0]))
    return played


def peak_in_flight(timeline: Timeline, stage_bytes: Sequence[float] | None = None) -> dict[str, float]:
    """Per device, the most micro-batches whose activations were held at once (measured or
    predicted timeline). A stage's micro-batch is held from its F until its last backward
    action (W when the stage splits its backward, else B). With `stage_bytes` (per stage,
    e.g. StageCost.activation_bytes) the peak is in bytes instead of a count.

    GPipe holds all m on every device; 1F1B holds at most p - s on stage s.
    """
    split = {e.stage for e in timeline.events if e.kind == "W"}
    weight = (lambda s, mb, chunk: (1.0, 1.0)) if stage_bytes is None else (     # noqa: E731
        lambda s, mb, chunk: (float(stage_bytes[s]),) * 2)
    return {d: peak_held(timeline.compute(d), weight, split)[0] for d in timeline.devices}
