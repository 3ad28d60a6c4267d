"""The explorer's layer board: one column per device of draggable layer chips, drawn by the browser (anywidget)."""
from __future__ import annotations

import anywidget
import traitlets

# The board is drawn in the browser from the synced traits below; a drop sends back a new `assignment`.
BOARD_ESM = r"""
function render({ model, el }) {
  // Redrawing replaces every chip; under a drag that would remove the chip being dragged (and the drop
  // with it). So a change that arrives mid-drag (the kernel's new notes, say) is drawn when the drag ends.
  // `dragged` is the chip whose drag is under way: only its own dragend ends it (a late dragend from a chip
  // an earlier drawing replaced must not end a newer drag).
  let dragged = null, stale = false;
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
    const [layers, devices, a, cuts, costs, notes, locked] =
      ["layers", "devices", "assignment", "cuts", "layer_notes", "device_notes", "locked"].map((n) => model.get(n));
    // a run of neighbouring layers on one device is a stage; a cut starts another on the same device (the V's turn)
    const stageOf = {};
    layers.forEach((l, i) => {
      stageOf[l] = i && stageOf[layers[i - 1]] + (a[l] !== a[layers[i - 1]] || cuts.includes(l));
    });
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
        chip.addEventListener("dragstart", (e) => { dragged = chip; e.dataTransfer.setData("text/plain", l); });
        chip.addEventListener("dragend", () => {
          if (dragged !== chip) return;
          dragged = null;
          if (stale) { stale = false; draw(); }
        });
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
  const redraw = () => { if (dragged) stale = true; else draw(); };
  const names = ["layers", "devices", "assignment", "cuts", "layer_notes", "device_notes", "locked"];
  names.forEach((n) => model.on(`change:${n}`, redraw));
  draw();
  return () => names.forEach((n) => model.off(`change:${n}`, redraw));
}
export default { render };
"""

# JupyterLab's colour variables, with plain fallbacks for front ends that lack them. Text is 12 px or more.
# The explorer's own rules (.mpedu-explorer) ride here: its box of controls has no stylesheet of its own.
BOARD_CSS = """
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
.mpedu-explorer .widget-html-content { line-height: 1.45; }   /* not the 28 px line of a control */
.mpedu-explorer .mpedu-note { font-size: 13px; color: var(--jp-ui-font-color2, #444); }
"""


class LayerBoard(anywidget.AnyWidget):
    """One column per device holding draggable layer chips; `assignment` (layer -> device) is what Python reads.
    `cuts` (set by Python): layers that start a stage although the layer before sits on the same device, as in the
    V of ZB-V, where the last device holds the two middle stages (Placement.cuts)."""

    _esm = BOARD_ESM
    _css = BOARD_CSS
    layers = traitlets.List(traitlets.Unicode()).tag(sync=True)       # model order
    devices = traitlets.List(traitlets.Unicode()).tag(sync=True)      # one column each, empty ones too
    assignment = traitlets.Dict().tag(sync=True)                      # layer name -> device name
    cuts = traitlets.List(traitlets.Unicode()).tag(sync=True)         # layers starting a stage on the same device
    layer_notes = traitlets.Dict().tag(sync=True)                     # layer -> short text on its chip
    device_notes = traitlets.Dict().tag(sync=True)                    # device -> {"text", "fill" 0..1}
    locked = traitlets.Bool(False).tag(sync=True)                     # True while a run trains
