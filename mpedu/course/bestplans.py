"""The explorer's best plans: the planner's fastest few for the board's devices, link and memory cap, each one click
from the board, and the learner's own choice against the best."""
from __future__ import annotations

import contextlib
import html
import threading

import ipywidgets as w

from ..predict.costcurve import CostCurve
from ..predict.planner import plan, search_shapes
from ..predict.plans import NoPlanFits, PlanStopped
from ..runtime.values import SIZE_UNITS, format_size, parse_size
from .wording import RECOMPUTE, SCHEDULES

ROWS = 4            # plans that fit, fastest first
OVER = 2            # and at most this many faster ones over the cap: what the cap costs


def describe(candidate) -> str:
    """A plan in the explorer's words: the menus' names, then the placement as the board's message writes it."""
    chunks = f" · {candidate.chunks} time chunks" if candidate.chunks > 1 else ""
    return (f"{SCHEDULES[candidate.schedule]} · {candidate.micro_batches} micro-batches{chunks} · "
            f"{RECOMPUTE[candidate.recompute or 'none']} · {candidate.placement}")


def same_plan(candidate, choice) -> bool:
    """Is `choice` (placement, schedule, micro-batches, chunks, recompute) this candidate's plan?"""
    return choice == (str(candidate.placement), candidate.schedule, candidate.micro_batches, candidate.chunks,
                      candidate.recompute)


