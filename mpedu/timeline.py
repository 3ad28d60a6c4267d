"""What every device did and when: actions and transfers, with derived bubble and idle time."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Event:
    """One box on a device's row. Times are seconds from the start of the step.

    kind is "F", "B" or "W" for compute, "send" for a transfer to another device
    (drawn on the sender's row; `peer` names the receiver).
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
        text = f"{self.stage}{self.kind}{self.mb}" if self.kind in "FBW" else f"{self.kind}{self.mb}"
        return text if self.chunk == 0 else f"{text}.{self.chunk}"


COMPUTE = ("F", "B", "W")


@dataclass
class Timeline:
    """A step's events on p devices, measured (by the Pipeline) or predicted (by the simulator)."""

    devices: list[str]
    events: list[Event] = field(default_factory=list)
    source: str = "measured"   # or "predicted"

    def add(self, event: Event) -> None:
        self.events.append(event)   # list.append is atomic: workers may call this concurrently

    def compute(self, device: str | None = None) -> list[Event]:
        return sorted((e for e in self.events if e.kind in COMPUTE and (device is None or e.device == device)),
                      key=lambda e: e.start)

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
        lines = [f"{self.source} timeline: makespan {span * 1e3:.1f} ms, bubble {self.bubble_fraction:.1%}, "
                 f"{len(self.transfers())} transfers, {self.bytes_moved / 1e6:.2f} MB moved"]
        for d in self.devices:
            busy = self.busy(d)
            acts = " ".join(e.label for e in self.compute(d))
            lines.append(f"  {d:>8}: busy {busy * 1e3:8.1f} ms ({busy / span if span else 0:.0%})  {acts}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Timeline({self.source}, devices={self.devices}, events={len(self.events)}, "
                f"makespan={self.makespan * 1e3:.1f} ms, bubble={self.bubble_fraction:.1%})")

    def to_dict(self) -> dict:
        return {"devices": self.devices, "source": self.source, "events": [asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        return cls(list(d["devices"]), [Event(**e) for e in d["events"]], d.get("source", "measured"))

    def to_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)
