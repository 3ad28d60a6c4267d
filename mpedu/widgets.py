"""Notebook widgets: drag layers between devices, choose schedule and micro-batches, see predicted and measured timelines."""
from __future__ import annotations

import dataclasses
import html
import json
import os
import threading

import anywidget
import ipywidgets as w
import torch
import traitlets
from matplotlib.colors import to_hex, to_rgb

from . import schedules
from .devices import get_device, get_devices, usable_cores
from .pipeline import Pipeline
from .placement import Placement
from .plot import IDLE_COLOUR, KIND_COLOURS, TRANSFER_COLOUR
from .profile import profile
from .footprint import device_footprints
from .recipes import CLIP, LR
from .simulate import simulate
from .training import step

from .link import LINKS

SCHEDULES = {"naive": "naive (one micro-batch at a time)", "gpipe": "GPipe", "1f1b": "1F1B",
             "interleaved": "interleaved 1F1B", "zb1": "zero bubble (ZB-H1)", "wavefront": "wavefront (time chunks)"}
# A CPU core computes about 100x slower than a GPU: a link slowed as much keeps a GPU's compute-to-communication ratio.
SLOWDOWNS = {1: "1× (as it is)", 10: "10×", 100: "100× (GPU-like)"}
# Activation recomputation (Pipeline's recompute=): the menu's keys; "none" is recompute=None
RECOMPUTE = {"none": "keep activations", "all": "recompute every micro-batch",
             "all-but-last": "recompute all but the last micro-batch"}

# The board is drawn in the browser from the synced traits below; a drop sends back a new `assignment`.
_ESM = r"""
function render({ model, el }) {
  // Redrawing replaces every chip; under a drag that would remove the chip being dragged (and the drop
  // with it). So a change that arrives mid-drag (the kernel's new notes, say) is drawn when the drag ends.
  let dragging = false, stale = false;
  const div = (cls, text = "") => Object.assign(document.createElement("div"), { className: cls, textContent: text });
  const move = (layer, device) => {
    const a = { ...model.get("assignment") };
    if (model.get("locked") || a[layer] === device) return;
    a[layer] = device;
    model.set("assignment", a);
    model.save_changes();
  };
  const draw = () => {
    // A redraw replaces the chips, and with them the keyboard focus: a chip that had it gets it back, on
    // every redraw (the move itself, then the kernel's new notes), so the next arrow press works too.
    const focused = el.contains(document.activeElement) ? document.activeElement.dataset.layer : null;
    const [layers, devices, a, costs, notes, locked] =
      ["layers", "devices", "assignment", "layer_notes", "device_notes", "locked"].map((n) => model.get(n));
    const stageOf = {};                   // a run of neighbouring layers on one device is a stage
    layers.forEach((l, i) => { stageOf[l] = i && stageOf[layers[i - 1]] + (a[l] !== a[layers[i - 1]]); });
    el.replaceChildren();
    el.classList.add("mpedu-board");
    el.classList.toggle("mpedu-locked", locked);
    devices.forEach((dev, k) => {
      const col = div("mpedu-device");
      col.dataset.device = dev;
      col.append(div("mpedu-head", dev));
      let box = null;
      for (const l of layers.filter((l) => a[l] === dev)) {
        if (!box || box.dataset.stage !== String(stageOf[l])) {
          box = div("mpedu-stage");
          box.dataset.stage = stageOf[l];
          box.append(div("mpedu-stage-name", `stage ${stageOf[l]}`));
          col.append(box);
        }
        const chip = Object.assign(div("mpedu-chip"), { draggable: !locked, tabIndex: 0,
                                                         title: "drag to another device, or press ← / →" });
        chip.dataset.layer = l;
        // JupyterLab and Notebook 7 bind keys of their own (the arrows, in command mode) on the whole page;
        // this attribute tells their shortcut handler to leave a chip's keys to the chip
        chip.dataset.lmSuppressShortcuts = "true";
        chip.append(div("mpedu-name", l), div("mpedu-cost", costs[l] || ""));
        chip.addEventListener("dragstart", (e) => { dragging = true; e.dataTransfer.setData("text/plain", l); });
        chip.addEventListener("dragend", () => { dragging = false; if (stale) { stale = false; draw(); } });
        chip.addEventListener("keydown", (e) => {
          const step = { ArrowLeft: -1, ArrowRight: 1 }[e.key];
          if (!step) return;
          e.preventDefault();
          e.stopPropagation();            // the notebook would take the arrows to move between cells
          const to = devices[k + step];
          if (to) move(l, to);
        });
        box.append(chip);
      }
      if (!box) col.append(div("mpedu-empty", "no layer: drop one here"));
      if (notes[dev]) {
        const meter = div("mpedu-meter"), fill = div("mpedu-fill");
        fill.style.width = `${Math.round(100 * notes[dev].fill)}%`;
        meter.append(fill);
        col.append(div("mpedu-foot", notes[dev].text), meter);
      }
      col.addEventListener("dragover", (e) => { e.preventDefault(); col.classList.add("mpedu-over"); });
      col.addEventListener("dragleave", (e) => col.contains(e.relatedTarget) || col.classList.remove("mpedu-over"));
      col.addEventListener("drop", (e) => {
        e.preventDefault();
        col.classList.remove("mpedu-over");
        const l = e.dataTransfer.getData("text/plain");
        if (layers.includes(l)) move(l, dev);
      });
      el.append(col);
    });
    if (focused) el.querySelector(`[data-layer="${focused}"]`)?.focus({ preventScroll: true });
  };
  const redraw = () => { if (dragging) stale = true; else draw(); };
  const names = ["layers", "devices", "assignment", "layer_notes", "device_notes", "locked"];
  names.forEach((n) => model.on(`change:${n}`, redraw));
  draw();
  return () => names.forEach((n) => model.off(`change:${n}`, redraw));
}
export default { render };
"""

