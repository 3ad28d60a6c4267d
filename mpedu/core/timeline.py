"""What every device did and when: actions and transfers, with derived bubble and idle time, pictures and traces."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from ..runtime.files import atomic_write


@dataclass(slots=True)     # not frozen: a frozen dataclass is 5x slower to build, and a step builds hundreds
class Event:
    """One box on a device's row. Times are seconds from the start of the step.

    kind is "F", "B" or "W" for compute ("R": a forward run again before its B, activation
    recomputation), "send" for a transfer to another device
    (drawn on the sender's row; `peer` names the receiver), "allreduce" for a data-parallel
    gradient all-reduce (mpedu.distributed; communication, so not busy time).
    """

    device: str
    kind: str
    stage: int
    mb: int
    start: float
    end: float
    chunk: int = 0
    bytes: int = 0
    peer: str = ""
    memory: int = 0     # change in activation bytes the device holds: + after F, - when B or W frees them

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        text = f"{self.stage}{self.kind}{self.mb}" if self.kind in "FRBW" else f"{self.kind}{self.mb}"
        return text if self.chunk == 0 else f"{text}.{self.chunk}"


COMPUTE = ("F", "R", "B", "W")
ALL_REDUCE = "allreduce"


KINDS = COMPUTE + ("send", ALL_REDUCE)


def _event(k: int, e, devices: list[str]) -> "Event":
    """Event k of a timeline's dict, each field checked (see Timeline.from_dict)."""
    fields = Event.__dataclass_fields__
    if not isinstance(e, dict) or set(e) - set(fields):
        raise ValueError(f"event {k} of the timeline is not an Event: {e!r} (fields: {', '.join(fields)})")
    missing = [name for name, f in fields.items() if name not in e and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"event {k} of the timeline is not an Event: it has no {missing[0]!r} (an Event needs "
                         f"{', '.join(n for n, f in fields.items() if f.default is dataclasses.MISSING)})")

    def bad(field: str, wants: str):
        return ValueError(f"event {k} of the timeline: {field}={e[field]!r}; it must be {wants}")

    if e["device"] not in devices:          # (a peer may be elsewhere: "rank:1" under torchrun)
        raise ValueError(f"event {k} is on device {e['device']!r}, which the timeline's devices {devices} do not list")
    if e["kind"] not in KINDS:
        raise bad("kind", f"one of {', '.join(KINDS)}")
    for name in ("stage", "mb", "chunk", "bytes", "memory"):
        value = e.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or (value < 0 and name != "memory"):
            raise bad(name, "a whole number" + ("" if name == "memory" else " >= 0"))
    for name in ("start", "end"):
        value = e[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, "a finite number of seconds")
    if e["end"] < e["start"]:
        raise bad("end", f"at or after its start {e['start']!r}")
    if not isinstance(e.get("peer", ""), str):
        raise bad("peer", "a device name, or '' for none")
    return Event(**e)


class Mark(NamedTuple):
    """A box or a transfer as a worker notes it during a step: its clock's marks, not yet seconds (turning
    them into an Event waits until someone reads the timeline, off the step's critical path)."""

    kind: str        # F, B, W, R or send
    stage: int       # the stage that ran it (a send: the stage that sent)
    action: object   # the schedule's Action (its micro-batch and chunk)
    start: object    # Clock.mark() values
    end: object
    nbytes: int = 0  # a send's bytes
    peer: str = ""   # a send's receiving device
    memory: int = 0  # bytes the box left held (negative: freed)

    def event(self, device: str, clock) -> Event:
        a = self.action
        return Event(device, self.kind, self.stage, a.mb, clock.seconds(self.start), clock.seconds(self.end),
                     a.chunk, self.nbytes, self.peer, self.memory)



# Mark((kind, stage, ...)) without NamedTuple's argument handling: a step notes hundreds of marks on its
# critical path, and this makes one in ~130 ns where Mark(kind, stage, ..., memory=m) takes ~330.
new_mark = functools.partial(tuple.__new__, Mark)


class Timeline:
    """A step's events on p devices, measured (by the Pipeline) or predicted (by the simulator).

    `micro_batch_sizes`: each micro-batch's width in sentences, when known (a Pipeline's step; a simulation
    given them), else None. The boxes' lengths already show them; a picture may label the micro-batches with them."""

    def __init__(self, devices: list[str], events: list[Event] | None = None, source: str = "measured",
                 micro_batch_sizes: tuple[int, ...] | None = None):
        self.devices = devices
        self.source = source          # "measured" or "predicted"
        self.micro_batch_sizes = micro_batch_sizes
        self._events: list[Event] = list(events or [])
        self._later: list = []        # callables, each returning events: a worker's marks, turned into events on demand

    @property
    def events(self) -> list[Event]:
        """Every event; a measured step's are built from its workers' marks at the first look (a step that
        nobody looks at never pays for them: hundreds of objects made and freed on its critical path)."""
        while self._later:
            self._events.extend(self._later.pop(0)())
        return self._events

    @events.setter
    def events(self, events: list[Event]) -> None:
        self._events, self._later = list(events), []

    def add(self, event: Event) -> None:
        self._events.append(event)    # list.append is atomic: workers may call this concurrently

    def add_later(self, build) -> None:
        """Add the events `build()` returns when the timeline is first read (build must not depend on
        anything that changes meanwhile: a worker hands its finished marks and its clock)."""
        self._later.append(build)

    def compute(self, device: str | None = None) -> list[Event]:
        if device is not None:
            self._known(device)
        return sorted((e for e in self.events if e.kind in COMPUTE and (device is None or e.device == device)),
                      key=lambda e: e.start)

    def _known(self, device) -> None:
        """A device name this timeline has (a typo would read as an idle device)."""
        if device not in self.devices:
            raise ValueError(f"this timeline has no device {device!r}; its devices are {', '.join(self.devices)}")

    def collectives(self) -> list[Event]:
        """The all-reduce boxes (data parallelism under torchrun), in time order."""
        return sorted((e for e in self.events if e.kind == ALL_REDUCE), key=lambda e: e.start)

    def transfers(self) -> list[Event]:
        return sorted((e for e in self.events if e.kind == "send"), key=lambda e: e.start)

    @property
    def makespan(self) -> float:
        """Seconds from the first action's start to the last action's end."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, device: str) -> float:
        """Seconds the device spent computing (F, B, W) in this step."""
        return sum(e.duration for e in self.compute(device))

    def idle(self, device: str) -> float:
        return self.makespan - self.busy(device)

    @property
    def bubble_fraction(self) -> float:
        """Share of device-time spent not computing: 1 - sum(busy) / (p * makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(d) for d in self.devices) / (len(self.devices) * span)

    def memory_over_time(self, device: str) -> list[tuple[float, int]]:
        """(time, activation bytes held) after each change on the device, starting at (0, 0)."""
        self._known(device)
        held, points = 0, [(0.0, 0)]
        for e in sorted((e for e in self.events if e.device == device and e.memory), key=lambda e: e.end):
            held += e.memory
            points.append((e.end, held))
        return points

    def peak_memory(self, device: str) -> int:
        """Most activation bytes the device held at once during the step."""
        return max(b for _, b in self.memory_over_time(device))

    @property
    def bytes_moved(self) -> int:
        return sum(e.bytes for e in self.transfers())

    def summary(self) -> str:
        """Plain text for the terminal: one line per device, then the totals."""
        span = self.makespan
        sizes = self.micro_batch_sizes
        unequal = f", micro-batches of {', '.join(map(str, sizes))} sentences" if sizes and len(set(sizes)) > 1 else ""
        lines = [f"{self.source} timeline: makespan {span * 1e3:.1f} ms, bubble {self.bubble_fraction:.1%}, "
                 f"{len(self.transfers())} transfers, {self.bytes_moved / 1e6:.2f} MB moved{unequal}"]
        chunked = any(e.chunk for e in self.compute())        # then chunk 0 is written too: 0F0.0, as schedules do
        for d in self.devices:
            busy = self.busy(d)
            acts = " ".join(e.label if e.chunk or not chunked else f"{e.label}.0" for e in self.compute(d))
            lines.append(f"  {d:>8}: busy {busy * 1e3:8.1f} ms ({busy / span if span else 0:.0%})  {acts}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Timeline({self.source}, devices={self.devices}, events={len(self.events)}, "
                f"makespan={self.makespan * 1e3:.1f} ms, bubble={self.bubble_fraction:.1%})")

    def to_dict(self) -> dict:
        sizes = {} if self.micro_batch_sizes is None else {"micro_batch_sizes": list(self.micro_batch_sizes)}
        return {"devices": self.devices, "source": self.source, **sizes, "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        """The Timeline `to_dict()` wrote; anything else is refused in one ValueError naming the event and
        the field (a hand-edited <stem>.timeline.json would otherwise fail far away, in a plot or a sum)."""
        if not isinstance(d, dict) or not {"devices", "events"} <= d.keys():
            raise ValueError("not a timeline: expected a dict with 'devices' and 'events', as to_dict() and "
                             "<stem>.timeline.json hold")
        devices, events = d["devices"], d["events"]
        if not isinstance(devices, list) or not all(isinstance(x, str) for x in devices):
            raise ValueError(f"the timeline's devices must be a list of device names such as ['vgpu:0', 'vgpu:1'], "
                             f"got {devices!r}")
        if not isinstance(events, list):
            raise ValueError(f"the timeline's events must be a list of events, got {type(events).__name__}")
        if not isinstance(d.get("source", "measured"), str):
            raise ValueError(f"the timeline's source must be text such as 'measured', got {d['source']!r}")
        sizes = d.get("micro_batch_sizes")
        if sizes is not None and not (isinstance(sizes, list) and sizes and all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes)):
            raise ValueError(f"the timeline's micro_batch_sizes must be a list of sentence counts such as [8, 16], "
                             f"got {sizes!r}")
        return cls(devices, [_event(k, e, devices) for k, e in enumerate(events)], d.get("source", "measured"),
                   None if sizes is None else tuple(sizes))

    def to_json(self, path) -> None:
        # temp file + rename, like a checkpoint: a symlink planted at `path` is replaced, not followed
        atomic_write(path, lambda f: json.dump(self.to_dict(), f), binary=False)

    # -- pictures and traces --------------------------------------------------------
    def plot(self, ax=None, *, title=None, time_unit="ms", show_transfers=True, xlim=None):
        """A Gantt chart: a row per device (device 0 on top), a box per action labelled with its
        micro-batch, coloured by kind; grey where the device sits idle; transfers as arrows.

        Returns the matplotlib Axes (its `.figure` displays in Jupyter). `xlim` is in `time_unit`.
        """
        from ..pictures.plot import plot_timeline  # matplotlib only when a picture is asked for
        return plot_timeline(self, ax, title=title, time_unit=time_unit, show_transfers=show_transfers,
                             xlim=xlim)

    def _send_tracks(self, tid: dict) -> tuple[dict, dict]:
        """Where each send goes in a trace: on its device's track when it overlaps nothing there, else on
        the first "<device> sends" track free at its start. ({id(send): track}, {device: [[track, free from]]})"""
        lane_of, lanes = {}, {d: [] for d in self.devices}
        kept = {d: [(c.start, c.end) for c in self.compute(d)] for d in self.devices}
        for e in self.transfers():
            if not any(e.start < end and start < e.end for start, end in kept[e.device]):
                kept[e.device].append((e.start, e.end))
                lane_of[id(e)] = tid[e.device]
                continue
            lane = next((lane for lane in lanes[e.device] if lane[1] <= e.start), None)
            if lane is None:
                lane = [len(tid) + sum(map(len, lanes.values())), e.start]
                lanes[e.device].append(lane)
            lane[1], lane_of[id(e)] = e.end, lane[0]
        return lane_of, lanes

    def chrome_trace(self) -> dict:
        """The timeline in the Trace Event Format that Perfetto (ui.perfetto.dev) and chrome://tracing open.

        One process, one track per device; actions and sends are complete ("X") events, each
        send also a flow arrow to the receiving track; activation memory is a counter per device.
        A send that overlaps its device's other slices (on an emulated link it lasts until its
        tensor lands, past the sender's next actions) goes on a track "<device> sends" below,
        one more per overlapping send: viewers drop slices that overlap without nesting.
        """
        us = 1e6   # the format counts microseconds
        tid = {d: i for i, d in enumerate(self.devices)}
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0,
                               "args": {"name": f"mpedu step ({self.source})"}}]
        lane_of, lanes = self._send_tracks(tid)
        for d, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": d}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": i,
                           "args": {"sort_index": 100 * i}})
            for k, (lane, _) in enumerate(lanes[d]):
                events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": lane,
                               "args": {"name": f"{d} sends" + (f" ({k + 1})" if k else "")}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": lane,
                               "args": {"sort_index": 100 * i + 1 + k}})
        for n, e in enumerate(sorted(self.events, key=lambda e: e.start)):
            where = f"mb{e.mb} s{e.stage}" + (f" c{e.chunk}" if e.chunk else "")
            args = {"stage": e.stage, "mb": e.mb, "chunk": e.chunk, "bytes": e.bytes, "memory_change": e.memory}
            name = f"{e.kind} {where}"
            if e.kind == "send":
                name, args["to"] = f"send {where} -> {e.peer}", e.peer
            track = lane_of[id(e)] if e.kind == "send" else tid[e.device]
            events.append({"ph": "X", "name": name, "cat": e.kind, "pid": 0, "tid": track,
                           "ts": e.start * us, "dur": e.duration * us, "args": args})
            if e.kind == "send" and e.peer in tid:
                # an arrow from the send slice to the action that used the data; if that action
                # is not in the timeline, to whatever the receiver starts next after the arrival
                flow = {"name": "transfer", "cat": "transfer", "pid": 0, "id": n}
                events.append({**flow, "ph": "s", "tid": track, "ts": e.start * us})
                used = self._receiver(e)
                land = {"bp": "e", "ts": (used.start + used.duration / 2) * us} if used else {"ts": e.end * us}
                events.append({**flow, "ph": "f", "tid": tid[e.peer], **land})
        for d in self.devices:
            for t, held in self.memory_over_time(d):
                events.append({"ph": "C", "name": f"{d} activations", "pid": 0, "tid": tid[d], "ts": t * us,
                               "args": {"bytes": held}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "makespan_s": self.makespan,
                              "bubble_fraction": self.bubble_fraction}}

    def _receiver(self, send: Event) -> Event | None:
        """The action a send fed: after F(s, i) the next stage's F(s+1, i); after B(s, i), B(s-1, i)."""
        made = [e for e in self.compute(send.device) if (e.stage, e.mb, e.chunk) == (send.stage, send.mb, send.chunk)
                and e.end <= send.start and e.kind in "FB"]
        if not made:
            return None
        kind = made[-1].kind
        stage = send.stage + 1 if kind == "F" else send.stage - 1
        return next((e for e in self.compute(send.peer)
                     if (e.kind, e.stage, e.mb, e.chunk) == (kind, stage, send.mb, send.chunk)), None)

    def to_chrome_trace(self, path) -> None:
        """Write `chrome_trace()` as JSON to `path`: open it at ui.perfetto.dev or chrome://tracing."""
        atomic_write(path, lambda f: json.dump(self.chrome_trace(), f), binary=False)

    def save(self, out_dir, stem: str = "step") -> list[Path]:
        """Write <stem>.png (the Gantt chart), <stem>.json (Chrome trace) and <stem>.timeline.json
        (this timeline, for `Timeline.from_dict`) into out_dir; return the three paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{stem}.png", out / f"{stem}.json", out / f"{stem}.timeline.json"]
        figure = self.plot().figure
        atomic_write(paths[0], lambda f: figure.savefig(f, dpi=120, format="png"))
        self.to_chrome_trace(paths[1])
        self.to_json(paths[2])
        return paths


def plot_timelines(timelines: list[Timeline], titles=None, shared_axis: bool = True, time_unit: str = "ms"):
    """Timelines stacked one above the other (e.g. predicted and measured), sharing one time axis
    unless shared_axis=False; time_unit "s", "ms" or "us". Returns the matplotlib Figure."""
    from ..pictures.plot import plot_timelines as plot
    return plot(timelines, titles=titles, shared_axis=shared_axis, time_unit=time_unit)
