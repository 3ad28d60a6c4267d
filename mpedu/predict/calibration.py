"""Calibrate the link model from a measured step: how long a hand-off took between two devices."""
from __future__ import annotations

import statistics

from ..core.timeline import Timeline
from ..runtime.link import INF, Link


def fit_link(timeline: Timeline) -> Link:
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
    bandwidth = INF
    sends = timeline.transfers()
    if len({e.bytes for e in sends}) > 1:
        n = len(sends)
        mx, my = sum(e.bytes for e in sends) / n, sum(e.duration for e in sends) / n
        cov = sum((e.bytes - mx) * (e.duration - my) for e in sends)
        var = sum((e.bytes - mx) ** 2 for e in sends)
        if cov > 0:
            bandwidth = var / cov
    return Link(max(statistics.median(gaps), 0.0), bandwidth, "fitted")

