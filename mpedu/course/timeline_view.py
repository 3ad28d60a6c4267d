"""The explorer's timelines, drawn by the browser as SVG (anywidget) from the events Python sends, with their legend."""
from __future__ import annotations

import anywidget
import traitlets
from matplotlib.colors import to_hex, to_rgb

from ..pictures.plot import IDLE_COLOUR, KIND_COLOURS, TRANSFER_COLOUR
from .wording import sequences

# The timeline, drawn in the browser as SVG from the events Python sends (a few kB of JSON): a PNG made by
# matplotlib took most of a redraw's time. Python sends the colours and labels, so the two agree with plot.py.
# TIMELINE_DRAW is the drawing alone, shared with the step-through (mpedu.course.stepper), which marks boxes by their
# data-box index (data-panel: which panel) and transfers by data-transfer. The class .mpedu-timeline is the view's
# own (its render adds it): the browser tests find the explorer's timeline by it.
TIMELINE_DRAW = r"""
let serial = 0;                           // pattern ids must be unique on a page with several explorers
function drawTimeline(el, panels, legend) {
  const NS = "http://www.w3.org/2000/svg";
  const hatchId = `mpedu-hatch-${++serial}`, arrowId = `mpedu-arrow-${serial}`;
  const svg = (tag, attrs = {}, text) => {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const span = (cls, text = "") => Object.assign(document.createElement("span"), { className: cls, textContent: text });
  const niceStep = (range) => {           // 1, 2 or 5 times a power of ten, for about 6 ticks
    const raw = range / 6, p = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((f) => f * p).find((s) => s >= raw);
  };
  el.replaceChildren();
  if (panels.length) {
    const key = document.createElement("div");
    key.className = "mpedu-legend";
    for (const mark of legend.marks) {
      const item = span("mpedu-mark");
      const swatch = span(`mpedu-swatch mpedu-swatch-${mark.shape}`);
      if (mark.fill) swatch.style.background = mark.fill;
      if (mark.hatch) swatch.classList.add("mpedu-hatched");
      item.append(swatch, document.createTextNode(mark.label));
      key.append(item);
    }
    const labels = document.createElement("div");
    labels.className = "mpedu-legend mpedu-labels";
    labels.textContent = legend.labels;
    el.append(key, labels);

    const W = 880, left = 70, right = 14, row = 24, box = 17, head = 24, axis = 34;
    const end = Math.max(...panels.map((p) => p.end)) || 1;
    const x = (t) => left + (W - left - right) * t / end;
    const H = panels.reduce((h, p) => h + head + row * p.devices.length, 0) + axis;
    const s = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
                           "aria-label": panels.map((p) => p.title).join("; ") });
    s.style.maxWidth = `${W}px`;
    const defs = svg("defs");
    const hatch = svg("pattern", { id: hatchId, width: 5, height: 5, patternUnits: "userSpaceOnUse",
                                   patternTransform: "rotate(45)" });
    hatch.append(svg("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#333", "stroke-width": 1, opacity: 0.55 }));
    const arrow = svg("marker", { id: arrowId, viewBox: "0 0 6 6", refX: 6, refY: 3, markerWidth: 5,
                                  markerHeight: 5, orient: "auto-start-reverse" });
    arrow.append(svg("path", { d: "M0,0 L6,3 L0,6 z", fill: legend.transfer }));
    defs.append(hatch, arrow);
    s.append(defs);
    let y = 0;
    panels.forEach((p, pi) => {
      s.append(svg("text", { x: 2, y: y + 16, class: "mpedu-tl-title" }, p.title));
      y += head;
      const top = (r) => y + r * row + (row - box) / 2;
      p.devices.forEach((d, r) => {
        s.append(svg("text", { x: left - 8, y: top(r) + box / 2 + 4, "text-anchor": "end",
                               class: "mpedu-tl-device" }, d));
        s.append(svg("rect", { x: x(0), y: top(r), width: x(p.end) - x(0), height: box, fill: legend.idle }));
      });
      p.boxes.forEach(([r, t0, dt, fill, stroke, hatched, label, tip], k) => {
        const bx = x(t0), bw = Math.max(x(t0 + dt) - bx, 0.8), at = { "data-panel": pi, "data-box": k };
        const rects = [svg("rect", { x: bx, y: top(r), width: bw, height: box, fill, stroke, "stroke-width": 0.6,
                                     ...at })];
        if (hatched) rects.push(svg("rect", { x: bx, y: top(r), width: bw, height: box, fill: `url(#${hatchId})`,
                                              class: "mpedu-tl-hatch", ...at }));
        for (const rect of rects) {       // what the box is, on hover (its micro-batch's size, when they differ)
          if (tip) rect.append(svg("title", {}, tip));
          s.append(rect);
        }
        if (bw >= 6.6 * label.length + 4) {
          s.append(svg("text", { x: bx + bw / 2, y: top(r) + box / 2 + 4, "text-anchor": "middle",
                                 class: "mpedu-tl-label", ...at }, label));
        }
      });
      p.transfers.forEach(([r0, t0, r1, t1], k) => {
        const down = r1 > r0;
        s.append(svg("line", { x1: x(t0), y1: down ? top(r0) + box : top(r0),
                               x2: x(t1), y2: down ? top(r1) : top(r1) + box,
                               stroke: legend.transfer, "stroke-width": 0.9, opacity: 0.8,
                               "marker-end": `url(#${arrowId})`, "data-panel": pi, "data-transfer": k }));
      });
      y += row * p.devices.length;
    });
    const step = niceStep(end);
    s.append(svg("line", { x1: x(0), y1: y + 2, x2: x(end), y2: y + 2, stroke: "#888" }));
    for (let t = 0; t <= end + 1e-9; t += step) {
      s.append(svg("line", { x1: x(t), y1: y + 2, x2: x(t), y2: y + 6, stroke: "#888" }));
      s.append(svg("text", { x: x(t), y: y + 18, "text-anchor": "middle", class: "mpedu-tl-tick" },
                   `${+t.toFixed(6)}`));
    }
    s.append(svg("text", { x: W - right, y: y + 31, "text-anchor": "end", class: "mpedu-tl-tick" }, "time (ms)"));
    el.append(s);
  }
}
"""

