"""Link: the interconnect between two devices (latency + bytes / bandwidth), its presets, and how transfers queue."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Real

INF = float("inf")


@dataclass(frozen=True)
class Link:
    """Time to hand a tensor to another device: latency_s + bytes / bandwidth_Bps.

        Link()                        # two virtual devices on one CPU: a queue hand-off, no copy
        Link.parse("pcie4")           # a preset (see LINKS)
        Link.parse("10gbe/100")       # a preset slowed 100x (latency x 100, bandwidth / 100)
        Link.parse("5ms,10MB/s")      # your own: LATENCY,BANDWIDTH

    A transfer does not hold up the sender (a GPU copies on its own copy engine);
    the receiver cannot use the tensor before it lands. Between virtual devices the
    Pipeline makes that delay real (the receiver sleeps), and `simulate` charges the
    same link, with the same rule for transfers that overlap:

    **Transfers in one direction queue for the bandwidth.** Each direction of a
    link between two devices (full duplex, as PCIe, NVLink and Ethernet are)
    carries one transfer's bytes at a time, first sent first: a transfer starts
    when it is sent or when the previous one on that direction has put its last
    byte on the wire, whichever is later, and lands `latency_s` after its own last
    byte. So a lone transfer takes exactly `time(bytes)`; k transfers sent at once
    take k x bytes / bandwidth + latency for the last one. Activations (forward)
    and gradients (backward) between the same two devices travel on opposite
    directions and never wait for each other.

    `emulated` is False only for the shared-memory default (20 us, infinite
    bandwidth): the hand-off virtual devices pay anyway, so the engine adds nothing.
    """

    latency_s: float = 20e-6
    bandwidth_Bps: float = INF
    name: str = ""

    def __post_init__(self):
        latency, bandwidth = self.latency_s, self.bandwidth_Bps
        if isinstance(latency, bool) or not isinstance(latency, Real) or not 0 <= latency < INF:
            raise ValueError(f"Link latency_s={latency!r}: give the one-way latency in seconds, a finite number "
                             ">= 0 (e.g. 10e-6 for PCIe)")
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, Real) or not bandwidth > 0:
            raise ValueError(f"Link bandwidth_Bps={bandwidth!r}: give the bandwidth in bytes per second, > 0 "
                             "(e.g. 25e9 for PCIe 4.0 x16, float('inf') for no limit)")
        if not self.name:
            default = (latency, bandwidth) == (_SHARED_LATENCY_S, INF)
            object.__setattr__(self, "name", "shared memory" if default else "custom")

    def time(self, nbytes: float) -> float:
        """Seconds for one transfer of `nbytes` on an idle link."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    @property
    def emulated(self) -> bool:
        """True when the engine must delay transfers between virtual devices (every link but the default)."""
        return (self.latency_s, self.bandwidth_Bps) != (_SHARED_LATENCY_S, INF)

    def slowed(self, factor: float) -> "Link":
        """This link `factor` times slower: latency x factor, bandwidth / factor.

        A CPU core computes these layers perhaps 100x slower than a GPU; with its
        links 100x slower too, virtual devices keep a GPU system's ratio of
        compute to communication, so a cut costs what it would cost there."""
        if isinstance(factor, bool) or not isinstance(factor, Real) or not 0 < factor < INF:
            raise ValueError(f"slowed({factor!r}): give a positive finite factor, e.g. 100 (100x slower)")
        return Link(self.latency_s * factor, self.bandwidth_Bps / factor, f"{self.name}/{factor:g}")

    def __str__(self) -> str:
        return f"{self.name} ({format_seconds(self.latency_s)} + bytes / {format_bandwidth(self.bandwidth_Bps)})"

    @classmethod
    def parse(cls, spec) -> "Link":
        """A Link from text: a preset name, PRESET/FACTOR, or LATENCY,BANDWIDTH (optionally /FACTOR).

            "pcie4"          PCIe 4.0 x16 (presets: shared, pcie4, nvlink, 10gbe, 100gbe; see LINKS)
            "10gbe/100"      10 Gb Ethernet slowed 100x, for virtual devices on CPU cores
            "5ms,10MB/s"     latency with a unit (s, ms, us), bandwidth with a unit: B/s, kB/s,
                             MB/s, GB/s (bytes, powers of 1000) or Mb/s, Gb/s (bits); "inf" for no limit

        A Link is returned as it is; None gives the shared-memory default."""
        if spec is None:
            return LINKS["shared"]
        if isinstance(spec, Link):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"a link is a Link, a preset name such as 'pcie4', or text such as '10gbe/100'; "
                            f"got {type(spec).__name__}")
        text = spec.strip()
        base, slash, factor_text = text.rpartition("/")
        if not slash or ("," in text and not _is_number(factor_text)):   # no factor ("/s" ends a rate)
            base, factor_text = text, None
        if "," in base:
            latency_text, _, bandwidth_text = base.partition(",")
            link = cls(_parse_seconds(latency_text, spec), _parse_bandwidth(bandwidth_text, spec),
                       base.replace(" ", ""))
        else:
            link = LINKS.get(base.strip().lower())
            if link is None:
                raise ValueError(f"unknown link {spec!r}; {_HOW_TO_WRITE}")
        if factor_text is not None:
            factor = float(factor_text) if _is_number(factor_text) else math.nan
            if not 0 < factor < INF:
                raise ValueError(f"link {spec!r}: the factor after '/' must be a positive number, e.g. "
                                 f"'{base.strip()}/100' (100x slower)")
            link = link.slowed(factor)
        return link

    def check_devices(self, devices) -> "Link":
        """This link, for a pipeline on `devices`; refused where it would emulate copies between real GPUs."""
        gpus = [d.name for d in devices if d.is_cuda]
        if self.emulated and gpus and len(devices) > 1:
            raise ValueError(f"link={self.name!r} emulates an interconnect between virtual devices, but this "
                             f"placement uses {', '.join(gpus)}, whose copies take their real time; drop link= "
                             "here (to predict another interconnect, give it to simulate(..., link=...))")
        return self

