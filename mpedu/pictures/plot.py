"""Gantt charts of Timelines: one row per device, a box per action, transfers and idle time visible."""
from __future__ import annotations

from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

# Okabe-Ito colours: told apart by people with any common colour-vision deficiency.
# Each box also carries its kind's letter, so colour is never the only cue.
# sky blue, reddish purple (the forward again; black labels stay readable on it), orange, bluish green
KIND_COLOURS = {"F": "#56B4E9", "R": "#CC79A7", "B": "#E69F00", "W": "#009E73"}
KIND_NAMES = {"F": "F forward", "R": "R forward again (recomputation, before its B)", "B": "B backward",
              "W": "W weight gradient"}
ALL_REDUCE_COLOUR = "#CC79A7"   # reddish purple: the gradient all-reduce of data parallelism (label "AR")
IDLE_COLOUR = "#EBEBEB"       # the row's background: wherever it shows, the device waits
TRANSFER_COLOUR = "#444444"
UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6}
BOX_HEIGHT = 0.7              # rows are 1 apart; the gap between boxes of two rows carries the transfers


def plot_timeline(timeline, ax=None, *, title=None, time_unit="ms", show_transfers=True, xlim=None,
                  legend=True, legend_for=None):
    """Draw `timeline` as a Gantt chart on `ax` (a new Figure's Axes when None) and return the Axes.

    The legend (above the chart) keys every kind of mark drawn: F, B and W boxes, the hatched
    later stages of a device, transfers, idle time; the x-axis label says how to read a box's label.
    `legend_for`: the timelines the legend and that key must cover when one legend serves several
    panels (default: this timeline alone).
    """
    if time_unit not in UNITS:
        raise ValueError(f"time_unit must be one of {sorted(UNITS)}, got {time_unit!r}")
    scale = UNITS[time_unit]
    if ax is None:
        ax = new_figure(10, 1.1 + 0.55 * len(timeline.devices)).add_subplot()
    rows = {d: i for i, d in enumerate(timeline.devices)}
    compute = timeline.compute()
    start = min([0.0] + [e.start for e in timeline.events])
    end = max([start] + [e.end for e in timeline.events])
    lo, hi = (start * scale, end * scale) if xlim is None else xlim
    if hi <= lo:
        hi = lo + 1.0

    # Idle: a grey band under each row; the boxes cover it where the device computes.
    ax.barh(range(len(rows)), (end - start) * scale, left=start * scale, height=BOX_HEIGHT,
            color=IDLE_COLOUR, zorder=0)

    # Several stages on one device (interleaved): lighter and hatched for each later one.
    held = {d: sorted({e.stage for e in compute if e.device == d}) for d in rows}
    several = any(len(s) > 1 for s in held.values())
    chunked = any(e.chunk for e in compute)   # time chunks: every label names its chunk, 0 included
    marks = _marks([timeline] if legend_for is None else legend_for, show_transfers)
    order = {(d, s): k for d, stages in held.items() for k, s in enumerate(stages)}

    # Boxes go in with add_artist: the limits are set below, and skipping barh's per-patch
    # data-limit updates makes ~200 boxes several times faster. Each box's gid names it.
    label_width = _points_per_unit(ax, lo, hi)
    for e in compute:
        if e.device not in rows:
            continue
        y, k = rows[e.device], order[e.device, e.stage]
        colour = _lighter(KIND_COLOURS[e.kind], 0.45 * k)
        # a darker outline parts back-to-back boxes and keeps a box narrower than a pixel visible
        ax.add_artist(Rectangle((e.start * scale, y - BOX_HEIGHT / 2), e.duration * scale, BOX_HEIGHT,
                                facecolor=colour, edgecolor=_darker(colour), linewidth=0.5,
                                hatch="//" if k else None, zorder=2, gid=f"{e.device} {e.label}"))
        text = box_label(e, several, chunked)
        # write the label only where it fits (about 4.5 points per character at size 7.5)
        if e.duration * scale * label_width >= 4.5 * len(text) + 2:
            ax.text((e.start + e.duration / 2) * scale, y, text, ha="center", va="center", fontsize=7.5,
                    color="black", zorder=3, clip_on=True)

    for e in timeline.collectives():      # data parallelism: the all-reduce, a box labelled AR
        if e.device in rows:
            ax.add_artist(Rectangle((e.start * scale, rows[e.device] - BOX_HEIGHT / 2), e.duration * scale,
                                    BOX_HEIGHT, facecolor=ALL_REDUCE_COLOUR, edgecolor=_darker(ALL_REDUCE_COLOUR),
                                    linewidth=0.5, zorder=2, gid=f"{e.device} all-reduce"))
            if e.duration * scale * label_width >= 4.5 * 2 + 2:
                ax.text((e.start + e.duration / 2) * scale, rows[e.device], "AR", ha="center", va="center",
                        fontsize=7.5, color="black", zorder=3, clip_on=True)

    if show_transfers:
        _draw_transfers(ax, timeline, rows, scale)

    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)          # device 0 at the top
    ax.set_xlim(lo, hi)
    ax.set_xlabel(f"time ({time_unit})" + _label_key(marks))
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    name = title if title is not None else f"{timeline.source} timeline"
    # The title on top, the legend on its own line under it, then the chart: neither hides the other.
    ax.set_title(f"{name}: makespan {timeline.makespan * scale:.1f} {time_unit}, "
                 f"bubble {timeline.bubble_fraction:.0%}", loc="left", fontsize=10, pad=20 if legend else 6)
    if legend:
        ax.legend(handles=_legend_handles(marks), loc="lower left",
                  bbox_to_anchor=(0.0, 1.0), ncol=8, fontsize=7.5, frameon=False, borderaxespad=0.1,
                  borderpad=0.1, handlelength=1.4, columnspacing=1.2)
    return ax