TIMELINE_ESM = TIMELINE_DRAW + r"""
function render({ model, el }) {
  el.classList.add("mpedu-timeline");
  const draw = () => {
    drawTimeline(el, model.get("panels"), model.get("legend"));
    // when this picture was drawn, for the browser test's redraw timings (performance.now(), ms)
    el.dataset.revision = model.get("revision");
    el.dataset.drawnAt = performance.now();
  };
  model.on("change:revision", draw);
  draw();
  return () => model.off("change:revision", draw);
}
export default { render };
"""

# JupyterLab's colour variables, with plain fallbacks for front ends that lack them. Text is 11 px or more.
TIMELINE_CSS = """
.mpedu-timeline { max-width: 880px; color: var(--jp-ui-font-color1, #222); }
.mpedu-timeline svg { display: block; font-family: sans-serif; }
.mpedu-tl-title { font-size: 13px; font-weight: bold; fill: currentColor; }
.mpedu-tl-device, .mpedu-tl-tick { font-size: 12px; fill: currentColor; }
.mpedu-tl-label { font-size: 11px; fill: #111; pointer-events: none; }
.mpedu-legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; margin: 2px 0; }
.mpedu-labels { display: block; color: var(--jp-ui-font-color2, #444); }
.mpedu-mark { display: inline-flex; align-items: center; gap: 5px; }
.mpedu-swatch { display: inline-block; width: 16px; height: 11px; border: 1px solid #777; }
.mpedu-swatch-line { height: 0; border: 0; border-top: 1.5px solid #444; }
.mpedu-hatched {
  background-image: repeating-linear-gradient(45deg, rgba(0,0,0,.45) 0 1px, transparent 1px 4px) !important; }
"""


class TimelineView(anywidget.AnyWidget):
    """Timelines stacked on one time axis (predicted above measured), drawn by the browser. Set `panels` and
    `legend` (see `timeline_panel`), then bump `revision`: the page redraws once per revision."""

    _esm = TIMELINE_ESM
    _css = TIMELINE_CSS
    panels = traitlets.List().tag(sync=True)     # [{"title", "devices", "end" (ms), "boxes", "transfers"}]
    legend = traitlets.Dict().tag(sync=True)     # {"marks": [...], "labels": text, "idle", "transfer"}
    revision = traitlets.Int(0).tag(sync=True)

    def show(self, timelines, titles) -> None:
        """Draw `timelines` (a list, maybe empty) under `titles`, with one legend for every mark in any of them."""
        end = max((e.end for t in timelines for e in t.events), default=0.0)
        panels, marks, labels = [], {}, set()
        for t, title in zip(timelines, titles):
            panel, used, kinds = timeline_panel(t, title, end)
            panels.append(panel)
            marks.update(used)
            labels |= kinds
        with self.hold_sync():
            self.panels, self.legend = panels, _legend(marks, labels)
            self.revision += 1


