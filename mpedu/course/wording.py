"""The explorer's words: its menus (schedules, links, slow-downs, recomputation), and why its numbers may surprise."""
from __future__ import annotations

import statistics

SCHEDULES = {"naive": "naive (one micro-batch at a time)", "gpipe": "GPipe", "1f1b": "1F1B",
             "interleaved": "interleaved 1F1B", "zb1": "zero bubble (ZB-H1)", "wavefront": "wavefront (time chunks)"}
# A CPU core computes about 100x slower than a GPU: a link slowed as much keeps a GPU's compute-to-communication ratio.
SLOWDOWNS = {1: "1× (as it is)", 10: "10×", 100: "100× (GPU-like)"}
# Activation recomputation (Pipeline's recompute=): the menu's keys; "none" is recompute=None
RECOMPUTE = {"none": "keep activations", "all": "recompute every micro-batch",
             "all-but-last": "recompute all but the last micro-batch"}


def link_label(key: str, link) -> str:
    """A link menu's entry: its name, latency and bandwidth."""
    speed = "no added delay" if not link.emulated else (
        f"{link.latency_s * 1e6:g} µs + "
        + ("no bandwidth limit" if link.bandwidth_Bps == float("inf") else f"{link.bandwidth_Bps / 1e9:g} GB/s"))
    return f"{getattr(link, 'name', key)} ({speed})"


def plural(n: int, word: str) -> str:
    """'1 stage', '3 stages'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def sequences(b: int) -> str:
    return plural(b, "sequence")


def cost_note(costs, profiles, measured: bool) -> str:
    """Why the numbers may surprise: an estimate, or small micro-batches that make every layer slower. `costs`:
    the profile (mpedu.predict.profiling.Costs) the step was drawn from; `profiles`: every one measured so far."""
    b = costs.micro_batch[1]
    if not measured:
        return (f"Estimated from the nearest measured micro-batch size, scaled per sequence; measuring the "
                f"layers on micro-batches of {sequences(b)} now (the numbers update by themselves)…")
    per_sequence = {c.micro_batch[1]: (sum(c.forward) + sum(c.backward)) / c.micro_batch[1]
                    for c in profiles if c.micro_batch[0] == costs.micro_batch[0]}
    best = min(per_sequence, key=per_sequence.get)
    ratio = per_sequence[b] / per_sequence[best]
    if ratio < 1.15:
        return ""
    return (f"Micro-batches of {sequences(b)} cost the layers {ratio:.1f}× the time per sequence that "
            f"micro-batches of {sequences(best)} do (small matrix products keep a core less busy). So the step "
            f"can get slower while the speed against one device rises: that device does the same small "
            f"micro-batches one after another.")


def far_from_prediction(spans: list[float], predicted_s: float, virtual: bool, factor: float = 1.5) -> str:
    """A word after a run whose steps took more than `factor` times the prediction, or less than 1/factor
    of it ("" otherwise): the typical step (the median, the first one left out: it warms up) against the
    prediction. A prediction is only as good as the costs beneath it: measured alone, at another time."""
    typical = statistics.median(spans[1:] or spans) if spans else 0.0
    if not typical or not predicted_s or 1 / factor <= typical / predicted_s <= factor:
        return ""
    ratio = f"the steps took {typical / predicted_s:.2f}× the prediction ({typical * 1e3:.1f} ms against " \
            f"{predicted_s * 1e3:.1f})"
    if typical > predicted_s:
        why = ("other work is probably taking the CPU cores, which the prediction gives the virtual devices "
               "alone (mpedu.course.claims.free_cores() measures how many are free now)" if virtual else
               "other work is probably taking these devices")
        why += ", or the layers' costs were measured on faster hardware"
    else:
        why = "the layers' costs were measured while the machine was busier than now, or on another machine"
    return f" · {ratio}: {why}"