def plot_timelines(timelines, titles=None, shared_axis=True, time_unit="ms") -> Figure:
    """Several timelines stacked, e.g. predicted above measured; with shared_axis they share one time axis."""
    timelines = list(timelines)
    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline")
    titles = list(titles) if titles is not None else [None] * len(timelines)
    if len(titles) != len(timelines):
        raise ValueError(f"got {len(titles)} titles for {len(timelines)} timelines")
    heights = [0.6 + 0.55 * len(t.devices) for t in timelines]
    fig = new_figure(10, 0.4 + sum(heights))
    axes = fig.subplots(len(timelines), 1, sharex=shared_axis, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    hi = max((e.end for t in timelines for e in t.events), default=1.0) * UNITS[time_unit]
    for i, (t, ax, title) in enumerate(zip(timelines, axes, titles)):
        # one legend, on the top panel, keys the marks of every panel (the W boxes may be only in the last)
        plot_timeline(t, ax, title=title, time_unit=time_unit, xlim=(0.0, hi) if shared_axis else None,
                      legend=i == 0, legend_for=timelines)
        if shared_axis and i < len(timelines) - 1:
            ax.set_xlabel("")
            ax.tick_params(axis="x", labelbottom=False)
    return fig


def new_figure(width: float, height: float) -> Figure:
    """A Figure outside pyplot (no global state: safe in threads and tests) that Jupyter shows as a
    PNG when a cell returns it, even without `%matplotlib inline`."""
    _show_figures_in_jupyter()
    return Figure(figsize=(width, height), layout="constrained")


def _show_figures_in_jupyter() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "display_formatter"):
        return
    png = shell.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(Figure)      # `%matplotlib inline` has set it up already: leave it
    except KeyError:
        from IPython.core.pylabtools import print_figure
        png.for_type(Figure, lambda fig: print_figure(fig, "png"))   # PNG: SVGs carry random ids


