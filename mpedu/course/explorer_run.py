"""The explorer's Run button: train the plan on the board for real, a few steps on a background thread
(the kernel stays free), each step's measured timeline drawn beside the prediction; Stop ends it after
the step it is on. A part of PipelineExplorer, kept apart because it is the one that runs."""
from __future__ import annotations

import html
import threading

import torch

from ..core.pipeline import Pipeline
from ..predict.simulator import simulate
from ..runtime.devices import usable_cores
from ..runtime.link import LINKS
from ..training.loop import step
from ..training.recipes import CLIP, LR
from .wording import far_from_prediction


class RealSteps:
    """PipelineExplorer's real steps (it holds the widgets and the state these methods use)."""

    def run(self, steps: int | None = None) -> None:
        """Train `steps` real steps with the current choices on a background thread (the kernel stays free)."""
        with self._update_lock:      # a measurement that ends meanwhile redraws before this, or after the run
            if self.running or self.predicted is None:
                return
            placement, schedule, sizes = self._check()
            steps, cores = steps or self.steps, len(usable_cores())
            # more virtual devices than cores take turns on them: say what to expect here, next to the prediction
            shared = all(d.virtual for d in placement.devices) and len(placement.devices) > cores
            costs, _ = self._step_costs(schedule.micro_batches, sizes, placement.devices[0])
            here = (simulate(schedule, costs, placement, micro_batches=sizes and list(sizes), cores=cores,
                             link=self.link, recompute=self.recompute) if shared else None)
            self.running, self.losses, self._runs = True, [], self._runs + 1
            self._stop.clear()
            self._lock(True)
            self.progress.max, self.progress.value, self.run_status.value = steps, 0, "starting the devices…"
            self.progress.layout.display = None
            self._save_state()
            self._thread = threading.Thread(target=self._train, args=(placement, schedule, sizes, here, steps, cores),
                                            name="mpedu-explorer-run", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ask the run to stop after the step it is on."""
        if self.running:
            self._stop.set()
            self.run_status.value = "stopping after this step…"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the run and any measurement have ended (for scripts and tests; the widget never waits)."""
        while True:                   # again: a run that ends redraws, which may start a measurement
            threads = [t for t in [self._thread, *list(self._measuring.values())] if t is not None and t.is_alive()]
            if not threads:
                break
            for thread in threads:
                thread.join(timeout)
            if timeout is not None and any(t.is_alive() for t in threads):
                break
        self.best_plans.wait(timeout)                      # last: a measurement that ends starts a search

    def _train(self, placement, schedule, sizes, here, steps, cores) -> None:
        # the command line's step (mpedu.training.loop.step), with its learning rate and clipping, for a few steps
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer, done, predicted = torch.optim.SGD(params, lr=LR), 0, self.predicted
        spans = []                                       # each step's measured makespan
        kind, estimated, widths = self._kind_of_prediction(), self.figures.get("estimated"), self._widths()
        expect = (f" ({len(placement.devices)} devices take turns on {cores} cores here: about "
                  f"{here.makespan * 1e3:.0f} ms expected)" if here is not None else "")
        try:
            with self._model_lock, Pipeline(self.model, placement, schedule, sizes and list(sizes), link=self.link,
                                            recompute=self.recompute) as pipe:
                while done < steps and not self._stop.is_set():
                    result, stepped = step(pipe, optimizer, self.batch, clip=CLIP)
                    if not stepped:     # the weights stay as they were: say so rather than train on
                        raise FloatingPointError(f"step {done + 1}: the loss ({result.loss:.4g}) or a gradient is "
                                                 "not finite, so the weights were left as they were and the run "
                                                 "stopped")
                    done += 1
                    spans.append(result.timeline.makespan)
                    self.measured = result.timeline
                    self.losses.append(result.loss)
                    self.progress.value = done
                    self._measured_title = self._title(result.timeline, f"measured step {done}") + expect
                    self.timeline.show([predicted, result.timeline],
                                       [self._title(predicted, kind), self._measured_title])
                    self.run_status.value = f"step {done}/{steps}: loss {result.loss:.3f}"
                    self._save_state()
            if done < steps:
                self.run_status.value += f" · stopped after {done} of {steps} steps"
            self.run_status.value += far_from_prediction(spans, (predicted if here is None else here).makespan,
                                                         all(d.virtual for d in placement.devices))
        except Exception as error:                        # shown in the widget, never as a traceback
            self.run_status.value = error_html(error)
        finally:
            with self._update_lock:           # a change from Python is either seen as during the run, or after
                self.running = False
                self._lock(False)
                if self._changed_in_run:      # Python changed a choice meanwhile: draw the board as it is now
                    self._changed_in_run = False
                    self._update()
                elif estimated and all((self.batch.inputs.shape[0], b) in self._costs for b in widths):
                    self._update(keep_run=True)   # the costs were measured meanwhile: predict from them, run kept
                self._save_state()

    def _lock(self, on: bool) -> None:
        """While a run trains, the choices stay as they were when it started."""
        for control in (self.device_count, self.micro_batches, self.sizes, self.schedule_menu, self.link_menu,
                        self.run_button, self.fix_button, self.recompute_menu):
            control.disabled = on
        self.chunks.disabled = on or self.schedule_menu.value != "wavefront"
        self.slowdown.disabled = on or not LINKS[self.link_menu.value].emulated
        self.board.locked, self.stop_button.disabled = on, not on
        self.best_plans.lock(on)


def error_html(error) -> str:
    """An error as the widget shows it: in red, never as a traceback."""
    return f'<div style="color:#b3261e; white-space:pre-wrap">⚠ {html.escape(str(error))}</div>'
