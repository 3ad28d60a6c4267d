"""Notebook widgets: drag layers between devices, choose schedule and micro-batches, see predicted and measured timelines."""
from __future__ import annotations

import html
import io
import json
import os
import threading

import anywidget
import ipywidgets as w
import torch
import traitlets
from matplotlib.figure import Figure

from . import schedules
from .devices import get_device, get_devices, usable_cores
from .pipeline import Pipeline
from .placement import Placement
from .plot import plot_timeline
from .profile import profile
from .simulate import peak_in_flight, simulate
from .train import CLIP, LR

SCHEDULES = {"naive": "naive (one micro-batch at a time)", "gpipe": "GPipe", "1f1b": "1F1B",
             "interleaved": "interleaved 1F1B", "zb1": "zero bubble (ZB-H1)", "wavefront": "wavefront (time chunks)"}

# The board is drawn in the browser from the synced traits below; a drop sends back a new `assignment`.
_ESM = r"""
function render({ model, el }) {
  let focusLayer = null;                  // a chip moved with the arrow keys keeps the keyboard
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
        chip.append(div("mpedu-name", l), div("mpedu-cost", costs[l] || ""));
        chip.addEventListener("dragstart", (e) => { dragging = true; e.dataTransfer.setData("text/plain", l); });
        chip.addEventListener("dragend", () => { dragging = false; if (stale) { stale = false; draw(); } });
        chip.addEventListener("keydown", (e) => {
          const to = devices[k + ({ ArrowLeft: -1, ArrowRight: 1 }[e.key] || 0)];
          if (to && to !== dev) { e.preventDefault(); focusLayer = l; move(l, to); }
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
    if (focusLayer) el.querySelector(`[data-layer="${focusLayer}"]`)?.focus();
    focusLayer = null;
  };
  const redraw = () => { if (dragging) stale = true; else draw(); };
  const names = ["layers", "devices", "assignment", "layer_notes", "device_notes", "locked"];
  names.forEach((n) => model.on(`change:${n}`, redraw));
  draw();
  return () => names.forEach((n) => model.off(`change:${n}`, redraw));
}
export default { render };
"""

