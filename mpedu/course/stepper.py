"""Step through a timeline action by action: what runs, what it waits for, what each device holds (and its widget).

    step_through(simulate("1f1b", [1e-3, 1e-3], micro_batches=4))     # the last line of a cell shows it

    [⏮] [◀ back] [step ▶] [▶ play]  action 3 of 16
    gpu:1 runs F0, 1.02 → 2.02 ms; it needs F0 from gpu:0 (sent at 1.00 ms, here at 1.02 ms): gpu:1 waited 1.02 ms …
    gpu:0 holds 2 micro-batches' activations: F0 F1
    gpu:1 holds 1 micro-batch's activations: F0
             ┌──┬──┐
    gpu:0    │F0│F1│ ░░ ░░ ░░ ░░      actions still to come are faded
             └──┴──┘
                  ╲ ┏━━┓
    gpu:1          ╲┃F0┃ ░░ ░░ ░░    the running action outlined in black; what it waits for
                    ┗━━┛             dashed orange (F0 on gpu:0), the transfer that brought it orange

`walk_timeline(timeline)` is the logic, in Python and testable without a browser; the widget shows its result and
moves through it in the page (buttons, the arrow keys, Home and End), telling Python which step it shows (`step`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import traitlets

from .timeline_view import TIMELINE_CSS, TIMELINE_DRAW, TimelineView, box_label, label_style

_TOLERANCE = 1e-9     # seconds: two times closer than this are the same moment (float sums of a simulation)


@dataclass(frozen=True)
class Step:
    """The k-th action of a timeline to start (number k, counting from 1, of `of`), as `walk_timeline` finds it.

    needs: the actions whose output it uses, as found in the timeline; waits_for: the one of them whose output
    came last (None: it needs only the batch), `transfer` the send that carried it from another device (None on
    the same device), `ready` when that output was there (the transfer's arrival, or the action's end).
    idle: seconds its device sat idle just before it (since its previous action, or the step's start).
    held: per device, the labels of the forwards whose activations are held once this action has started;
    held_bytes: those activation bytes per device, None when the timeline has no memory data.
    """

    number: int
    of: int
    action: object                        # mpedu.core.timeline.Event
    label: str                            # as its box reads: "F2"; "1F2" where a device holds several stages
    needs: tuple = ()
    waits_for: object = None
    transfer: object = None
    ready: float = 0.0
    idle: float = 0.0
    held: dict = field(default_factory=dict)
    held_bytes: dict | None = None
    # for the words: id(event) -> label, shared by all steps of a walk; whether a held unit is a time chunk
    labels: dict = field(default_factory=dict, repr=False, compare=False)
    chunked: bool = field(default=False, repr=False, compare=False)

    @property
    def waiting(self) -> float:
        """Seconds its device sat idle waiting for `waits_for`'s output: from when it was free to when the output
        came (0: it was there before; the rest of `idle`, in a measured step, is the worker's own delay)."""
        if self.waits_for is None:
            return 0.0
        free = self.action.start - self.idle
        return max(0.0, min(self.ready, self.action.start) - free)

    def describe(self) -> str:
        """One line: what runs, what it needs and whether its device waited for it."""
        e = self.action
        words = f"{e.device} runs {self.label}, {_ms(e.start)} → {_ms(e.end)} ms; "
        n = self.waits_for
        if n is None:
            words += "it needs only the batch"
        elif n.device != e.device:
            sent = f"sent at {_ms(self.transfer.start)} ms, here at {_ms(self.ready)} ms" if self.transfer else \
                f"done at {_ms(n.end)} ms"
            words += f"it needs {self.labels[id(n)]} from {n.device} ({sent})"
        else:
            words += f"it needs {self.labels[id(n)]}, done here at {_ms(n.end)} ms"
        waiting = self.waiting
        if waiting > _TOLERANCE and self.idle - waiting <= max(_TOLERANCE, 0.01 * self.idle):
            words += f": {e.device} waited {_ms(self.idle)} ms for it"
        elif waiting > _TOLERANCE:
            words += f": {e.device} sat idle {_ms(self.idle)} ms, {_ms(waiting)} of them waiting for it"
        elif self.idle > _TOLERANCE:
            words += f"; {e.device} sat idle {_ms(self.idle)} ms first"
        return words

    def holdings(self) -> list[str]:
        """One line per device: the micro-batches whose activations it holds now (and their bytes)."""
        lines = []
        one, many = ("chunk's", "chunks'") if self.chunked else ("micro-batch's", "micro-batches'")
        for device, labels in self.held.items():
            n = len(labels)
            what = f"{n} {one if n == 1 else many}"
            line = f"{device} holds {what} activations: {' '.join(labels)}" if n else f"{device} holds no activations"
            if self.held_bytes is not None:
                line += f" ({_size(self.held_bytes[device])})"
            lines.append(line)
        return lines


def walk_timeline(timeline) -> list[Step]:
    """The timeline's actions (F, R, B, W) in the order they start (at the same moment: in device order), each
    with what it waits for and what every device holds once it has started.

    What an action needs, found by (kind, stage, micro-batch, chunk) among the timeline's actions, as the
    schedules' dependencies say (mpedu.core.schedules.Schedule.dependencies): F(s) the previous stage's F(s-1)
    and, with time chunks, its own stage's F of the chunk before (the recurrent state); B(s) the next stage's
    B(s+1) (its output's gradient), the B of the chunk after (BPTT) and its own F(s) (the R that ran the forward
    again, with recomputation); R what its B needs (it is the B's first part) and its F; W its own B. The one
    it waits for is the need whose output was there last: an output from another device is there when its
    transfer arrives (the send on that device, of that stage, micro-batch and chunk, to this device, the first
    to start at or after the need's end), one from its own device when the need ends. A need the timeline
    lacks (a measured step that lost it) is left out.

    What a device holds: the forwards it has started whose activations are not yet freed, freed by the B (or
    by the W, where the timeline has a W for that micro-batch: a split backward keeps them for the weights'
    gradient). The running action counts as done: an F's micro-batch is held from its start, a B's freed from
    its start. Bytes: the sum of Event.memory over the device's actions so far (predicted timelines and
    measured ones both carry it; with recomputation a held micro-batch keeps only its input until R).
    """
    compute = timeline.compute()
    rows = {d: i for i, d in enumerate(timeline.devices)}
    order = sorted((e for e in compute if e.device in rows), key=lambda e: (e.start, rows[e.device]))
    several, chunked = label_style(timeline, compute)
    labels = {id(e): box_label(e, several, chunked) for e in order}
    found = {}
    for e in order:
        found.setdefault((e.kind, e.stage, e.mb, e.chunk), e)
    sends: dict = {}
    for t in timeline.transfers():
        sends.setdefault((t.device, t.peer, t.stage, t.mb, t.chunk), []).append(t)
    split = {(e.device, e.stage, e.mb, e.chunk) for e in order if e.kind == "W"}
    with_memory = any(e.memory for e in order)
    held = {d: {} for d in timeline.devices}              # device -> {(stage, mb, chunk): label of its F}
    held_bytes = dict.fromkeys(timeline.devices, 0)
    free = dict.fromkeys(timeline.devices, min((e.start for e in timeline.events), default=0.0))
    steps = []
    for k, e in enumerate(order):
        needs = [found[key] for key in _needs(e, found) if key in found]
        transfers = {id(n): _transfer(n, e, sends) for n in needs}
        ready = {id(n): transfers[id(n)].end if transfers[id(n)] else n.end for n in needs}
        # the output that came last; at the same moment, one from another device (the transfer is the story)
        last = max(needs, key=lambda n: (ready[id(n)], n.device != e.device), default=None)
        unit = (e.stage, e.mb, e.chunk)
        if e.kind == "F":
            held[e.device][unit] = labels[id(e)]
        elif e.kind == "W" or (e.kind == "B" and (e.device, *unit) not in split):
            held[e.device].pop(unit, None)
        held_bytes[e.device] += e.memory
        steps.append(Step(k + 1, len(order), e, labels[id(e)], tuple(needs), last,
                          transfers[id(last)] if last is not None else None,
                          ready[id(last)] if last is not None else e.start, max(0.0, e.start - free[e.device]),
                          {d: tuple(h.values()) for d, h in held.items()}, dict(held_bytes) if with_memory else None,
                          labels, chunked))
        free[e.device] = max(free[e.device], e.end)
    return steps


def _needs(e, found) -> list[tuple]:
    """The (kind, stage, mb, chunk) of the actions whose output `e` uses (see walk_timeline); other stages' first."""
    s, mb, c = e.stage, e.mb, e.chunk
    if e.kind == "F":
        return [("F", s - 1, mb, c), ("F", s, mb, c - 1)]
    if e.kind == "W":
        return [("B", s, mb, c)]
    after = [("B", s + 1, mb, c), ("B", s, mb, c + 1)]
    own = "R" if e.kind == "B" and ("R", s, mb, c) in found else "F"
    return after + [(own, s, mb, c)]


def _transfer(need, e, sends):
    """The send that carried `need`'s output to `e`'s device (None on the same device, or none found)."""
    if need.device == e.device:
        return None
    return next((t for t in sends.get((need.device, e.device, need.stage, need.mb, need.chunk), [])
                 if t.start >= need.end - _TOLERANCE), None)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if abs(ms) >= 100 else f"{ms:.1f}" if abs(ms) >= 10 else f"{ms:.2f}"


def _size(n: int) -> str:
    if n == 0:
        return "0 MB"
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e5 else f"{n / 1e3:.1f} kB"


# The drawing is the timeline view's (TIMELINE_DRAW); this adds the controls and the readouts, and marks the
# boxes by class. The page moves through the steps Python sent on its own (no round trip per step) and tells
# Python where it is (`step`).
STEPPER_ESM = TIMELINE_DRAW + r"""
function render({ model, el }) {
  const div = (cls, text = "") => Object.assign(document.createElement("div"), { className: cls, textContent: text });
  const button = (text, title, act) => {
    const b = Object.assign(document.createElement("button"), { className: "mpedu-step-button", textContent: text,
                                                                title });
    // Notebook 7 binds → to a selector the focused element itself matches: the attribute must be on the
    // element that has the focus (an ancestor's comes too late in the shortcut handler's walk up the page)
    b.dataset.lmSuppressShortcuts = "true";
    b.addEventListener("click", act);
    return b;
  };
  let timer = null;
  const all = () => model.get("steps");
  const go = (k) => {
    const n = all().length;
    k = Math.max(1, Math.min(n, k));
    if (n && k !== model.get("step")) {
      model.set("step", k);               // shown by the change:step listener
      model.save_changes();
    }
  };
  const pause = () => { clearInterval(timer); timer = null; play.textContent = "▶ play"; };
  const toggle = () => {
    if (timer) return pause();
    if (model.get("step") >= all().length) go(1);
    timer = setInterval(() => (model.get("step") >= all().length ? pause() : go(model.get("step") + 1)),
                        model.get("interval"));
    play.textContent = "⏸ pause";
  };
  const first = button("⏮", "the first action (Home)", () => { pause(); go(1); });
  const back = button("◀ back", "the action before (←)", () => { pause(); go(model.get("step") - 1); });
  const next = button("step ▶", "the next action (→)", () => { pause(); go(model.get("step") + 1); });
  const play = button("▶ play", "play the actions one after another", toggle);
  const count = div("mpedu-step-count"), bar = div("mpedu-step-bar");
  bar.append(first, back, next, play, count);
  const action = div("mpedu-step-action"), memory = div("mpedu-step-memory"), picture = div("mpedu-step-picture");
  el.classList.add("mpedu-stepper");
  el.tabIndex = 0;
  // JupyterLab and Notebook 7 bind the arrows (in command mode) on the whole page: leave them to this widget
  // (here for the widget itself, when it has the focus; each button says so for itself)
  el.dataset.lmSuppressShortcuts = "true";
  el.append(bar, action, memory, picture);
  el.addEventListener("keydown", (e) => {
    const act = { ArrowRight: next, ArrowLeft: back, Home: first }[e.key];
    if (!act && e.key !== "End") return;
    e.preventDefault();
    e.stopPropagation();                  // the notebook would move between cells
    if (act) act.click(); else { pause(); go(all().length); }
  });
  const show = () => {
    const steps = all(), n = steps.length, k = Math.max(1, Math.min(n, model.get("step"))), s = steps[k - 1];
    const focused = el.contains(document.activeElement);
    count.textContent = n ? `action ${k} of ${n}` : "";
    first.disabled = back.disabled = !s || k <= 1;
    next.disabled = !s || k >= n;
    play.disabled = !s;
    action.textContent = s ? s.text : "no actions to step through";
    memory.replaceChildren(...(s ? s.memory : []).map((line) => div("mpedu-step-device", line)));
    const when = new Map(steps.map((t, j) => [t.box, j + 1]));       // box -> its step
    for (const node of picture.querySelectorAll("[data-box]")) {
      const b = +node.dataset.box;
      node.classList.toggle("mpedu-step-future", !s || when.get(b) > k);
      node.classList.toggle("mpedu-step-running", !!s && b === s.box);
      node.classList.toggle("mpedu-step-waited", !!s && b === s.waits);
      node.classList.toggle("mpedu-step-needed", !!s && b !== s.waits && s.needs.includes(b));
    }
    const panel = model.get("panels")[0];
    for (const node of picture.querySelectorAll("[data-transfer]")) {
      const t = +node.dataset.transfer;
      node.classList.toggle("mpedu-step-future", !s || panel.transfers[t][1] > s.start + 1e-9);
      node.classList.toggle("mpedu-step-waited", !!s && t === s.transfer);
    }
    el.dataset.step = s ? k : 0;          // for tests and for a person's inspector: where the page is
    el.dataset.running = s ? s.label : "";
    if (focused && !el.contains(document.activeElement)) el.focus({ preventScroll: true });   // a button disabled
  };
  const draw = () => {
    drawTimeline(picture, model.get("panels"), model.get("legend"));
    show();
    el.dataset.revision = model.get("revision");
  };
  model.on("change:revision", draw);
  model.on("change:step", show);
  model.on("change:steps", show);
  draw();
  return () => {
    pause();
    model.off("change:revision", draw);
    model.off("change:step", show);
    model.off("change:steps", show);
  };
}
export default { render };
"""

# The timeline view's rules for its picture, on the step-through's (the class .mpedu-timeline stays the view's alone)
STEPPER_CSS = TIMELINE_CSS.replace(".mpedu-timeline", ".mpedu-step-picture") + """
.mpedu-stepper { outline: none; }
.mpedu-stepper:focus-visible { outline: 2px solid #e69f00; }
.mpedu-step-bar { display: flex; align-items: center; gap: 6px; margin: 4px 0; font-size: 13px; }
.mpedu-step-button { font-size: 13px; padding: 2px 9px; cursor: pointer; }
.mpedu-step-count { color: var(--jp-ui-font-color2, #444); margin-left: 6px; }
.mpedu-step-action { font-size: 13px; margin: 2px 0; }
.mpedu-step-memory { font-size: 12px; margin: 2px 0 4px; color: var(--jp-ui-font-color1, #222); }
.mpedu-stepper .mpedu-step-future { opacity: 0.25; }
.mpedu-stepper rect.mpedu-step-running { stroke: #000; stroke-width: 2.5px; }
.mpedu-stepper rect.mpedu-step-waited { stroke: #d55e00; stroke-width: 2.5px; stroke-dasharray: 4 2; }
.mpedu-stepper rect.mpedu-step-needed { stroke: #d55e00; stroke-width: 1.2px; stroke-dasharray: 2 2; }
.mpedu-stepper line.mpedu-step-waited { stroke: #d55e00; stroke-width: 2.5px; opacity: 1; }
.mpedu-stepper text.mpedu-step-running { font-weight: bold; }
"""


class StepThrough(TimelineView):
    """A timeline played action by action in the browser (see the module's picture): `load` a Timeline; `step`
    (1 = the first action) is where the page is, moved by its buttons and keys or from Python; `current` is that
    Step, as `walk_timeline` made it."""

    _esm = STEPPER_ESM
    _css = STEPPER_CSS
    steps = traitlets.List().tag(sync=True)      # per action: {"box", "needs", "waits", "transfer", "start", ...}
    step = traitlets.Int(1).tag(sync=True)
    interval = traitlets.Int(700).tag(sync=True)  # ms between actions while it plays

    def __init__(self, timeline=None, title: str = "", **kwargs):
        super().__init__(**kwargs)
        self.walked: list[Step] = []
        if timeline is not None:
            self.load(timeline, title)

    @property
    def current(self) -> Step | None:
        return self.walked[min(max(self.step, 1), len(self.walked)) - 1] if self.walked else None

    def show(self, timelines, titles) -> None:
        """TimelineView's call: step through the first of `timelines` (none: an empty picture)."""
        self.load(timelines[0] if timelines else None, titles[0] if titles else "")

    def load(self, timeline, title: str = "", at: int = 1) -> None:
        """Step through `timeline` (None: nothing), from its action number `at` (1: the first; past the last: the
        last)."""
        with self.hold_sync():                   # steps, step and picture reach the page in one message
            self.walked = walk_timeline(timeline) if timeline is not None else []
            self.steps = _page_steps(timeline, self.walked) if timeline is not None else []
            self.step = max(1, min(at, len(self.walked)))
            super().show([timeline] if timeline is not None else [], [title])


def _page_steps(timeline, walked: list[Step]) -> list[dict]:
    """What the page needs per step: box and transfer indices as timeline_panel numbers them, and the words."""
    rows = set(timeline.devices)
    box = {id(e): k for k, e in enumerate(e for e in timeline.compute() if e.device in rows)}
    arrow = {id(t): k for k, t in enumerate(t for t in timeline.transfers() if t.device in rows and t.peer in rows)}
    return [{"box": box[id(s.action)], "needs": [box[id(n)] for n in s.needs],
             "waits": box[id(s.waits_for)] if s.waits_for is not None else -1,
             "transfer": arrow.get(id(s.transfer), -1), "start": round(s.action.start * 1e3, 4),
             "label": s.label, "text": s.describe(), "memory": s.holdings()} for s in walked]


def step_through(timeline, title: str | None = None) -> StepThrough:
    """A widget that plays `timeline` (measured or predicted) action by action: the running action outlined, what it
    waits for dashed (its transfer in orange), and what each device holds then. Buttons, or ← → Home End once it
    has the focus (click it)."""
    if title is None:
        title = f"{timeline.source} step: {timeline.makespan * 1e3:.1f} ms, bubble {timeline.bubble_fraction:.0%}"
    return StepThrough(timeline, title)