class BestPlans(w.VBox):
    """The planner's (mpedu.predict.planner.plan) fastest plans for the explorer's devices, link and memory cap, on the
    costs the explorer has measured, each row with a button that applies it (`apply(candidate)`).

    The planner searches every partition, schedule, micro-batch count and recomputation (about 0.15 s for mxnet8
    on 2 devices, longer for more), too slow to redo at every drag when a redraw must take a few ms. So it runs
    only when what it depends on changes (the devices, the link, the cap, the costs measured), never for a drag
    or a menu, which change none of these: `refresh` compares a key and returns at once when it is the same.
    It runs on a thread of its own, so the board stays responsive while it searches; a request that arrives
    mid-search replaces any waiting one and stops the running search at its next candidate.
    """

    def __init__(self, model, batch, apply, memory_cap=None, weighed=None, model_lock=None):
        self.model, self.batch, self._apply = model, batch, apply
        # activation bytes at exact shapes (CostCurve.weigh), shared with the explorer so that a row's memory is
        # the board's; weighing runs the model, so it waits for `model_lock` (a run trains it meanwhile)
        self.weighed, self._model_lock = ({} if weighed is None else weighed), model_lock
        self.plans, self.rows, self.searches, self.thread = None, [], 0, None    # searches: planner calls
        self._key = self._args = self._waiting = None
        self._choice = None                          # (choice key, step seconds, peak bytes) or None: refused
        self._over_all = None                        # the cap no plan fits, when none does
        self._lock, self._drawing, self._locked = threading.Lock(), threading.RLock(), False
        self.cap = w.Text(value="" if memory_cap is None else _size_text(parse_size(memory_cap)),
                          placeholder="none (e.g. 40MB)", description="memory cap per device",
                          continuous_update=False, style={"description_width": "initial"})
        self.header, self.versus, self.table = w.HTML(), w.HTML(), w.VBox()
        self.cap.observe(lambda _: self._args and self.refresh(*self._args), "value")
        super().__init__([w.HTML("<b>Best plans</b> (the planner's fastest for these devices, link and cap)"),
                          self.cap, self.header, self.table, self.versus])
        self.add_class("mpedu-best-plans")

    @property
    def memory_cap(self) -> int | None:
        """The cap box as bytes (None when empty); a ValueError names what is wrong with its text."""
        text = self.cap.value.strip()
        return parse_size(text) if text else None

    def refresh(self, devices: list[str], link, costs: list) -> None:
        """Plan again if the devices, link, cap or measured costs differ from the last search; else nothing.
        `costs`: the explorer's profiles (mpedu.predict.profiling.Costs), one per measured micro-batch width."""
        self._args = (devices, link, costs)
        try:
            cap = self.memory_cap
        except ValueError as error:
            with self._drawing:
                self._key, self.plans, self.rows, self.header.value = None, None, [], _warn(error)
                self._draw()
            return
        widths = tuple(sorted(c.micro_batch[1] for c in costs))
        key = (tuple(devices), link, cap, widths)
        if key == self._key or not costs:
            return
        self._key = key
        B = self.batch.inputs.shape[1]
        # only the micro-batch counts whose widths were measured: a width scaled from another makes small
        # micro-batches look as cheap per sequence as big ones, and the list would praise the slowest
        job = (list(devices), link, cap, CostCurve(list(costs), [], self.weighed), sorted(B // b for b in widths))
        with self._drawing:                              # the rows of other devices or costs go at once
            self.plans, self.rows, self.header.value, self._over_all = None, [], "searching…", None
            self._draw()
            with self._lock:
                self._waiting = job
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(target=self._search, daemon=True, name="mpedu-explorer-plans")
                    self.thread.start()

    def _search(self) -> None:
        """The search thread: plan for the waiting request, until none waits."""
        while True:
            with self._lock:
                job, self._waiting = self._waiting, None
                if job is None:
                    return
            devices, link, cap, curve, ms = job
            try:
                T, B = self.batch.inputs.shape
                with self._model_lock or contextlib.nullcontext():    # the time chunks' bytes, as measured
                    curve.weigh(self.model, search_shapes(T, B, ms), curve.widths[0].device)
                # a newer request (another device count, link or cap) ends this search at the next candidate
                plans = plan(self.model, self.batch, devices, cap, costs=curve, micro_batches=ms, link=link,
                             should_stop=lambda: self._waiting is not None)
                rows = plans.fastest_fitting(ROWS)
                over = [c for c in plans.front if not c.fits and c.step_s < plans.best.step_s][:OVER]
            except PlanStopped:                          # superseded: the loop takes the waiting request
                continue
            except NoPlanFits as error:                  # in the explorer's words (the planner's name arguments)
                small = error.smallest
                plans, rows, message = None, [], _warn(
                    f"No plan fits the cap of {format_size(error.cap)} per device on {len(devices)} devices: the "
                    f"smallest needs {format_size(small.peak_bytes, up=True)} on its largest device "
                    f"({describe(small)}). Raise the cap to at least that, or use more devices.")
                over_all = error.cap
            except Exception as error:                   # tied weights, ...: said in the panel
                plans, rows, message, over_all = None, [], _warn(error), None
            else:
                over_all = None
                rows = sorted(over + rows, key=lambda c: c.step_s)
                message = (f"{plans.searched} plans searched in {plans.seconds * 1e3:.0f} ms, on the layer costs "
                           f"profiled for {' or '.join(map(str, ms))} micro-batches (pick another count to profile it "
                           f"too). "
                           f"Each row: step time · memory of {' / '.join(devices)} · the plan.")
            finally:
                self.searches += 1
            with self._drawing:
                if self._waiting is None:                # a newer search is waiting: draw that one instead
                    self.plans, self.rows, self.header.value, self._over_all = plans, rows, message, over_all
                    self._draw()

    def compare(self, choice=None, step_s: float | None = None, peak_bytes: int | None = None) -> None:
        """The learner's current choice (placement text, schedule, micro-batches, chunks, recompute) and its step
        time and largest device's memory, against the best; no choice: the board is refused."""
        with self._drawing:
            self._choice = None if choice is None else (choice, step_s, peak_bytes)
            self._draw()

    def _draw(self) -> None:
        """The rows and the line under them, from the last search and the last choice (hold self._drawing)."""
        plans, choice = self.plans, self._choice
        best = plans.best if plans else None
        if len(self.table.children) != len(self.rows):
            self.table.children = [self._row() for _ in self.rows]
        for box, c in zip(self.table.children, self.rows):
            button, text = box.children
            button.plan = c
            mine = " ← your choice" if choice and same_plan(c, choice[0]) else ""
            mark = "★ fastest that fits · " if c is best else "" if c.fits else "over the cap · "
            unit = format_size(max(c.device_bytes)).split()[-1]             # one unit for the row: the largest's
            scale = SIZE_UNITS[unit]
            memory = " / ".join(f"{b / scale:.3g}" for b in c.device_bytes) + f" {unit}"
            style = ("background:#fff3cd; font-weight:bold" if c is best else "" if c.fits else "color:#777")
            text.value = (f'<div style="{style}">{mark}<b>{c.step_s * 1e3:.1f} ms</b> · memory {memory} · '
                          f"{html.escape(describe(c))}{mine}</div>")
        if choice is not None and best is None and self._over_all is not None:     # nothing fits: nor the board
            _, step_s, peak = choice
            self.versus.value = (f"Your choice: <b>{step_s * 1e3:.1f} ms</b>, largest device {format_size(peak)}; "
                                 f"{'over' if peak > self._over_all else 'within'} the cap.")
            return
        if choice is None or best is None:
            self.versus.value = "" if best is None else "The board is refused now: apply a plan above to go on."
            return
        _, step_s, peak = choice
        over = plans.memory_cap is not None and peak > plans.memory_cap
        ratio = step_s / best.step_s
        if same_plan(best, choice[0]):
            verdict = "it is the fastest plan that fits"
        elif over:
            verdict = f"over the cap; the fastest plan that fits takes <b>{best.step_s * 1e3:.1f} ms</b>"
        elif ratio < 1.005:                              # equal to the shown digits: no "1.00×" to puzzle over
            verdict = "as fast as the fastest plan that fits"
        else:
            verdict = (f"the fastest plan that fits takes <b>{best.step_s * 1e3:.1f} ms</b>: yours takes "
                       f"<b>{ratio:.2f}×</b> its time")
        self.versus.value = (f"Your choice: <b>{step_s * 1e3:.1f} ms</b>, largest device {format_size(peak)}; "
                             f"{verdict}.")

    def _row(self):
        button = w.Button(description="apply", tooltip="set the board and the menus to this plan",
                          layout=w.Layout(width="auto", min_width="64px", flex="0 0 auto"), disabled=self._locked)
        button.on_click(lambda b: b.plan is not None and self._apply(b.plan))
        button.plan = None
        row = w.HBox([button, w.HTML()])
        row.add_class("mpedu-plan")
        return row

    def lock(self, on: bool) -> None:
        """While a run trains, the choices stay as they were: no plan can be applied."""
        with self._drawing:
            self._locked = self.cap.disabled = on
            for box in self.table.children:
                box.children[0].disabled = on

    def wait(self, timeout: float | None = None) -> None:
        """Block until the search under way (if any) has ended (for scripts and tests)."""
        if self.thread is not None:
            self.thread.join(timeout)


def _size_text(nbytes: int) -> str:
    """A cap for the box: "40 MB" when that reads back as the same bytes, else the bytes ("55999B")."""
    text = format_size(nbytes)
    return text if parse_size(text) == nbytes else f"{nbytes}B"


def _warn(error) -> str:
    return f'<span style="color:#b3261e">{html.escape(str(error))}</span>'
