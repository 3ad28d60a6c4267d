"""Predict a pipeline step: play a schedule with per-stage costs and a link model into a Timeline."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from numbers import Real
from typing import Mapping, Sequence

from . import schedules
from .profile import Costs, StageCost
from .schedules import Schedule
from .timeline import Event, Timeline


@dataclass(frozen=True)
class Link:
    """Time to hand a tensor to another device: latency_s + bytes / bandwidth_Bps.

    The default is two virtual devices on one CPU (a queue hand-off, no copy).
    Typical numbers for GPUs: PCIe 4.0 x16 about 25e9 B/s, NVLink 3 about 300e9 B/s,
    each with a latency of around 10e-6 s. A transfer does not hold up the sender
    (GPUs copy on their own engines); the receiver waits for it to land.
    """

    latency_s: float = 20e-6
    bandwidth_Bps: float = float("inf")

    def time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    @classmethod
    def fit(cls, timeline: Timeline) -> "Link":
        """Calibrate from a measured timeline: the latency is the median delay between an
        action's end and the start of the action on another device that was waiting for it;
        the bandwidth comes from the send durations when their sizes differ (else infinite)."""
        ends = {(e.kind, e.stage, e.mb, e.chunk): e for e in timeline.compute()}
        previous_end = {}
        for d in timeline.devices:
            boxes = timeline.compute(d)
            previous_end.update({(e.kind, e.stage, e.mb, e.chunk): a.end for a, e in zip(boxes, boxes[1:])})
        gaps = []
        for key, e in ends.items():
            kind, s, i, c = key
            dep = ends.get(("F", s - 1, i, c)) if kind == "F" else ends.get(("B", s + 1, i, c)) if kind == "B" else None
            if dep is not None and dep.device != e.device and previous_end.get(key, 0.0) <= dep.end:
                gaps.append(e.start - dep.end)   # the receiver sat idle until the data came
        if not gaps:
            raise ValueError("the timeline has no action that waited for another device; "
                             "fit a Link on a measured multi-device step")
        bandwidth = float("inf")
        sends = timeline.transfers()
        if len({e.bytes for e in sends}) > 1:
            n = len(sends)
            mx, my = sum(e.bytes for e in sends) / n, sum(e.duration for e in sends) / n
            cov = sum((e.bytes - mx) * (e.duration - my) for e in sends)
            var = sum((e.bytes - mx) ** 2 for e in sends)
            if cov > 0:
                bandwidth = var / cov
        return cls(max(statistics.median(gaps), 0.0), bandwidth)


def simulate(schedule, costs, placement=None, *, micro_batches: int | None = None, chunks: int = 1,
             link: Link | None = None,
             speed: Mapping[str, float] | Sequence[float] | None = None, cores: float | None = None,
             devices: Sequence[str] | None = None) -> Timeline:
    """Play `schedule` with `costs` and return the predicted Timeline (source "predicted").

        simulate(pipe, profile(model, batch, micro_batches=4))          # a Pipeline's own plan
        simulate(schedule, costs, placement)                            # per-layer Costs + Placement
        simulate("1f1b", [1.0] * 8, micro_batches=32)                   # what would 8 GPUs do?

    schedule: a Schedule, a Pipeline, or a schedule name (then `micro_batches` is
    needed, `chunks` for wavefront, and stage s sits on device s unless a placement
    says otherwise).
    costs: per-layer `Costs` (grouped into stages by the placement) or one entry per
    stage: a StageCost, or a number x meaning F = x, B + W = 2x. Costs are for one
    micro-batch of the whole sequence: with c time chunks each chunk's action takes
    1/c of them (so profile the full-length micro-batch, not one chunk).
    speed: relative speed per device (by name or index); 0.5 is a device twice as
    slow, whose every action takes twice as long.
    cores: for virtual devices sharing a CPU, how many run at full speed at once
    (os.cpu_count(), or profile.measure_cores()); while n > 1 devices compute, each
    runs at min(1, cores / n) of its speed. None: devices never slow each other.
    Device names come from the placement, else `devices`, else gpu:0 … gpu:p-1.
    """
    if hasattr(schedule, "schedule") and hasattr(schedule, "placement"):   # a Pipeline
        placement = placement if placement is not None else schedule.placement
        schedule = schedule.schedule
    if isinstance(costs, Costs):
        if placement is None:
            raise ValueError("per-layer Costs need the placement to group layers into stages: "
                             "simulate(pipe, costs) or simulate(schedule, costs, placement)")
        stage_costs = costs.stages(placement)
    else:
        stage_costs = [c if isinstance(c, StageCost) else StageCost(float(c)) for c in costs]
    if isinstance(schedule, str):
        if micro_batches is None:
            raise ValueError(f"simulate({schedule!r}, ...) needs micro_batches=m to build the schedule")
        stage_devices = placement.stage_devices if placement is not None else list(range(len(stage_costs)))
        schedule = (schedules.make(schedule, stage_devices, micro_batches) if chunks == 1
                    else schedules.make(schedule, stage_devices, micro_batches, chunks=chunks))
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
    return _play(schedule, stage_costs, names, link or Link(), _speeds(speed, names), cores)


def _speeds(speed, names: list[str]) -> list[float]:
    if speed is None:
        return [1.0] * len(names)
    if isinstance(speed, Mapping):
        unknown = [k for k in speed if k not in names]
        if unknown:
            raise ValueError(f"speed names device {unknown[0]!r}, which is not in this plan ({', '.join(names)})")
        factors = [float(speed.get(n, 1.0)) for n in names]
    elif isinstance(speed, Real):
        factors = [float(speed)] * len(names)
    else:
        factors = [float(x) for x in speed]
        if len(factors) != len(names):
            raise ValueError(f"{len(factors)} speed factors for {len(names)} devices; give one per device")
    bad = [(n, f) for n, f in zip(names, factors) if not f > 0]
    if bad:
        raise ValueError(f"device {bad[0][0]} has speed {bad[0][1]}; speeds are positive (1 = as profiled, "
                         "0.5 = twice as slow)")
    return factors


def _play(schedule: Schedule, stage_costs: list[StageCost], names: list[str], link: Link,
          speed: list[float], cores: float | None = None) -> Timeline:
    """Time every action (schedules.run_order, or _run_shared when devices share cores) and turn that into events.

    An action's time is its stage cost / time chunks / the device's speed. A tensor
    crossing devices delays the receiver by link.time(bytes): F's activation goes to
    stage s+1, B's input gradient (same size as stage s-1's output) to stage s-1.
    """
    split, chunks, sd = schedule.split_backward, schedule.chunks, schedule.stage_devices
    n = schedule.num_stages
    # Seconds per action kind and stage on its own device, before the speed factor.
    per_kind = {"F": [c.forward / chunks for c in stage_costs],
                "B": [(c.backward_input if s in split else c.backward) / chunks for s, c in enumerate(stage_costs)],
                "W": [c.backward_weight / chunks for c in stage_costs]}
    # The tensor an action waits for from another device: F(s) gets stage s-1's output,
    # B(s) gets the gradient of stage s's output; bytes per time chunk.
    recv = {"F": [0.0] + [link.time(stage_costs[s - 1].output_bytes / chunks) for s in range(1, n)],
            "B": [link.time(c.output_bytes / chunks) for c in stage_costs], "W": [0.0] * n}

    cost = lambda d, a: per_kind[a.kind][a.stage] / speed[d]      # noqa: E731
    link_time = lambda a: recv[a.kind][a.stage]                    # noqa: E731
    if cores is None or cores >= schedule.num_devices:
        played = schedules.run_order(schedule, cost, link_time)
    else:
        played = _run_shared(schedule, cost, link_time, cores)
    timeline = Timeline(list(names), source="predicted")
    events = timeline.events
    for d, a, start, end in played:
        events.append(Event(names[d], a.kind, a.stage, a.mb, start, end, a.chunk))
        peer = a.stage + 1 if a.kind == "F" else a.stage - 1 if a.kind == "B" else -1
        if 0 <= peer < n and sd[peer] != d:
            nbytes = int(stage_costs[min(a.stage, peer)].output_bytes / chunks)
            events.append(Event(names[d], "send", a.stage, a.mb, end, end + link.time(nbytes), a.chunk,
                                nbytes, names[sd[peer]]))
    return timeline


def _run_shared(schedule: Schedule, cost, link, cores: float) -> list[tuple[int, object, float, float]]:
    """Like schedules.run_order, but devices share `cores` processors: while n devices compute, each
    progresses at min(1, cores / n) seconds of work per second (processor sharing; alone, at 1).
    Steps from event to event: an action finishing, or one becoming ready to start."""
    p, inf = schedule.num_devices, float("inf")
    done: dict = {}                                     # action -> (device, end)
    free, pos = [0.0] * p, [0] * p
    current: list = [None] * p                          # [action, start, work left in seconds]
    played, now = [], 0.0
    total = sum(len(row) for row in schedule.actions)
    while len(played) < total:
        next_ready = inf
        for d in range(p):
            if current[d] is not None or pos[d] == len(schedule.actions[d]):
                continue
            a = schedule.actions[d][pos[d]]
            deps = schedule.dependencies(a)
            if any(dep not in done for dep in deps):
                continue
            ready = max([free[d]] + [end + (link(a) if src != d else 0.0) for src, end in map(done.get, deps)])
            if ready <= now:
                current[d] = [a, now, cost(d, a)]
            else:
                next_ready = min(next_ready, ready)
        busy = [d for d in range(p) if current[d] is not None]
        if not busy and next_ready == inf:
            schedules.run_order(schedule)               # raises ScheduleError, naming the deadlock
        # one device alone runs as profiled; cores < 1 (two workers do less than one) is a real measurement
        rate = min(1.0, cores / len(busy)) if len(busy) > 1 else 1.0
        finish = min((current[d][2] / rate for d in busy), default=inf)
        step = min(finish, next_ready - now)
        now += step
        for d in busy:
            current[d][2] -= step * rate
            if current[d][2] <= 1e-12 * max(1.0, now):    # finished (up to rounding)
                a, start, _ = current[d]
                done[a] = (d, now)
                free[d] = now
                pos[d] += 1
                played.append((d, a, start, now))
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
    split = {(e.stage, e.mb, e.chunk) for e in timeline.events if e.kind == "W"}
    peaks = {}
    for d in timeline.devices:
        held = peak = 0.0
        for e in timeline.compute(d):
            weight = 1.0 if stage_bytes is None else float(stage_bytes[e.stage])
            if e.kind == "F":
                held += weight
                peak = max(peak, held)
            elif e.kind == ("W" if (e.stage, e.mb, e.chunk) in split else "B"):
                held -= weight
        peaks[d] = peak
    return peaks