# JupyterLab's colour variables, with plain fallbacks for front ends that lack them.
_CSS = """
.mpedu-board { display: flex; gap: 8px; flex-wrap: wrap; font-size: 12px; color: var(--jp-ui-font-color1, #222); }
.mpedu-device { flex: 1 1 0; min-width: 120px; max-width: 200px; padding: 4px; border-radius: 6px;
  border: 1px solid var(--jp-border-color1, #bbb); background: var(--jp-layout-color2, #f3f3f3);
  display: flex; flex-direction: column; gap: 4px; }
.mpedu-device.mpedu-over { outline: 2px dashed var(--jp-brand-color1, #1976d2); }
.mpedu-head { font-weight: bold; text-align: center; }
.mpedu-stage { border: 1px dotted var(--jp-border-color2, #999); border-radius: 4px; padding: 2px;
  display: flex; flex-direction: column; gap: 3px; }
.mpedu-stage-name, .mpedu-empty, .mpedu-cost { font-size: 10px; color: var(--jp-ui-font-color2, #666); }
.mpedu-empty { text-align: center; padding: 8px 0; }
.mpedu-chip { display: flex; justify-content: space-between; gap: 6px; padding: 3px 6px; cursor: grab;
  border-radius: 4px; border: 1px solid #3a7bbf; background: #dcebf8; color: #111; user-select: none; }
.mpedu-cost { color: #555; }
.mpedu-chip:focus { outline: 2px solid #e69f00; }
.mpedu-foot { margin-top: auto; font-size: 10px; white-space: pre-line; }
.mpedu-meter { height: 5px; background: var(--jp-layout-color3, #ddd); border-radius: 3px; }
.mpedu-fill { height: 100%; background: #0072b2; border-radius: 3px; }
.mpedu-locked .mpedu-chip { cursor: default; opacity: 0.6; }
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


class PipelineExplorer(w.VBox):
    """Place layers on devices by dragging, pick a schedule and micro-batches, and see the predicted step
    at once; Run trains a few real steps (SGD: it updates the model) and draws them under the prediction.

        explorer = PipelineExplorer(model, batch, devices=2, schedule="gpipe", micro_batches=4)
        explorer                      # the last line of a cell shows it
        explorer.placement            # the board as a Placement (None while it is invalid); assignable

    Costs come from `profile`, measured once per micro-batch shape (pass `costs` to reuse yours).
    `state_file` (default: $MPEDU_WIDGET_STATE) receives a JSON copy of what Python sees after
    every change, for tests that drive the widget from a browser.
    """

    def __init__(self, model, batch, devices: int | list = 2, schedule: str = "gpipe", micro_batches: int = 4,
                 chunks: int = 2, costs=None, steps: int = 5, state_file=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        batch.split(micro_batches)                        # raises a message naming the divisors
        self.model, self.batch, self.steps = model, batch, steps
        self.state_file = state_file or os.environ.get("MPEDU_WIDGET_STATE")
        self.predicted, self.measured, self.figures, self.losses, self.running = None, None, {}, [], False
        self._costs = {} if costs is None else {tuple(costs.micro_batch): costs}   # (T, b) -> Costs
        self._quiet, self._stop, self._thread, self._redraws = False, threading.Event(), None, 0
        self._draw_lock = threading.Lock()                # matplotlib is not made for two threads drawing at once
        T, B = batch.inputs.shape
        names = [d.name for d in (get_devices(devices) if isinstance(devices, int) else map(get_device, devices))]
        start = Placement.even(model, names)

        wide = {"style": {"description_width": "initial"}, "continuous_update": False}   # redraw on release
        self.board = LayerBoard(layers=model.layer_names, devices=names,
                                assignment={k: v.name for k, v in start.assignment.items()})
        self.device_count = w.IntSlider(len(names), 1, max(8, len(names)), description="devices", **wide)
        self.micro_batches = w.SelectionSlider(options=[m for m in range(1, B + 1) if B % m == 0],
                                               value=micro_batches, description="micro-batches", **wide)
        self.schedule_menu = w.Dropdown(options=[(text, key) for key, text in SCHEDULES.items()], value=schedule,
                                        description="schedule", style=wide["style"])
        self.chunks = w.IntSlider(chunks, 1, max(1, min(8, T)), description="time chunks", **wide)
        self.message, self.figure_line, self.run_status = w.HTML(), w.HTML(), w.HTML()
        # natural size (a flex column would stretch it), narrower only when the page is
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%", align_self="flex-start"))
        self.run_button = w.Button(description=f"Run {steps} steps", icon="play", button_style="success")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True)
        self.progress = w.IntProgress(0, 0, steps, description="trained")

        self.board.observe(self._update, ["assignment", "devices"])
        for control in (self.micro_batches, self.schedule_menu, self.chunks):
            control.observe(self._update, "value")
        self.device_count.observe(self._resize, "value")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([self.board, w.HBox([self.device_count, self.micro_batches]),
                          w.HBox([self.schedule_menu, self.chunks]), self.message, self.figure_line, self.image,
                          w.HBox([self.run_button, self.stop_button, self.progress]), self.run_status])
        self.add_class("mpedu-explorer")
        self._update()

    def __repr__(self) -> str:   # short and free of widget ids: notebooks save it as the text/plain output
        return (f"PipelineExplorer({self.placement or 'invalid placement'}, schedule={self.schedule_menu.value}, "
                f"micro_batches={self.micro_batches.value})")

    # -- the board ----------------------------------------------------------------------
    @property
    def placement(self) -> Placement | None:
        """The board as a Placement, or None while it is invalid (the message says why)."""
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
        try:
            assignment = {k: v.name for k, v in Placement.even(self.model, names).assignment.items()}
        except ValueError:                                 # more devices than layers: _check explains
            assignment = {k: v if v in names else names[-1] for k, v in self.board.assignment.items()}
        self._set_board(names, assignment)

    def _check(self):
        """(placement, schedule) for the current choices; a ValueError says what is wrong."""
        devices, assignment = self.board.devices, self.board.assignment
        if len(devices) > len(self.model.layer_names):
            Placement.even(self.model, devices)            # raises "5 devices but only 4 layers ..."
        placement = Placement(self.model.layer_names, assignment)
        empty = [d for d in devices if d not in assignment.values()]
        if empty:
            raise ValueError(f"{empty[0]} holds no layer: drag a layer onto it, or use fewer devices")
        chunks = self.chunks.value if self.schedule_menu.value == "wavefront" else 1
        return placement, schedules.make(self.schedule_menu.value, placement.stage_devices,
                                         self.micro_batches.value, chunks)

    # -- prediction ---------------------------------------------------------------------
    def _costs_for(self, m: int, device):
        T, B = self.batch.inputs.shape
        if (T, B // m) not in self._costs:
            if self.running:
                raise ValueError("Stop the run (or wait for it) before trying a new micro-batch size: "
                                 "measuring its costs needs the model")
            self.message.value = f"measuring the layers on micro-batches of {B // m} sequences (once)…"
            self._costs[T, B // m] = profile(self.model, self.batch, device, micro_batches=m, warmup=1, repeats=3)
        return self._costs[T, B // m]

    def _update(self, *_) -> None:
        """Check, simulate, redraw. Runs on every change, so it must stay fast (about 0.1 s)."""
        if self._quiet:
            return
        self.chunks.disabled = self.running or self.schedule_menu.value != "wavefront"
        try:
            placement, schedule = self._check()
            costs = self._costs_for(schedule.micro_batches, placement.devices[0])
            self.predicted = simulate(schedule, costs, placement)
        except ValueError as error:                       # mpedu's messages are written for people
            self.predicted, self.figures = None, {}
            self.message.value, self.figure_line.value, self.board.device_notes = _error(error), "", {}
            self.image.layout.visibility, self.run_button.disabled = "hidden", True
        else:
            self._describe(placement, schedule, costs)
            self.message.value = f"placement: <code>{html.escape(str(placement))}</code>"
            self.image.value = self._picture([self.predicted])
            self.image.layout.visibility, self.run_button.disabled = "visible", self.running
        self._redraws += 1
        self._save_state()

    def _describe(self, placement, schedule, costs) -> None:
        """The line of figures, and the numbers on each chip and under each device column."""
        t, stage_costs = self.predicted, costs.stages(placement)
        one = simulate("naive", costs, Placement.single(self.model, placement.devices[0]),
                       micro_batches=schedule.micro_batches)
        held = peak_in_flight(t, [c.activation_bytes / schedule.chunks for c in stage_costs])
        memory = dict(held)                               # activations at their peak, plus ...
        for (device, _), c in zip(placement.stages, stage_costs):
            memory[device.name] += 2 * c.param_bytes      # ... the weights and their gradients
        self.figures = f = {"makespan_s": t.makespan, "bubble": t.bubble_fraction, "speedup": one.makespan / t.makespan,
                            "transfers": len(t.transfers()), "bytes_moved": t.bytes_moved,
                            "stages": len(placement.stages), "memory_bytes": memory}
        self.figure_line.value = (
            f"predicted step <b>{f['makespan_s'] * 1e3:.1f} ms</b> · bubble <b>{f['bubble']:.0%}</b> · "
            f"<b>{f['speedup']:.2f}×</b> the speed of one device · <b>{f['transfers']}</b> transfers "
            f"({f['bytes_moved'] / 1e6:.1f} MB) · {f['stages']} stages on {len(t.devices)} devices")
        top = max(memory.values()) or 1
        self.board.device_notes = {d: {"text": f"busy {t.busy(d) * 1e3:.0f} ms of {t.makespan * 1e3:.0f}\n"
                                               f"memory {memory[d] / 1e6:.1f} MB", "fill": memory[d] / top}
                                   for d in t.devices}
        self.board.layer_notes = {name: f"{(fw + bw) * 1e3:.1f} ms"
                                  for name, fw, bw in zip(costs.names, costs.forward, costs.backward)}

    def _picture(self, timelines, titles=(None, None)) -> bytes:
        """Timelines stacked on one time axis, as PNG. Axes are placed by hand, in inches: a layout
        engine would cost more than the drawing itself, and every change redraws."""
        width, left, right, bottom, row = 8.5, 0.75, 0.2, 0.45, 0.42
        tops = [0.6] + [0.35] * (len(timelines) - 1)      # the first panel also carries the legend
        rows = [row * len(t.devices) for t in timelines]
        height = sum(rows) + sum(tops) + bottom
        end = max(e.end for t in timelines for e in t.events) * 1e3
        with self._draw_lock:
            fig, y = Figure(figsize=(width, height), dpi=90), height
            for i, (t, title, r, top) in enumerate(zip(timelines, titles, rows, tops)):
                y -= top + r
                ax = fig.add_axes((left / width, y / height, 1 - (left + right) / width, r / height))
                plot_timeline(t, ax, title=title, xlim=(0.0, end), legend=i == 0)
                if i < len(timelines) - 1:
                    ax.set_xlabel("")
                    ax.tick_params(labelbottom=False)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png")
        return buffer.getvalue()

    # -- real steps ---------------------------------------------------------------------
    def run(self, steps: int | None = None) -> None:
        """Train `steps` real steps with the current choices on a background thread (the kernel stays free)."""
        if self.running or self.predicted is None:
            return
        placement, schedule = self._check()
        steps, cores = steps or self.steps, len(usable_cores())
        # more virtual devices than cores take turns on them: predict that, to compare like with like
        shared = all(d.virtual for d in placement.devices) and len(placement.devices) > cores
        costs = self._costs_for(schedule.micro_batches, placement.devices[0])
        predicted = simulate(schedule, costs, placement, cores=cores if shared else None)
        self.running, self.losses = True, []
        self._stop.clear()
        self._lock(True)
        self.progress.max, self.progress.value, self.run_status.value = steps, 0, "starting the devices…"
        title = f"predicted ({cores} cores shared)" if shared else "predicted"
        self._thread = threading.Thread(target=self._train, args=(placement, schedule, predicted, title, steps),
                                        name="mpedu-explorer-run", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the run to stop after the step it is on."""
        if self.running:
            self._stop.set()
            self.run_status.value = "stopping after this step…"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run has ended (for scripts and tests; the widget itself never waits)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _train(self, placement, schedule, predicted, title, steps) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer, done = torch.optim.SGD(params, lr=LR), 0
        try:
            with Pipeline(self.model, placement, schedule) as pipe:
                while done < steps and not self._stop.is_set():
                    optimizer.zero_grad(set_to_none=True)
                    result = pipe.train_step(self.batch)
                    torch.nn.utils.clip_grad_norm_(params, CLIP)
                    optimizer.step()
                    done += 1
                    self.measured = result.timeline
                    self.losses.append(result.loss)
                    self.progress.value = done
                    self.image.value = self._picture([predicted, result.timeline], [title, "measured"])
                    self.run_status.value = (f"step {done}/{steps}: loss {result.loss:.3f}, measured "
                                             f"{result.timeline.makespan * 1e3:.1f} ms (predicted "
                                             f"{predicted.makespan * 1e3:.1f} ms)")
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
        for control in (self.device_count, self.micro_batches, self.schedule_menu, self.run_button):
            control.disabled = on
        self.chunks.disabled = on or self.schedule_menu.value != "wavefront"
        self.board.locked, self.stop_button.disabled = on, not on

    def _save_state(self) -> None:
        """What Python sees, as JSON (written whole, then renamed: a reader never sees half a file)."""
        if self.state_file:
            placement = self.placement
            state = {"placement": placement and str(placement), "assignment": self.board.assignment,
                     "devices": self.board.devices, "schedule": self.schedule_menu.value,
                     "micro_batches": self.micro_batches.value, "figures": self.figures, "redraws": self._redraws,
                     "message": self.message.value, "progress": self.progress.value, "losses": self.losses,
                     "running": self.running}
            tmp = f"{self.state_file}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_file)


def _error(error: Exception) -> str:
    return f'<div style="color:#b3261e; white-space:pre-wrap">⚠ {html.escape(str(error))}</div>'