def timeline_panel(timeline, title: str, end: float):
    """One panel's data: boxes [row, start ms, length ms, fill, outline, hatched, label, tip (its words on hover)],
    transfers [sender row, start ms, receiver row, arrival ms]; and the marks and kinds of label it uses (with
    micro-batches of unequal size, ("sizes", their sizes) among the kinds: the legend names them)."""
    rows = {d: i for i, d in enumerate(timeline.devices)}
    compute = timeline.compute()
    held = _stages_held(timeline, compute)
    several, chunked = label_style(timeline, compute)
    order = {(d, s): k for d, stages in held.items() for k, s in enumerate(stages)}
    sizes = timeline.micro_batch_sizes if timeline.micro_batch_sizes and len(set(timeline.micro_batch_sizes)) > 1 \
        else None
    boxes, marks = [], {}
    for e in compute:
        if e.device not in rows:
            continue
        k = order[e.device, e.stage]
        fill, outline = _colours(e.kind, k)
        marks[e.kind, k] = fill
        label = box_label(e, several, chunked)
        width = f", {sequences(sizes[e.mb])}" if sizes and e.mb < len(sizes) else ""
        tip = f"{label}: stage {e.stage}, micro-batch {e.mb}{width}, {e.duration * 1e3:.2f} ms"
        boxes.append([rows[e.device], round(e.start * 1e3, 4), round(e.duration * 1e3, 4), fill, outline, k > 0,
                      label, tip])
    transfers = [[rows[e.device], round(e.start * 1e3, 4), rows[e.peer], round(e.end * 1e3, 4)]
                 for e in timeline.transfers() if e.device in rows and e.peer in rows]
    if transfers:
        marks["transfer"] = TRANSFER_COLOUR
    kinds = {"stage"} if several else set()
    if chunked:
        kinds.add("chunk")
    if sizes:
        kinds.add(("sizes", tuple(sizes)))
    panel = {"title": title, "devices": list(timeline.devices), "end": round(end * 1e3, 4), "boxes": boxes,
             "transfers": transfers}
    return panel, marks, kinds


def _stages_held(timeline, compute) -> dict:
    """{device: the stages it runs, in order}."""
    return {d: sorted({e.stage for e in compute if e.device == d}) for d in timeline.devices}


def label_style(timeline, compute=None) -> tuple[bool, bool]:
    """(several, chunked) for box_label: whether a label names the stage (some device holds several stages) and
    the time chunk (the timeline has chunks). `compute`: timeline.compute(), when the caller has it already."""
    compute = timeline.compute() if compute is None else compute
    several = any(len(s) > 1 for s in _stages_held(timeline, compute).values())
    return several, any(e.chunk for e in compute)


def box_label(e, several: bool, chunked: bool) -> str:
    """A box's label: "F3" (kind and micro-batch), "1F3" when devices hold several stages, "F3.1" with chunks."""
    return (f"{e.stage}{e.kind}{e.mb}" if several else f"{e.kind}{e.mb}") + (f".{e.chunk}" if chunked else "")


_KIND_WORDS = {"F": "F forward", "R": "R forward again (recomputation, before its B)",
               "B": "B backward (input gradient, sent to the stage before)",
               "W": "W weight gradient (nobody waits for it)"}


def _colours(kind: str, k: int, cache={}) -> tuple[str, str]:   # noqa: B006 (a cache on purpose)
    """Fill and outline of a kind's box for the k-th stage a device holds (lighter for each later one)."""
    if (kind, k) not in cache:
        r, g, b = to_rgb(KIND_COLOURS[kind])
        light = [c + (1 - c) * 0.45 * k for c in (r, g, b)]
        cache[kind, k] = (to_hex(light), to_hex([c * 0.65 for c in light]))
    return cache[kind, k]


def _legend(marks: dict, kinds: set) -> dict:
    """A key to every mark drawn, and a sentence that reads the box labels that appear."""
    items = []
    for kind in "FRBW":
        if (kind, 0) in marks:
            words = _KIND_WORDS[kind] if kind != "B" or ("W", 0) in marks else "B backward"
            items.append({"label": words, "fill": marks[kind, 0], "shape": "box", "hatch": False})
    later = sorted({k for kind, k in (m for m in marks if m != "transfer") if k > 0})
    for k in later:
        items.append({"label": f"hatched, lighter: the {_ordinal(k + 1)} stage a device holds",
                      "fill": _colours("F", k)[0], "shape": "box", "hatch": True})
    if "transfer" in marks:
        items.append({"label": "transfer: from the send to the data's arrival (arrowhead)", "fill": "",
                      "shape": "line", "hatch": False})
    items.append({"label": "grey: the device waits (bubble)", "fill": IDLE_COLOUR, "shape": "box", "hatch": False})
    example = ("1F3" if "stage" in kinds else "F3") + (".1" if "chunk" in kinds else "")
    words = [f"Box labels: {example} is the forward pass (F) of micro-batch 3, counting from 0"]
    if "stage" in kinds:
        words.append("the first digit is the stage, because a device holds several")
    if "chunk" in kinds:
        words.append("“.1” is time chunk 1 of that micro-batch's sequences (wavefront)")
    words.append("B and W boxes read the same way; a label shows where the box is wide enough")
    for sizes in sorted(k[1] for k in kinds if isinstance(k, tuple)):
        each = [f"micro-batch 0 holds {sequences(sizes[0])}"] + [f"{mb} holds {b}" for mb, b in enumerate(sizes)][1:]
        words.append(f"the micro-batches differ in size: {', '.join(each[:-1])} and {each[-1]}, and a wider one's "
                     "boxes take longer")
    return {"marks": items, "labels": "; ".join(words) + ".", "idle": IDLE_COLOUR, "transfer": TRANSFER_COLOUR}


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