def box_label(event, several_stages: bool, chunked: bool = False) -> str:
    """"F3" (forward of micro-batch 3); "1F3" with the stage when a device holds several;
    ".c" for time chunk c when the step has time chunks (as Schedule.grid writes them)."""
    text = f"{event.stage}{event.kind}{event.mb}" if several_stages else f"{event.kind}{event.mb}"
    return f"{text}.{event.chunk}" if chunked else text


def _draw_transfers(ax, timeline, rows, scale) -> None:
    """A line from the sender's row when the send starts to the receiver's row when the data has arrived,
    with an arrowhead at the receiver: the box it feeds cannot start left of the arrowhead."""
    segments, heads_down, heads_up = [], [], []
    for e in timeline.transfers():
        if e.device not in rows or e.peer not in rows:
            continue
        y0, y1 = rows[e.device], rows[e.peer]
        down = y1 > y0
        a = (e.start * scale, y0 + (BOX_HEIGHT / 2 if down else -BOX_HEIGHT / 2))
        b = (e.end * scale, y1 - (BOX_HEIGHT / 2 if down else -BOX_HEIGHT / 2))
        segments.append((a, b))
        (heads_down if down else heads_up).append(b)
    if not segments:
        return
    ax.add_collection(LineCollection(segments, colors=TRANSFER_COLOUR, linewidths=0.8, alpha=0.8, zorder=4),
                      autolim=False)
    for heads, marker in ((heads_down, "v"), (heads_up, "^")):
        if heads:
            xs, ys = zip(*heads)
            ax.scatter(xs, ys, marker=marker, s=9, color=TRANSFER_COLOUR, linewidths=0, zorder=4)


def _marks(timelines, show_transfers: bool) -> dict:
    """What the timelines draw: box kinds, the most stages one device holds, time chunks, transfers."""
    compute = [e for t in timelines for e in t.compute()]
    stages = {}
    for e in compute:
        stages.setdefault(e.device, set()).add(e.stage)
    return {"kinds": {e.kind for e in compute},
            "most_stages": max((len(s) for s in stages.values()), default=1),
            "chunked": any(e.chunk for e in compute),
            "transfers": show_transfers and any(t.transfers() for t in timelines),
            "all_reduce": any(t.collectives() for t in timelines)}


def _legend_handles(marks: dict):
    handles = [Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in "FRBW" if k in marks["kinds"]]
    if marks["most_stages"] > 1:
        handles += [Patch(facecolor=_lighter("#999999", 0.45 * k), hatch="//" if k else None,
                          edgecolor=_darker(_lighter("#999999", 0.45 * k)),
                          label=f"{_ordinal(k + 1)} stage on a device") for k in range(marks["most_stages"])]
    if marks["transfers"]:
        handles.append(Line2D([], [], color=TRANSFER_COLOUR, marker="v", markersize=4, linewidth=0.8,
                              label="transfer"))
    if marks.get("all_reduce"):
        handles.append(Patch(facecolor=ALL_REDUCE_COLOUR, label="AR all-reduce of gradients"))
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle"))
    return handles


def _label_key(marks: dict) -> str:
    """How to read a box's label, for the x-axis label: e.g. '1F3.2 = stage 1's forward of micro-batch 3, chunk 2'."""
    if not marks["kinds"]:
        return ""
    several, chunked = marks["most_stages"] > 1, marks["chunked"]
    example = ("1" if several else "") + "F3" + (".2" if chunked else "")
    words = ("stage 1's " if several else "") + "forward of micro-batch 3" + (", time chunk 2" if chunked else "")
    return f"      (a box labelled {example} = {words})"


def _points_per_unit(ax, lo, hi) -> float:
    """Typographic points per x unit, from the Axes' width before layout (labels are checked against it)."""
    return ax.get_position().width * ax.figure.get_figwidth() * 72 * 0.9 / (hi - lo)


def _lighter(colour, amount: float):
    """Blend `colour` towards white by `amount` (0: unchanged, 1: white)."""
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _darker(colour, amount: float = 0.35):
    r, g, b = to_rgb(colour)
    return (r * (1 - amount), g * (1 - amount), b * (1 - amount))


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