class Channel:
    """One direction of a link between two devices during one step: transfers queue for its bandwidth.

    `arrival(sent_at, nbytes)` is when a transfer sent at `sent_at` lands; calls must
    come in the order the transfers were sent (the sending device's own order).
    The Pipeline and the simulator both use this, so they agree on contention.
    """

    def __init__(self, link: Link):
        self.link = link
        self.free_at = -INF      # when the last queued transfer put its last byte on the wire

    def arrival(self, sent_at: float, nbytes: float) -> float:
        start = max(sent_at, self.free_at)
        self.free_at = start + nbytes / self.link.bandwidth_Bps
        return self.free_at + self.link.latency_s


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def format_duration(seconds: float) -> str:
    """A long time as a person says it: "45 s", "12 min", "3.3 h", "2.1 days", "3e+22 years"."""
    for unit, scale in (("years", 365.25 * 86400), ("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return format_seconds(seconds)


def format_bandwidth(bps: float) -> str:
    if bps == INF:
        return "inf B/s"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} B/s"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_SHARED_LATENCY_S = 20e-6   # a queue hand-off between two worker threads (about 15-20 us one way, measured)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_RATE_UNITS = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[-+]?\d+)?|\.\d+(?:e[-+]?\d+)?|inf)\s*([a-zA-Zµ/]*)\s*$", re.I)


def _parse_seconds(text: str, spec: str) -> float:
    match = _NUMBER_UNIT.match(text)
    # a unit is required (is "5" seconds or microseconds?), except for 0
    unit = match and _TIME_UNITS.get(match.group(2).lower() or ("s" if float(match.group(1)) == 0 else ""))
    if not unit or match.group(1).lower() == "inf":
        raise ValueError(f"link {spec!r}: latency {text.strip()!r} is not a time; write a number with a unit "
                         "s, ms or us, e.g. '50us' or '5ms'")
    return float(match.group(1)) * unit


def _parse_bandwidth(text: str, spec: str) -> float:
    match = _NUMBER_UNIT.match(text)
    if match and match.group(1).lower() == "inf" and match.group(2) in ("", "B/s"):
        return INF
    unit = match.group(2) if match else ""
    scale = _RATE_UNITS.get(unit.lower()) if unit.endswith("/s") else None
    if not match or scale is None or unit[-3] not in "Bb" or float(match.group(1)) <= 0:
        raise ValueError(f"link {spec!r}: bandwidth {text.strip()!r} is not a positive rate; write a number with "
                         "a unit B/s, kB/s, MB/s, GB/s (bytes) or Mb/s, Gb/s (bits), e.g. '1.25GB/s' or "
                         "'10Gb/s', or 'inf'")
    return float(match.group(1)) * scale / (8 if unit[-3] == "b" else 1)


# Presets: one direction of the link, typical numbers (achieved, not the line rate; latency is
# a small transfer's one-way time from the sender's call to the data being usable).
LINKS: dict[str, Link] = {
    # two virtual devices on one CPU: the tensor stays where it is, a worker thread wakes another
    "shared": Link(_SHARED_LATENCY_S, INF, "shared memory"),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes = 31.5 GB/s per direction after encoding; a pinned
    # cudaMemcpy achieves about 25 GB/s; a small copy takes about 10 us end to end
    "pcie4": Link(10e-6, 25e9, "pcie4"),
    # NVLink 3 (A100, 12 links x 25 GB/s): 300 GB/s per direction (600 GB/s both ways);
    # a small GPU-to-GPU copy about 5 us
    "nvlink": Link(5e-6, 300e9, "nvlink"),
    # 10 Gb Ethernet: 1.25 GB/s line rate; kernel TCP, small message one way about 50 us
    "10gbe": Link(50e-6, 1.25e9, "10gbe"),
    # 100 Gb Ethernet: 12.5 GB/s line rate; kernel TCP about 20 us one way (RDMA: 2-5 us)
    "100gbe": Link(20e-6, 12.5e9, "100gbe"),
}

_HOW_TO_WRITE = (f"give a preset ({', '.join(LINKS)}), a preset slowed by a factor (e.g. '10gbe/100': "
                 "latency x 100, bandwidth / 100), or LATENCY,BANDWIDTH (e.g. '5ms,10MB/s')")
