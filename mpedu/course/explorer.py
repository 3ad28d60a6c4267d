"""The notebook explorer: drag layers onto devices, pick a schedule and micro-batches, see the step predicted and run."""
from __future__ import annotations

import html
import json
import os
import threading

import ipywidgets as w

from ..core.placement import Placement
from ..predict.costcurve import CostCurve
from ..predict.footprint import device_footprints
from ..predict.profiling import profile
from ..predict.simulator import simulate
from ..runtime.devices import get_device, get_devices
from ..runtime.link import LINKS
from ..runtime.streams import chunk_bounds
from .bestplans import BestPlans
from .board import LayerBoard
from .explorer_run import RealSteps
from .explorer_run import error_html as _error
from .refusals import check
from .stepper import StepThrough
from .timeline_view import TimelineView
from .wording import RECOMPUTE, SCHEDULES, SLOWDOWNS, cost_note, link_label, plural, sequences


class PipelineExplorer(RealSteps, w.VBox):
    """Place layers on devices by dragging, pick a schedule, micro-batches and a link, and see the predicted
    step at once; Run trains a few real steps (SGD: it updates the model) and draws them under the prediction.

        explorer = PipelineExplorer(model, batch, devices=2, schedule="gpipe", micro_batches=4)
        explorer                      # the last line of a cell shows it
        explorer.placement            # the board as a Placement (None while it is refused); assignable

    Costs come from `profile`, measured once per micro-batch shape (pass `costs`, one or a list, to reuse
    yours). A new micro-batch size is first drawn from the nearest measured size, scaled per sequence, while its
    real costs are measured in the background; the drawing then updates by itself.

    Under its timeline a "step through" toggle opens `explorer.stepper` (mpedu.course.stepper): the last measured
    step, else the prediction, played action by action, following every redraw.

    Under the controls, `explorer.best_plans` lists the planner's fastest plans for these devices and link within
    `memory_cap` (bytes or "40MB" per device; a box there changes it), each one click from the board.
    """

    def __init__(self, model, batch, devices: int | list = 2, schedule: str = "gpipe", micro_batches: int = 4,
                 chunks: int = 2, costs=None, steps: int = 5, link: str = "shared", slowdown: int = 1,
                 state_file=None, recompute: str | None = None, memory_cap=None):
        T, B = batch.inputs.shape
        if B % micro_batches:
            raise ValueError(f"micro_batches={micro_batches} does not divide the batch size {B}; "
                             f"use one of {[m for m in range(1, B + 1) if B % m == 0]}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
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

        self.board.observe(self._update, ["assignment", "devices"])
        for control in (self.micro_batches, self.schedule_menu, self.chunks, self.link_menu, self.slowdown,
                        self.recompute_menu):
            control.observe(self._update, "value")
        self.device_count.observe(self._resize, "value")
        # every redraw of the timeline (a prediction, a run's step, a refusal) is one for the step-through
        self.timeline.observe(self._restep, "revision")
        self.step_toggle.observe(self._restep, "value")
        self.fix_button.on_click(lambda _: self._fix and self._apply_fix())
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        super().__init__([self.board, w.HBox([self.device_count, self.micro_batches]),
                          w.HBox([self.schedule_menu, self.chunks]), w.HBox([self.link_menu, self.slowdown]),
                          self.recompute_menu,
                          self.message, self.fix_button, self.figure_line, self.note, self.timeline,
                          self.step_toggle, self.stepper,
                          w.HBox([self.run_button, self.stop_button, self.progress]), self.run_status,
                          self.best_plans])
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
        self._place(placement)

    def _place(self, placement: Placement | str | dict, menus=()) -> None:
        if not isinstance(placement, Placement):
            placement = (Placement.parse if isinstance(placement, str) else Placement.from_dict)(placement, self.model)
        names = sorted({d.name for d in placement.devices}, key=lambda n: (len(n), n))   # vgpu:2 before vgpu:10
        self._set_board(names, {k: v.name for k, v in placement.assignment.items()}, menus)

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
        micro-batches, time chunks and recomputation, all set together and drawn once."""
        chunks = [(self.chunks, plan.chunks)] if plan.chunks > 1 else []   # other schedules ignore the slider
        self._place(plan.placement, [(self.schedule_menu, plan.schedule), (self.micro_batches, plan.micro_batches),
                                     (self.recompute_menu, plan.recompute or "none"), *chunks])

    def _set_board(self, devices: list[str], assignment: dict, menus=()) -> None:
        """Change columns, chips and device count together (and any (control, value) in `menus`), then redraw once."""
        self._quiet = True
        try:
            self.board.devices, self.board.assignment, self.device_count.value = devices, assignment, len(devices)
            for control, value in menus:
                control.value = value
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
        """(placement, schedule) for the current choices, or a Refusal in the words on screen (mpedu.course.refusals)."""
        name = self.schedule_menu.value
        return check(self.model.layer_names, self.board.devices, self.board.assignment, name, SCHEDULES[name],
                     self.micro_batches.value, self.chunks.value, self.batch.inputs.shape[1])

    def _apply_fix(self) -> None:
        """What the refusal's button says: another schedule, the layers dealt in turn, or another micro-batch count."""
        _, setting, value = self._fix
        if setting == "placement":
            self.placement = value
        else:
            {"schedule": self.schedule_menu, "micro_batches": self.micro_batches}[setting].value = value

    # -- prediction ---------------------------------------------------------------------
    def _costs_for(self, m: int, device):
        """(costs, measured): the layers' costs on micro-batches of B/m sequences. Not measured yet: the nearest
        measured size scaled per sequence now, and a background measurement that redraws when it is done."""
        T, B = self.batch.inputs.shape
        key = (T, B // m)
        if key in self._costs:
            return self._costs[key], True
        if not self._costs:                                # nothing to start from: measure now, once
            self.message.value = f"measuring the layers on micro-batches of {sequences(B // m)} (once)…"
            with self._model_lock:
                self._costs[key] = profile(self.model, self.batch, device, micro_batches=m, warmup=1, repeats=3)
            return self._costs[key], True
        if m not in self._measuring:
            thread = threading.Thread(target=self._measure, args=(m, device), daemon=True,
                                      name=f"mpedu-explorer-measure-{m}")
            self._measuring[m] = thread
            thread.start()
        nearest = min(self._costs.values(), key=lambda c: abs(c.micro_batch[1] - B // m))
        return CostCurve([nearest], []).at(T, B // m), False    # scaled per sequence (small ones cost more)

    def _memory_costs(self, schedule, costs):
        """`costs` with the bytes of time chunks as measured (CostCurve.at over weighed chunk lengths, as the best
        plans read them): a chunk saves more than its share of the whole sequence (its state comes in), and T not a
        multiple of the chunk count gives two lengths. Weighing runs the model once per shape; while a run holds
        the model, the footprint takes each chunk as its share until the next redraw."""
        if schedule.chunks == 1:
            return costs
        T, B = self.batch.inputs.shape
        curve, b = CostCurve([costs], [], self._weighed), B // schedule.micro_batches
        missing = {(hi - lo, b) for lo, hi in chunk_bounds(T, schedule.chunks)} - set(self._weighed)
        if missing:
            if not self._model_lock.acquire(blocking=False):
                return costs
            try:
                curve.weigh(self.model, missing, costs.device)
            finally:
                self._model_lock.release()
        return curve.at(T, b, schedule.chunks)

    def _measure(self, m: int, device) -> None:
        T, B = self.batch.inputs.shape
        try:
            with self._model_lock:                         # waits for a run to end
                costs = profile(self.model, self.batch, device, micro_batches=m, warmup=1, repeats=3)
            self._costs[T, B // m] = costs
        except Exception as error:                         # shown in the widget, never as a traceback
            self.note.value = _error(f"could not measure micro-batches of {sequences(B // m)}: {error}")
            return
        finally:
            self._measuring.pop(m, None)
        if self.micro_batches.value == m and not self.running:
            self._update()

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
                placement, schedule = self._check()
                costs, measured = self._costs_for(schedule.micro_batches, placement.devices[0])
                self.predicted = simulate(schedule, costs, placement, link=self.link, recompute=self.recompute)
            except ValueError as error:
                self.predicted, self.figures, self._fix = None, {}, getattr(error, "fix", None)
                self.message.value, self.figure_line.value, self.note.value = _error(error), "", ""
                self.board.device_notes = self.board.layer_notes = {}     # no figure of another choice stays
                self.timeline.layout.display, self.run_button.disabled = "none", True   # no blank space left
                self.timeline.show([], [])
                self.best_plans.compare()
            else:
                self._fix = None
                self._describe(placement, schedule, costs, measured)
                self.message.value = f"placement: <code>{html.escape(str(placement))}</code>"
                shown = ([self.predicted], [self._title(self.predicted, self._kind_of_prediction())])
                if self.measured is not None:               # keep_run: the run's last step beside it
                    shown[0].append(self.measured)
                    shown[1].append(self._measured_title)
                self.timeline.show(*shown)
                self.timeline.layout.display, self.run_button.disabled = None, self.running
                choice = (str(placement), schedule.name, schedule.micro_batches, schedule.chunks, self.recompute)
                self.best_plans.compare(choice, self.predicted.makespan, max(self.figures["memory_bytes"].values()))
            # a no-op unless the devices, link, cap or measured costs changed: the planner does not run per drag
            self.best_plans.refresh(self.board.devices, self.link, list(self._costs.values()))
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

    def _describe(self, placement, schedule, costs, measured: bool) -> None:
        """The line of figures, a note where the numbers need a word, and the numbers on the board."""
        t = self.predicted
        one = simulate("naive", costs, Placement.single(self.model, placement.devices[0]),
                       micro_batches=schedule.micro_batches)
        # weights, gradients and the activations at the schedule's peak: the one memory model (SGD keeps no state)
        memory = {f.device: f.total for f in device_footprints(self._memory_costs(schedule, costs), placement,
                                                               schedule, self.recompute)}
        self.figures = f = {"makespan_s": t.makespan, "bubble": t.bubble_fraction, "speedup": one.makespan / t.makespan,
                            "transfers": len(t.transfers()), "bytes_moved": t.bytes_moved,
                            "stages": len(placement.stages), "memory_bytes": memory, "estimated": not measured}
        m = schedule.micro_batches
        self.figure_line.value = (
            f"{self._kind_of_prediction()} <b>{f['makespan_s'] * 1e3:.1f} ms</b> · "
            f"bubble <b>{f['bubble']:.0%}</b> · <b>{f['speedup']:.2f}×</b> the speed of one device doing the same "
            f"{m} micro-batch{'es' if m > 1 else ''} · <b>{f['transfers']}</b> transfers "
            f"({f['bytes_moved'] / 1e6:.1f} MB) · {plural(f['stages'], 'stage')} on "
            f"{plural(len(t.devices), 'device')}")
        self.note.value = cost_note(costs, self._costs.values(), measured)
        if self.schedule_menu.value == "1f1b" and schedule.name == "interleaved":     # the menu said 1F1B
            self.note.value += (" 1F1B on stages dealt to the devices in turn runs as <b>interleaved 1F1B</b>: each "
                                "device alternates between its stages, which is what interleaving is.")
        top = max(memory.values()) or 1
        self.board.device_notes = {d: {"text": f"busy {t.busy(d) * 1e3:.0f} ms of {t.makespan * 1e3:.0f}\n"
                                               f"memory {memory[d] / 1e6:.1f} MB", "fill": memory[d] / top}
                                   for d in t.devices}
        self.board.layer_notes = {name: f"{(fw + bw) * 1e3:.1f} ms"
                                  for name, fw, bw in zip(costs.names, costs.forward, costs.backward)}

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
