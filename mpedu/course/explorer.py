"""The notebook explorer: drag layers onto devices, pick a schedule and micro-batches, see the step predicted and run."""
from __future__ import annotations

import html
import json
import os
import threading

import ipywidgets as w

from ..core.placement import Placement, tied_layers
from ..predict.footprint import device_footprints
from ..predict.simulator import simulate
from ..runtime.devices import get_device, get_devices
from ..runtime.link import LINKS
from .bestplans import BestPlans
from .board import LayerBoard
from .explorer_board import BoardFollows
from .explorer_costs import MeasuredCosts, layer_notes, sizes_words
from .explorer_run import RealSteps
from .explorer_run import error_html as _error
from .layout import SCHEDULE_MENU, kept_cuts
from .refusals import check, example_sizes, read_sizes
from .stepper import StepThrough
from .timeline_view import TimelineView
from .wording import RECOMPUTE, SLOWDOWNS, link_label, plural


class PipelineExplorer(BoardFollows, MeasuredCosts, RealSteps, w.VBox):
    """Place layers on devices by dragging, pick a schedule, micro-batches and a link, and see the predicted
    step at once; Run trains a few real steps (SGD: it updates the model) and draws them under the prediction.

        explorer = PipelineExplorer(model, batch, devices=2, schedule="gpipe", micro_batches=4)
        explorer                      # the last line of a cell shows it
        explorer.placement            # the board as a Placement (None while it is refused); assignable

    The V-shape schedules (ZB-V, DualPipeV) lay the layers out as a V when picked: 2 stages a device, the first
    device holding the first and the last stage (so tied embed and decode weights are allowed). The "sizes" box
    beside the micro-batch slider takes unequal micro-batches ("8,16,24,16", adding up to the batch width;
    micro_batches=[8, 16, 24, 16] fills it); empty, the slider's equal ones.

    Costs come from `profile`, measured once per micro-batch shape (pass `costs`, one or a list, to reuse
    yours). A new micro-batch size is first drawn from the nearest measured size, scaled per sequence, while its
    real costs are measured in the background; the drawing then updates by itself.

    Under its timeline a "step through" toggle opens `explorer.stepper` (mpedu.course.stepper): the last measured
    step, else the prediction, played action by action, following every redraw.

    Under the controls, `explorer.best_plans` lists the planner's fastest plans for these devices and link within
    `memory_cap` (bytes or "40MB" per device; a box there changes it), each one click from the board.
    """

    def __init__(self, model, batch, devices: int | list = 2, schedule: str = "gpipe", micro_batches: int | list = 4,
                 chunks: int = 2, costs=None, steps: int = 5, link: str = "shared", slowdown: int = 1,
                 state_file=None, recompute: str | None = None, memory_cap=None):
        T, B = batch.inputs.shape
        options = [m for m in range(1, B + 1) if B % m == 0]
        sizes = None
        if isinstance(micro_batches, (list, tuple)):      # unequal sizes: the box holds them
            try:
                sizes = read_sizes(",".join(map(str, micro_batches)), B)
            except ValueError as error:
                raise ValueError(f"micro_batches={list(micro_batches)}: {error}") from None
            if not sizes:
                raise ValueError(f"micro_batches=[]: give a count such as 4, or sizes adding up to {B}")
            micro_batches = min(options, key=lambda k: (abs(k - len(sizes)), k))   # the slider as near as it goes
        if B % micro_batches:
            raise ValueError(f"micro_batches={micro_batches} does not divide the batch size {B}; "
                             f"use one of {options}, or a list of sizes adding up to {B}")
        if schedule not in SCHEDULE_MENU:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_MENU)}")
        if (recompute or "none") not in RECOMPUTE:
            raise ValueError(f"unknown recompute {recompute!r}; choose None, 'all' or 'all-but-last'")
        if isinstance(link, str) and "/" in link:        # "10gbe/100", as Link.parse writes a slowed preset
            name, _, factor = link.partition("/")
            if slowdown != 1 or name.strip().lower() not in LINKS or factor.strip() not in map(str, SLOWDOWNS):
                raise ValueError(f"link={link!r}: the explorer offers a preset slowed {', '.join(map(str, SLOWDOWNS))}"
                                 f" times, e.g. link='10gbe/100' or link='10gbe', slowdown=100 (not both)")
            link, slowdown = name.strip().lower(), int(factor)
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose one of {', '.join(LINKS)}, with slowdown= one of "
                             f"{', '.join(map(str, SLOWDOWNS))} (e.g. link='10gbe', slowdown=100)")
        if slowdown not in SLOWDOWNS:
            raise ValueError(f"slowdown={slowdown!r}; choose one of {', '.join(map(str, SLOWDOWNS))}")
        most_chunks = max(1, min(8, T))                    # what the time-chunk slider offers
        if not 1 <= chunks <= most_chunks:
            raise ValueError(f"chunks={chunks}; the slider offers 1 to {most_chunks} time chunks")
        self.model, self.batch, self.steps = model, batch, steps
        self.state_file = state_file
        known = [] if costs is None else [costs] if hasattr(costs, "micro_batch") else list(costs)
        self._costs = {tuple(c.micro_batch): c for c in known}   # by (T, sequences per micro-batch)
        self.predicted = self.measured = None
        self.figures, self.losses, self.running, self._redraws, self._runs = {}, [], False, 0, 0
        self._quiet, self._thread, self._stop, self._measuring = False, None, threading.Event(), {}
        self._update_lock = threading.RLock()              # the kernel and a finished measurement both redraw
        self._model_lock = threading.Lock()                # measuring and training both use the model
        self._weighed: dict = {}                           # (T, b) -> a Costs of bytes (CostCurve.weigh)
        self._fix = None
        self._changed_in_run = False                       # a choice changed from Python while a run trained
        self._measured_title = ""
        L = len(model.layer_names)
        names = [d.name for d in (get_devices(devices) if isinstance(devices, int) else map(get_device, devices))]
        self._tied = tied_layers(model)                   # layers sharing a weight must share a device
        start = self._layout(names, schedule)

        wide = {"style": {"description_width": "initial"}, "continuous_update": False}   # redraw on release
        self.board = LayerBoard(layers=model.layer_names, devices=names, assignment={k: v.name for k, v in
                                                                                    start.assignment.items()},
                                cuts=sorted(start.cuts, key=model.layer_names.index))
        # every device needs a layer: the slider offers no count that is always refused
        self.device_count = w.IntSlider(len(names), 1, L, description="devices", **wide)
        self.micro_batches = w.SelectionSlider(options=options, value=micro_batches, description="micro-batches",
                                               **wide)
        self.sizes = w.Text(",".join(map(str, sizes or ())), description="sizes",
                            placeholder=f"equal; or e.g. {example_sizes(B)}",
                            tooltip=f"unequal micro-batches: sequences each, adding up to {B}; empty: equal ones",
                            style=wide["style"], continuous_update=False, layout=w.Layout(width="19em"))
        menu = {"style": wide["style"], "layout": w.Layout(width="max-content")}   # never cut the longest name
        self.schedule_menu = w.Dropdown(options=[(text, key) for key, text in SCHEDULE_MENU.items()], value=schedule,
                                        description="schedule", **menu)
        self.chunks = w.IntSlider(chunks, 1, most_chunks, description="time chunks (wavefront only)",
                                  **wide)
        self.link_menu = w.Dropdown(options=[(link_label(k, v), k) for k, v in LINKS.items()],
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
        self.message.add_class("mpedu-message")        # the placement's own line (the best plans name others)
        # the planner's fastest, one click away; it reads the bytes the board does
        self.best_plans = BestPlans(model, batch, self.apply, memory_cap, self._weighed, self._model_lock)
        self.fix_button = w.Button(layout=w.Layout(display="none", width="max-content"))
        self.timeline = TimelineView()
        self.step_toggle = w.ToggleButton(False, description="step through", layout=w.Layout(width="max-content"),
                                          tooltip="play the step action by action: what runs, what it waits for, "
                                                  "what each device holds")
        self.stepper = StepThrough(layout=w.Layout(display="none"))
        self.run_button = w.Button(description=f"Run {steps} steps", icon="play", button_style="success")
        self.stop_button = w.Button(description="Stop", icon="stop", disabled=True)
        self.progress = w.IntProgress(0, 0, steps, description="trained", layout=w.Layout(display="none"))

        self.board.observe(self._board_changed, ["assignment", "devices", "cuts"])
        for control in (self.chunks, self.link_menu, self.slowdown, self.recompute_menu):
            control.observe(self._update, "value")
        self.schedule_menu.observe(self._schedule_picked, "value")
        self.micro_batches.observe(self._slider_moved, "value")
        self.sizes.observe(self._sizes_typed, "value")
        self.device_count.observe(self._resize, "value")
        # every redraw of the timeline (a prediction, a run's step, a refusal) is one for the step-through
        self.timeline.observe(self._restep, "revision")
        self.step_toggle.observe(self._restep, "value")
        self.fix_button.on_click(lambda _: self._fix and self._apply_fix())
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([self.board, w.HBox([self.device_count, self.micro_batches, self.sizes]),
                          w.HBox([self.schedule_menu, self.chunks]), w.HBox([self.link_menu, self.slowdown]),
                          self.recompute_menu,
                          self.message, self.fix_button, self.figure_line, self.note, self.timeline,
                          self.step_toggle, self.stepper,
                          w.HBox([self.run_button, self.stop_button, self.progress]), self.run_status,
                          self.best_plans])
        self.add_class("mpedu-explorer")
        self._update()

    def __repr__(self) -> str:   # short and free of widget ids: notebooks save it as the text/plain output
        m = self.sizes.value.strip() and f"[{self.sizes.value.strip()}]" or self.micro_batches.value
        return f"PipelineExplorer({self.placement or 'refused placement'}, schedule={self.schedule_menu.value}, " \
               f"micro_batches={m})"

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
        self._place(placement)

    def _place(self, placement: Placement | str | dict, menus=()) -> None:
        if not isinstance(placement, Placement):
            placement = (Placement.parse if isinstance(placement, str) else Placement.from_dict)(placement, self.model)
        names = sorted({d.name for d in placement.devices}, key=lambda n: (len(n), n))   # vgpu:2 before vgpu:10
        self._set_board(names, {k: v.name for k, v in placement.assignment.items()}, menus,
                        sorted(placement.cuts, key=placement.layer_names.index))

    @property
    def recompute(self) -> str | None:
        """The menu's choice as Pipeline's recompute= (None: keep activations)."""
        return None if self.recompute_menu.value == "none" else self.recompute_menu.value

    @property
    def link(self):
        """The link the prediction and Run use: the menu's preset, slowed by the slow-down factor."""
        link = LINKS[self.link_menu.value]
        return link.slowed(self.slowdown.value) if link.emulated and self.slowdown.value != 1 else link

    def apply(self, plan) -> None:
        """Show a planner's plan (mpedu.predict.planner.Candidate, a row of the best plans): its placement, schedule,
        micro-batches (its unequal sizes in the sizes box), time chunks and recomputation, set together, drawn once."""
        chunks = [(self.chunks, plan.chunks)] if plan.chunks > 1 else []   # other schedules ignore the slider
        sizes = getattr(plan, "micro_batch_sizes", None)
        slider = [(self.micro_batches, plan.micro_batches)] if plan.micro_batches in self.micro_batches.options else []
        self._place(plan.placement, [(self.schedule_menu, plan.schedule), *slider,
                                     (self.sizes, ",".join(map(str, sizes)) if sizes else ""),
                                     (self.recompute_menu, plan.recompute or "none"), *chunks])

    def _set_board(self, devices: list[str], assignment: dict, menus=(), cuts=()) -> None:
        """Change columns, chips, stage cuts and device count together (and any (control, value) in `menus`), then
        redraw once."""
        self._quiet = True
        try:
            self.board.devices, self.board.assignment, self.device_count.value = devices, assignment, len(devices)
            self.board.cuts = kept_cuts(self.model.layer_names, assignment, cuts)
            for control, value in menus:
                control.value = value
        finally:
            self._quiet = False
        self._update()

    def _check(self):
        """(placement, schedule, sizes) for the current choices (sizes None: equal micro-batches), or a Refusal in the
        words on screen (mpedu.course.refusals)."""
        name, B = self.schedule_menu.value, self.batch.inputs.shape[1]
        sizes = read_sizes(self.sizes.value, B)
        placement, schedule = check(self.model.layer_names, self.board.devices, self.board.assignment, name,
                                    SCHEDULE_MENU[name], self.micro_batches.value, self.chunks.value, B,
                                    cuts=self.board.cuts, sizes=sizes, tied=self._tied)
        return placement, schedule, sizes

    def _apply_fix(self) -> None:
        """What the refusal's button says: another schedule, a placement (dealt in turn, a V), another micro-batch
        count, or equal micro-batches."""
        _, setting, value = self._fix
        if setting == "placement":
            self.placement = value
        else:
            {"schedule": self.schedule_menu, "micro_batches": self.micro_batches, "sizes": self.sizes}[setting].value \
                = value

    # -- prediction ---------------------------------------------------------------------
    def _update(self, *_, keep_run: bool = False) -> None:
        """Check, simulate, redraw. Runs on every change, so it must stay fast (a few ms of Python).
        keep_run: the last run's measured step stays beside the new prediction (its costs were measured since)."""
        if self._quiet:
            return
        with self._update_lock:
            if self.running:
                # The browser's controls are locked, but Python can still change a choice (explorer.placement =
                # ...): the run goes on with the choices it started with, and the board is drawn when it ends.
                self._changed_in_run = True
                self.note.value = ("A run is training the choices it started with: the change is drawn when it "
                                   "ends (or press Stop).")
                return
            self.chunks.disabled = self.schedule_menu.value != "wavefront"
            self.slowdown.disabled = not LINKS[self.link_menu.value].emulated
            if not keep_run:
                # a change makes the last run's numbers stale: they go, whether or not the new choice is accepted
                self.measured, self.run_status.value = None, ""
                self.progress.layout.display = "none"
            try:
                placement, schedule, sizes = self._check()
                costs, measured = self._step_costs(schedule.micro_batches, sizes, placement.devices[0])
                self.predicted = simulate(schedule, costs, placement, micro_batches=sizes and list(sizes),
                                          link=self.link, recompute=self.recompute)
            except ValueError as error:
                self.predicted, self.figures, self._fix = None, {}, getattr(error, "fix", None)
                self.message.value, self.figure_line.value, self.note.value = _error(error), "", ""
                self.board.device_notes = self.board.layer_notes = {}     # no figure of another choice stays
                self.timeline.layout.display, self.run_button.disabled = "none", True   # no blank space left
                self.timeline.show([], [])
                self.best_plans.compare()
            else:
                self._fix = None
                self._describe(placement, schedule, sizes, costs, measured)
                self.message.value = f"placement: <code>{html.escape(str(placement))}</code>"
                shown = ([self.predicted], [self._title(self.predicted, self._kind_of_prediction())])
                if self.measured is not None:               # keep_run: the run's last step beside it
                    shown[0].append(self.measured)
                    shown[1].append(self._measured_title)
                self.timeline.show(*shown)
                self.timeline.layout.display, self.run_button.disabled = None, self.running
                # (unequal sizes in the micro-batches' place: no row of equal ones is taken for the learner's)
                choice = (str(placement), schedule.name, sizes or schedule.micro_batches, schedule.chunks,
                          self.recompute)
                self.best_plans.compare(choice, self.predicted.makespan, max(self.figures["memory_bytes"].values()))
            # a no-op unless the devices, link, cap or measured costs changed: the planner does not run per drag
            self.best_plans.refresh(self.board.devices, self.link, self._plan_costs())
            self.fix_button.description = self._fix[0] if self._fix else ""
            self.fix_button.layout.display = None if self._fix else "none"
            self._redraws += 1
            self._save_state()

    def _restep(self, _=None) -> None:
        """The step-through, while it is on, follows the timeline above it: the last measured step when a run left
        one, else the prediction; nothing (and no toggle) while the choice is refused."""
        timeline = self.measured if self.measured is not None else self.predicted
        self.step_toggle.layout.display = None if timeline is not None else "none"
        if not self.step_toggle.value or timeline is None:
            self.stepper.layout.display = "none"
            return
        kind = "the last measured step" if self.measured is not None else f"the {self._kind_of_prediction()}"
        # the same action number in the new timeline: a run's next step (or a drag) keeps the learner's place
        self.stepper.load(timeline, self._title(timeline, f"stepping through {kind}"), at=self.stepper.step)
        self.stepper.layout.display = None

    def _kind_of_prediction(self) -> str:
        """"predicted step" from measured costs, "estimated step" from another micro-batch size's, scaled."""
        return "estimated step" if self.figures.get("estimated") else "predicted step"

    @staticmethod
    def _title(t, name: str) -> str:
        return f"{name}: {t.makespan * 1e3:.1f} ms, bubble {t.bubble_fraction:.0%}"

    def _describe(self, placement, schedule, sizes, costs, measured: bool) -> None:
        """The line of figures, a note where the numbers need a word, and the numbers on the board. `costs`: a
        per-layer Costs, or with `sizes` (unequal micro-batches) a list of them, one per micro-batch."""
        t, m = self.predicted, schedule.micro_batches
        one = simulate("naive", costs, Placement.single(self.model, placement.devices[0]),
                       micro_batches=list(sizes) if sizes else m)
        # weights, gradients and the activations at the schedule's peak: the one memory model (SGD keeps no state)
        each = [self._memory_costs(schedule, c) for c in costs] if sizes else None
        memory = {f.device: f.total for f in device_footprints(
            each[0] if sizes else self._memory_costs(schedule, costs), placement, schedule, self.recompute,
            micro_batch_costs=each)}
        self.figures = f = {"makespan_s": t.makespan, "bubble": t.bubble_fraction, "speedup": one.makespan / t.makespan,
                            "transfers": len(t.transfers()), "bytes_moved": t.bytes_moved,
                            "stages": len(placement.stages), "memory_bytes": memory, "estimated": not measured,
                            "micro_batch_sizes": list(sizes) if sizes else None}
        self.figure_line.value = (
            f"{self._kind_of_prediction()} <b>{f['makespan_s'] * 1e3:.1f} ms</b> · "
            f"bubble <b>{f['bubble']:.0%}</b> · <b>{f['speedup']:.2f}×</b> the speed of one device doing the same "
            f"{sizes_words(sizes or [self.batch.inputs.shape[1] // m] * m)} · <b>{f['transfers']}</b> transfers "
            f"({f['bytes_moved'] / 1e6:.1f} MB) · {plural(f['stages'], 'stage')} on "
            f"{plural(len(t.devices), 'device')}")
        self.note.value = self._cost_words(costs, measured)
        if self.schedule_menu.value == "1f1b" and schedule.name == "interleaved":     # the menu said 1F1B
            self.note.value += (" 1F1B on stages dealt to the devices in turn runs as <b>interleaved 1F1B</b>: each "
                                "device alternates between its stages, which is what interleaving is.")
        top = max(memory.values()) or 1
        self.board.device_notes = {d: {"text": f"busy {t.busy(d) * 1e3:.0f} ms of {t.makespan * 1e3:.0f}\n"
                                               f"memory {memory[d] / 1e6:.1f} MB", "fill": memory[d] / top}
                                   for d in t.devices}
        self.board.layer_notes = layer_notes(costs)

    def _save_state(self) -> None:
        """What Python sees, as JSON (written whole, then renamed: a reader never sees half a file)."""
        if self.state_file:
            placement = self.placement
            state = {"placement": placement and str(placement), "assignment": self.board.assignment,
                     "devices": self.board.devices, "schedule": self.schedule_menu.value,
                     "recompute": self.recompute_menu.value,
                     "micro_batches": self.micro_batches.value, "sizes": self.sizes.value, "cuts": self.board.cuts,
                     "figures": self.figures, "redraws": self._redraws,
                     "message": self.message.value, "progress": self.progress.value, "losses": self.losses,
                     "running": self.running, "runs": self._runs, "revision": self.timeline.revision,
                     "link": self.link_menu.value, "measuring": sorted(self._measuring)}
            tmp = f"{self.state_file}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_file)