# The timeline, drawn in the browser as SVG from the events Python sends (a few kB of JSON): a PNG made by
# matplotlib took most of a redraw's time. Python sends the colours and labels, so the two agree with plot.py.
_TIMELINE_ESM = r"""
let serial = 0;                           // pattern ids must be unique on a page with several explorers
function render({ model, el }) {
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
  const draw = () => {
    const panels = model.get("panels"), legend = model.get("legend");
    el.replaceChildren();
    el.classList.add("mpedu-timeline");
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
      for (const p of panels) {
        s.append(svg("text", { x: 2, y: y + 16, class: "mpedu-tl-title" }, p.title));
        y += head;
        const top = (r) => y + r * row + (row - box) / 2;
        p.devices.forEach((d, r) => {
          s.append(svg("text", { x: left - 8, y: top(r) + box / 2 + 4, "text-anchor": "end",
                                 class: "mpedu-tl-device" }, d));
          s.append(svg("rect", { x: x(0), y: top(r), width: x(p.end) - x(0), height: box, fill: legend.idle }));
        });
        for (const [r, t0, dt, fill, stroke, hatched, label] of p.boxes) {
          const bx = x(t0), bw = Math.max(x(t0 + dt) - bx, 0.8);
          s.append(svg("rect", { x: bx, y: top(r), width: bw, height: box, fill, stroke, "stroke-width": 0.6 }));
          if (hatched) s.append(svg("rect", { x: bx, y: top(r), width: bw, height: box, fill: `url(#${hatchId})` }));
          if (bw >= 6.6 * label.length + 4) {
            s.append(svg("text", { x: bx + bw / 2, y: top(r) + box / 2 + 4, "text-anchor": "middle",
                                   class: "mpedu-tl-label" }, label));
          }
        }
        for (const [r0, t0, r1, t1] of p.transfers) {
          const down = r1 > r0;
          s.append(svg("line", { x1: x(t0), y1: down ? top(r0) + box : top(r0),
                                 x2: x(t1), y2: down ? top(r1) : top(r1) + box,
                                 stroke: legend.transfer, "stroke-width": 0.9, opacity: 0.8,
                                 "marker-end": `url(#${arrowId})` }));
        }
        y += row * p.devices.length;
      }
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

# JupyterLab's colour variables, with plain fallbacks for front ends that lack them. Text is 12 px or more.
_CSS = """
.mpedu-board { display: flex; gap: 8px; flex-wrap: wrap; font-size: 13px; color: var(--jp-ui-font-color1, #222); }
.mpedu-device { flex: 1 1 0; min-width: 130px; max-width: 210px; padding: 4px; border-radius: 6px;
  border: 1px solid var(--jp-border-color1, #bbb); background: var(--jp-layout-color2, #f3f3f3);
  display: flex; flex-direction: column; gap: 4px; }
.mpedu-device.mpedu-over { outline: 2px dashed var(--jp-brand-color1, #1976d2); }
.mpedu-head { font-weight: bold; text-align: center; }
.mpedu-stage { border: 1px dotted var(--jp-border-color2, #999); border-radius: 4px; padding: 2px;
  display: flex; flex-direction: column; gap: 3px; }
.mpedu-stage-name, .mpedu-empty, .mpedu-cost { font-size: 12px; color: var(--jp-ui-font-color2, #555); }
.mpedu-empty { text-align: center; padding: 8px 0; }
.mpedu-chip { display: flex; justify-content: space-between; gap: 6px; padding: 3px 6px; cursor: grab;
  border-radius: 4px; border: 1px solid #3a7bbf; background: #dcebf8; color: #111; user-select: none; }
.mpedu-cost { color: #444; }
.mpedu-chip:focus { outline: 2px solid #e69f00; }
.mpedu-foot { margin-top: auto; font-size: 12px; white-space: pre-line; }
.mpedu-meter { height: 5px; background: var(--jp-layout-color3, #ddd); border-radius: 3px; }
.mpedu-fill { height: 100%; background: #0072b2; border-radius: 3px; }
.mpedu-locked .mpedu-chip { cursor: default; opacity: 0.6; }
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
.mpedu-explorer .widget-html-content { line-height: 1.45; }   /* not the 28 px line of a control */
.mpedu-explorer .mpedu-note { font-size: 13px; color: var(--jp-ui-font-color2, #444); }
"""


class LayerBoard(anywidget.AnyWidget):
    """One column per device holding draggable layer chips; `assignment` (layer -> device) is what Python reads."""

    _esm = _ESM
    _css = _CSS
    layers = traitlets.List(traitlets.Unicode()).tag(sync=True)       # model order
    devices = traitlets.List(traitlets.Unicode()).tag(sync=True)      # one column each, empty ones too
    assignment = traitlets.Dict().tag(sync=True)                      # layer name -> device name
    layer_notes = traitlets.Dict().tag(sync=True)                     # layer -> short text on its chip
    device_notes = traitlets.Dict().tag(sync=True)                    # device -> {"text", "fill" 0..1}
    locked = traitlets.Bool(False).tag(sync=True)                     # True while a run trains


class TimelineView(anywidget.AnyWidget):
    """Timelines stacked on one time axis (predicted above measured), drawn by the browser. Set `panels` and
    `legend` (see `timeline_panel`), then bump `revision`: the page redraws once per revision."""

    _esm = _TIMELINE_ESM
    _css = _CSS
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
    """One panel's data: boxes [row, start ms, length ms, fill, outline, hatched, label], transfers
    [sender row, start ms, receiver row, arrival ms]; and the marks and kinds of label it uses."""
    rows = {d: i for i, d in enumerate(timeline.devices)}
    compute = timeline.compute()
    held = {d: sorted({e.stage for e in compute if e.device == d}) for d in rows}
    several = any(len(s) > 1 for s in held.values())
    chunked = any(e.chunk for e in compute)
    order = {(d, s): k for d, stages in held.items() for k, s in enumerate(stages)}
    boxes, marks = [], {}
    for e in compute:
        if e.device not in rows:
            continue
        k = order[e.device, e.stage]
        fill, outline = _colours(e.kind, k)
        marks[e.kind, k] = fill
        label = (f"{e.stage}{e.kind}{e.mb}" if several else f"{e.kind}{e.mb}") + (f".{e.chunk}" if chunked else "")
        boxes.append([rows[e.device], round(e.start * 1e3, 4), round(e.duration * 1e3, 4), fill, outline, k > 0,
                      label])
    transfers = [[rows[e.device], round(e.start * 1e3, 4), rows[e.peer], round(e.end * 1e3, 4)]
                 for e in timeline.transfers() if e.device in rows and e.peer in rows]
    if transfers:
        marks["transfer"] = TRANSFER_COLOUR
    kinds = {"stage"} if several else set()
    if chunked:
        kinds.add("chunk")
    panel = {"title": title, "devices": list(timeline.devices), "end": round(end * 1e3, 4), "boxes": boxes,
             "transfers": transfers}
    return panel, marks, kinds


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
    return {"marks": items, "labels": "; ".join(words) + ".", "idle": IDLE_COLOUR, "transfer": TRANSFER_COLOUR}


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


class Refusal(ValueError):
    """A choice the explorer cannot predict, in the learner's words; `fix` is (button text, callable) or None."""

    def __init__(self, message: str, fix=None):
        super().__init__(message)
        self.fix = fix


def _sequences(b: int) -> str:
    return f"{b} sequence" if b == 1 else f"{b} sequences"


class PipelineExplorer(w.VBox):
    """Place layers on devices by dragging, pick a schedule, micro-batches and a link, and see the predicted
    step at once; Run trains a few real steps (SGD: it updates the model) and draws them under the prediction.

        explorer = PipelineExplorer(model, batch, devices=2, schedule="gpipe", micro_batches=4)
        explorer                      # the last line of a cell shows it
        explorer.placement            # the board as a Placement (None while it is refused); assignable

    Costs come from `profile`, measured once per micro-batch shape (pass `costs`, one or a list, to reuse
    yours). A new
    micro-batch size is first drawn from the nearest measured size, scaled per sequence, while its real costs
    are measured in the background; the drawing then updates by itself.
    """

    def __init__(self, model, batch, devices: int | list = 2, schedule: str = "gpipe", micro_batches: int = 4,
                 chunks: int = 2, costs=None, steps: int = 5, link: str = "shared", slowdown: int = 1,
                 state_file=None, recompute: str | None = None):
        T, B = batch.inputs.shape
        if B % micro_batches:
            raise ValueError(f"micro_batches={micro_batches} does not divide the batch size {B}; "
                             f"use one of {[m for m in range(1, B + 1) if B % m == 0]}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if (recompute or "none") not in RECOMPUTE:
            raise ValueError(f"unknown recompute {recompute!r}; choose None, 'all' or 'all-but-last'")
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose one of {', '.join(LINKS)}")
        self.model, self.batch, self.steps = model, batch, steps
        self.state_file = state_file or os.environ.get("MPEDU_WIDGET_STATE")   # for the browser test
        known = [] if costs is None else [costs] if hasattr(costs, "micro_batch") else list(costs)
        self._costs = {tuple(c.micro_batch): c for c in known}   # by (T, sequences per micro-batch)
        self.predicted = self.measured = None
        self.figures, self.losses, self.running, self._redraws, self._runs = {}, [], False, 0, 0
        self._quiet, self._thread, self._stop, self._measuring = False, None, threading.Event(), {}
        self._update_lock = threading.RLock()              # the kernel and a finished measurement both redraw
        self._model_lock = threading.Lock()                # measuring and training both use the model
        self._fix = None
        L = len(model.layer_names)
        names = [d.name for d in (get_devices(devices) if isinstance(devices, int) else map(get_device, devices))]
        start = Placement.even(model, names)

        wide = {"style": {"description_width": "initial"}, "continuous_update": False}   # redraw on release
        self.board = LayerBoard(layers=model.layer_names, devices=names,
                                assignment={k: v.name for k, v in start.assignment.items()})
        # every device needs a layer: the slider offers no count that is always refused
        self.device_count = w.IntSlider(len(names), 1, L, description="devices", **wide)
        self.micro_batches = w.SelectionSlider(options=[m for m in range(1, B + 1) if B % m == 0],
                                               value=micro_batches, description="micro-batches", **wide)
        menu = {"style": wide["style"], "layout": w.Layout(width="max-content")}   # never cut the longest name
        self.schedule_menu = w.Dropdown(options=[(text, key) for key, text in SCHEDULES.items()], value=schedule,
                                        description="schedule", **menu)
        self.chunks = w.IntSlider(chunks, 1, max(1, min(8, T)), description="time chunks (wavefront only)",
                                  **wide)
        self.link_menu = w.Dropdown(options=[(_link_label(k, v), k) for k, v in LINKS.items()],
                                    value=link, description="link", **menu)
        self.slowdown = w.Dropdown(options=[(text, f) for f, text in SLOWDOWNS.items()], value=slowdown,
                                   description="GPU-like slow-down", **menu,
                                   tooltip="an emulated link this many times slower: a CPU core computes ~100× "
                                           "slower than a GPU, so 100× keeps a GPU's ratio of compute to transfer")
        self.recompute_menu = w.Dropdown(options=[(text, key) for key, text in RECOMPUTE.items()],
                                         value=recompute or "none", description="activations", **menu,
                                         tooltip="recompute: keep only each stage's input and run its forward "
                                                 "again before the backward (less memory, more time)")
        self.message, self.figure_line, self.note, self.run_status = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.note.add_class("mpedu-note")
        self.fix_button = w.Button(layout=w.Layout(display="none", width="max-content"))
        self.timeline = TimelineView()
        self.run_button = w.Button(description=f"Run {steps} steps", icon="play", button_style="success")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True)
        self.progress = w.IntProgress(0, 0, steps, description="trained", layout=w.Layout(display="none"))

        self.board.observe(self._update, ["assignment", "devices"])
        for control in (self.micro_batches, self.schedule_menu, self.chunks, self.link_menu, self.slowdown,
                        self.recompute_menu):
            control.observe(self._update, "value")
        self.device_count.observe(self._resize, "value")
        self.fix_button.on_click(lambda _: self._fix and self._fix[1]())
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([self.board, w.HBox([self.device_count, self.micro_batches]),
                          w.HBox([self.schedule_menu, self.chunks]), w.HBox([self.link_menu, self.slowdown]),
                          self.recompute_menu,
                          self.message, self.fix_button, self.figure_line, self.note, self.timeline,
                          w.HBox([self.run_button, self.stop_button, self.progress]), self.run_status])
        self.add_class("mpedu-explorer")
        self._update()

    def __repr__(self) -> str:   # short and free of widget ids: notebooks save it as the text/plain output
        return (f"PipelineExplorer({self.placement or 'refused placement'}, schedule={self.schedule_menu.value}, "
                f"micro_batches={self.micro_batches.value})")

    # -- the board ----------------------------------------------------------------------
    @property
    def placement(self) -> Placement | None:
        """The board as a Placement, or None while it is refused (the message says why)."""
        try:
            return self._check()[0]
        except ValueError:
            return None

    @placement.setter
    def placement(self, placement: Placement | str | dict) -> None:
        if not isinstance(placement, Placement):
            placement = (Placement.parse if isinstance(placement, str) else Placement.from_dict)(placement, self.model)
        names = sorted({d.name for d in placement.devices}, key=lambda n: (len(n), n))   # vgpu:2 before vgpu:10
        self._set_board(names, {k: v.name for k, v in placement.assignment.items()})

    @property
    def recompute(self) -> str | None:
        """The menu's choice as Pipeline's recompute= (None: keep activations)."""
        return None if self.recompute_menu.value == "none" else self.recompute_menu.value

    @property
    def link(self):
        """The link the prediction and Run use: the menu's preset, slowed by the slow-down factor."""
        link = LINKS[self.link_menu.value]
        return link.slowed(self.slowdown.value) if link.emulated and self.slowdown.value != 1 else link

    def _set_board(self, devices: list[str], assignment: dict) -> None:
        """Change columns, chips and device count together, then redraw once."""
        self._quiet = True
        try:
            self.board.devices, self.board.assignment, self.device_count.value = devices, assignment, len(devices)
        finally:
            self._quiet = False
        self._update()

    def _resize(self, change) -> None:
        """A new device count splits the layers evenly (as many on each device); drag to rebalance."""
        if self._quiet:
            return
        names = [d.name for d in get_devices(change["new"])]
        self._set_board(names, {k: v.name for k, v in Placement.even(self.model, names).assignment.items()})

    def _check(self):
        """(placement, schedule) for the current choices; a Refusal says, in the words on screen, what is wrong
        and what to do (the library's own messages name its arguments, which a learner here never typed)."""
        devices, assignment, layers = self.board.devices, self.board.assignment, self.model.layer_names
        if len(devices) > len(layers):
            raise Refusal(f"{len(devices)} devices but only {len(layers)} layers: every device needs a layer. "
                          f"Use at most {len(layers)} devices.")
        placement = Placement(layers, assignment)
        empty = [d for d in devices if d not in assignment.values()]
        if empty:
            raise Refusal(f"{empty[0]} holds no layer: drag a layer onto it, or use fewer devices.")
        name, m = self.schedule_menu.value, self.micro_batches.value
        stage_devices, p = placement.stage_devices, len(devices)
        several = len(set(stage_devices)) != len(stage_devices)
        dealt = len(stage_devices) % p == 0 and all(d == s % p for s, d in enumerate(stage_devices))
        if name in ("1f1b", "zb1") and several and not (name == "1f1b" and dealt):
            stages = placement.stages
            d = next(dev for dev, _ in stages if [x for x, _ in stages].count(dev) > 1)
            runs = [" ".join(ls) for dev, ls in stages if dev == d]
            raise Refusal(f"{SCHEDULES[name]} needs each device to hold one stage (one run of neighbouring "
                          f"layers), but {d.name} holds {len(runs)}: {' / '.join(runs)}. Drag those layers "
                          f"together onto one device, or pick GPipe in the schedule menu.",
                          fix=("use GPipe", lambda: setattr(self.schedule_menu, "value", "gpipe")))
        if name == "interleaved" or (name == "1f1b" and several):   # 1F1B on stages dealt in turn interleaves
            self._check_interleaved(placement, dealt, p, m, SCHEDULES[name])
        chunks = self.chunks.value if name == "wavefront" else 1
        return placement, schedules.make(name, stage_devices, m, chunks)

    def _check_interleaved(self, placement, dealt: bool, p: int, m: int, label: str) -> None:
        layers = self.model.layer_names
        if p < 2 or 2 * p > len(layers):
            most = len(layers) // 2
            use = "pick 1F1B" if most < 2 else f"use {'2' if most == 2 else f'2 to {most}'} devices, or pick 1F1B"
            raise Refusal(f"{label} needs 2 or more devices, each holding 2 or more stages, so at least "
                          f"{max(2 * p, 4)} layers for {max(p, 2)} devices; this model has {len(layers)}. "
                          f"{use[0].upper()}{use[1:]}.")
        if not dealt or len(placement.stages) < 2 * p:
            dealing = _dealt(layers, self.board.devices)
            raise Refusal(f"{label} needs the layers dealt to the devices in turn, at least twice round: a run "
                          f"of layers on {self.board.devices[0]}, the next on {self.board.devices[1]}, and so on, "
                          f"then {self.board.devices[0]} again. For example: {dealing}. Drag the chips that way, "
                          f"press the button below, or pick 1F1B.",
                          fix=("deal the layers in turn", lambda: setattr(self, "placement", dealing)))
        if m % p:
            fits = [k for k in self.micro_batches.options if k % p == 0]
            if fits:
                best = min(fits, key=lambda k: abs(k - m))
                raise Refusal(f"{label} sends micro-batches round the {p} devices in groups of {p}, so their number "
                              f"must be a multiple of {p}; you chose {m}. Pick {best} micro-batches.",
                              fix=(f"use {best} micro-batches", lambda: setattr(self.micro_batches, "value", best)))
            others = [q for q in range(2, len(layers) // 2 + 1)
                      if any(k % q == 0 for k in self.micro_batches.options)]
            raise Refusal(f"{label} sends micro-batches round the {p} devices in groups of {p}, but a batch of "
                          f"{self.batch.inputs.shape[1]} sequences splits into "
                          f"{', '.join(map(str, self.micro_batches.options))} micro-batches, none a multiple of "
                          f"{p}. Use {' or '.join(map(str, others))} devices, or pick 1F1B.")

    # -- prediction ---------------------------------------------------------------------
    def _costs_for(self, m: int, device):
        """(costs, measured): the layers' costs on micro-batches of B/m sequences. Not measured yet: the nearest
        measured size scaled per sequence now, and a background measurement that redraws when it is done."""
        T, B = self.batch.inputs.shape
        key = (T, B // m)
        if key in self._costs:
            return self._costs[key], True
        if not self._costs:                                # nothing to start from: measure now, once
            self.message.value = f"measuring the layers on micro-batches of {_sequences(B // m)} (once)…"
            with self._model_lock:
                self._costs[key] = profile(self.model, self.batch, device, micro_batches=m, warmup=1, repeats=3)
            return self._costs[key], True
        if m not in self._measuring:
            thread = threading.Thread(target=self._measure, args=(m, device), daemon=True,
                                      name=f"mpedu-explorer-measure-{m}")
            self._measuring[m] = thread
            thread.start()
        nearest = min(self._costs.values(), key=lambda c: abs(c.micro_batch[1] - B // m))
        return _scaled(nearest, B // m), False

    def _measure(self, m: int, device) -> None:
        T, B = self.batch.inputs.shape
        try:
            with self._model_lock:                         # waits for a run to end
                costs = profile(self.model, self.batch, device, micro_batches=m, warmup=1, repeats=3)
            self._costs[T, B // m] = costs
        except Exception as error:                         # shown in the widget, never as a traceback
            self.note.value = _error(f"could not measure micro-batches of {_sequences(B // m)}: {error}")
            return
        finally:
            self._measuring.pop(m, None)
        if self.micro_batches.value == m and not self.running:
            self._update()

    def _update(self, *_) -> None:
        """Check, simulate, redraw. Runs on every change, so it must stay fast (a few ms of Python)."""
        if self._quiet:
            return
        with self._update_lock:
            self.chunks.disabled = self.running or self.schedule_menu.value != "wavefront"
            self.slowdown.disabled = self.running or not LINKS[self.link_menu.value].emulated
            # a change makes the last run's numbers stale: they go, whether or not the new choice is accepted
            self.measured, self.run_status.value = None, ""
            self.progress.layout.display = "none"
            try:
                placement, schedule = self._check()
                costs, measured = self._costs_for(schedule.micro_batches, placement.devices[0])
                self.predicted = simulate(schedule, costs, placement, link=self.link, recompute=self.recompute)
            except ValueError as error:
                self.predicted, self.figures, self._fix = None, {}, getattr(error, "fix", None)
                self.message.value, self.figure_line.value, self.note.value = _error(error), "", ""
                self.board.device_notes = {}
                self.timeline.layout.display, self.run_button.disabled = "none", True   # no blank space left
                self.timeline.show([], [])
            else:
                self._fix = None
                self._describe(placement, schedule, costs, measured)
                self.message.value = f"placement: <code>{html.escape(str(placement))}</code>"
                self.timeline.show([self.predicted],
                                   [self._title(self.predicted, "predicted step" if measured else "estimated step")])
                self.timeline.layout.display, self.run_button.disabled = None, self.running
            self.fix_button.description = self._fix[0] if self._fix else ""
            self.fix_button.layout.display = None if self._fix else "none"
            self._redraws += 1
            self._save_state()

    @staticmethod
    def _title(t, name: str) -> str:
        return f"{name}: {t.makespan * 1e3:.1f} ms, bubble {t.bubble_fraction:.0%}"

    def _describe(self, placement, schedule, costs, measured: bool) -> None:
        """The line of figures, a note where the numbers need a word, and the numbers on the board."""
        t = self.predicted
        one = simulate("naive", costs, Placement.single(self.model, placement.devices[0]),
                       micro_batches=schedule.micro_batches)
        # weights, gradients and the activations at the schedule's peak: the one memory model (SGD keeps no state)
        memory = {f.device: f.total for f in device_footprints(costs, placement, schedule, self.recompute)}
        self.figures = f = {"makespan_s": t.makespan, "bubble": t.bubble_fraction, "speedup": one.makespan / t.makespan,
                            "transfers": len(t.transfers()), "bytes_moved": t.bytes_moved,
                            "stages": len(placement.stages), "memory_bytes": memory, "estimated": not measured}
        m = schedule.micro_batches
        self.figure_line.value = (
            f"{'estimated' if not measured else 'predicted'} step <b>{f['makespan_s'] * 1e3:.1f} ms</b> · "
            f"bubble <b>{f['bubble']:.0%}</b> · <b>{f['speedup']:.2f}×</b> the speed of one device doing the same "
            f"{m} micro-batch{'es' if m > 1 else ''} · <b>{f['transfers']}</b> transfers "
            f"({f['bytes_moved'] / 1e6:.1f} MB) · {f['stages']} stages on {len(t.devices)} devices")
        self.note.value = self._note(costs, measured)
        top = max(memory.values()) or 1
        self.board.device_notes = {d: {"text": f"busy {t.busy(d) * 1e3:.0f} ms of {t.makespan * 1e3:.0f}\n"
                                               f"memory {memory[d] / 1e6:.1f} MB", "fill": memory[d] / top}
                                   for d in t.devices}
        self.board.layer_notes = {name: f"{(fw + bw) * 1e3:.1f} ms"
                                  for name, fw, bw in zip(costs.names, costs.forward, costs.backward)}

    def _note(self, costs, measured: bool) -> str:
        """Why the numbers may surprise: an estimate, or small micro-batches that make every layer slower."""
        b = costs.micro_batch[1]
        if not measured:
            return (f"Estimated from the nearest measured micro-batch size, scaled per sequence; measuring the "
                    f"layers on micro-batches of {_sequences(b)} now (the numbers update by themselves)…")
        per_sequence = {c.micro_batch[1]: (sum(c.forward) + sum(c.backward)) / c.micro_batch[1]
                        for c in self._costs.values() if c.micro_batch[0] == costs.micro_batch[0]}
        best = min(per_sequence, key=per_sequence.get)
        ratio = per_sequence[b] / per_sequence[best]
        if ratio < 1.15:
            return ""
        return (f"Micro-batches of {_sequences(b)} cost the layers {ratio:.1f}× the time per sequence that "
                f"micro-batches of {_sequences(best)} do (small matrix products keep a core less busy). So the step "
                f"can get slower while the speed against one device rises: that device does the same small "
                f"micro-batches one after another.")

    # -- real steps ---------------------------------------------------------------------
    def run(self, steps: int | None = None) -> None:
        """Train `steps` real steps with the current choices on a background thread (the kernel stays free)."""
        if self.running or self.predicted is None:
            return
        placement, schedule = self._check()
        steps, cores = steps or self.steps, len(usable_cores())
        # more virtual devices than cores take turns on them: say what to expect here, next to the prediction
        shared = all(d.virtual for d in placement.devices) and len(placement.devices) > cores
        costs, _ = self._costs_for(schedule.micro_batches, placement.devices[0])
        here = (simulate(schedule, costs, placement, cores=cores, link=self.link, recompute=self.recompute)
                if shared else None)
        self.running, self.losses, self._runs = True, [], self._runs + 1
        self._stop.clear()
        self._lock(True)
        self.progress.max, self.progress.value, self.run_status.value = steps, 0, "starting the devices…"
        self.progress.layout.display = None
        self._save_state()
        self._thread = threading.Thread(target=self._train, args=(placement, schedule, here, steps, cores),
                                        name="mpedu-explorer-run", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the run to stop after the step it is on."""
        if self.running:
            self._stop.set()
            self.run_status.value = "stopping after this step…"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run and any measurement have ended (for scripts and tests; the widget never waits)."""
        for thread in [self._thread, *list(self._measuring.values())]:
            if thread is not None:
                thread.join(timeout)

    def _train(self, placement, schedule, here, steps, cores) -> None:
        # the command line's step (mpedu.training.step), with its learning rate and clipping, for a few steps
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer, done, predicted = torch.optim.SGD(params, lr=LR), 0, self.predicted
        expect = (f" ({len(placement.devices)} devices take turns on {cores} cores here: about "
                  f"{here.makespan * 1e3:.0f} ms expected)" if here is not None else "")
        try:
            with self._model_lock, Pipeline(self.model, placement, schedule, link=self.link,
                                            recompute=self.recompute) as pipe:
                while done < steps and not self._stop.is_set():
                    result, stepped = step(pipe, optimizer, self.batch, clip=CLIP)
                    if not stepped:     # the weights stay as they were: say so rather than train on
                        raise FloatingPointError(f"step {done + 1}: the loss ({result.loss:.4g}) or a gradient is "
                                                 "not finite, so the weights were left as they were and the run "
                                                 "stopped")
                    done += 1
                    self.measured = result.timeline
                    self.losses.append(result.loss)
                    self.progress.value = done
                    self.timeline.show([predicted, result.timeline],
                                       [self._title(predicted, "predicted step"),
                                        self._title(result.timeline, f"measured step {done}") + expect])
                    self.run_status.value = f"step {done}/{steps}: loss {result.loss:.3f}"
                    self._save_state()
            if done < steps:
                self.run_status.value += f" · stopped after {done} of {steps} steps"
        except Exception as error:                        # shown in the widget, never as a traceback
            self.run_status.value = _error(error)
        finally:
            self.running = False
            self._lock(False)
            self._save_state()

    def _lock(self, on: bool) -> None:
        """While a run trains, the choices stay as they were when it started."""
        for control in (self.device_count, self.micro_batches, self.schedule_menu, self.link_menu, self.run_button,
                        self.fix_button, self.recompute_menu):
            control.disabled = on
        self.chunks.disabled = on or self.schedule_menu.value != "wavefront"
        self.slowdown.disabled = on or not LINKS[self.link_menu.value].emulated
        self.board.locked, self.stop_button.disabled = on, not on

    def _save_state(self) -> None:
        """What Python sees, as JSON (written whole, then renamed: a reader never sees half a file)."""
        if self.state_file:
            placement = self.placement
            state = {"placement": placement and str(placement), "assignment": self.board.assignment,
                     "devices": self.board.devices, "schedule": self.schedule_menu.value,
                     "recompute": self.recompute_menu.value,
                     "micro_batches": self.micro_batches.value, "figures": self.figures, "redraws": self._redraws,
                     "message": self.message.value, "progress": self.progress.value, "losses": self.losses,
                     "running": self.running, "runs": self._runs, "revision": self.timeline.revision,
                     "link": self.link_menu.value, "measuring": sorted(self._measuring)}
            tmp = f"{self.state_file}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_file)


def _scaled(costs, b: int):
    """`costs` for micro-batches of b sequences, scaled per sequence (an estimate: small ones cost more)."""
    r = b / costs.micro_batch[1]
    times = lambda xs: [x * r for x in xs]             # noqa: E731
    sizes = lambda xs: [int(x * r) for x in xs]        # noqa: E731
    return dataclasses.replace(costs, forward=times(costs.forward), backward=times(costs.backward),
                               backward_input=times(costs.backward_input),
                               backward_weight=times(costs.backward_weight),
                               activation_bytes=sizes(costs.activation_bytes), output_bytes=sizes(costs.output_bytes),
                               shared_bytes=sizes(costs.shared_bytes), micro_batch=(costs.micro_batch[0], b))


def _dealt(layers: list[str], devices: list[str]) -> str:
    """The layers cut into 2p runs as even as can be, run r on device r mod p: what interleaved 1F1B needs."""
    runs = 2 * len(devices)
    q, extra = divmod(len(layers), runs)
    groups, start = [], 0
    for r in range(runs):
        size = q + (r < extra)
        groups.append(f"{','.join(layers[start:start + size])}:{devices[r % len(devices)].replace(':', '')}")
        start += size
    return " | ".join(groups)


def _link_label(key: str, link) -> str:
    speed = "no added delay" if not link.emulated else (
        f"{link.latency_s * 1e6:g} µs + "
        + ("no bandwidth limit" if link.bandwidth_Bps == float("inf") else f"{link.bandwidth_Bps / 1e9:g} GB/s"))
    return f"{getattr(link, 'name', key)} ({speed})"


def _error(error) -> str:
    return f'<div style="color:#b3261e; white-space:pre-wrap">⚠ {html.escape(str(error))}</div>'
