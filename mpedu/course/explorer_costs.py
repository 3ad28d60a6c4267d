"""The explorer's layer costs: measured once per micro-batch width (in the background after the first), read at the
widths a choice needs (equal micro-batches, or the sizes box's unequal ones), with the bytes of time chunks as
weighed. A part of PipelineExplorer, kept apart as explorer_run is."""
from __future__ import annotations

import threading

from ..predict.costcurve import CostCurve
from ..predict.profiling import profile
from ..runtime.streams import chunk_bounds
from .explorer_run import error_html
from .refusals import read_sizes
from .wording import cost_note, sequences


class MeasuredCosts:
    """PipelineExplorer's costs (it holds the widgets and the state these methods use: `_costs` by (T, width),
    `_measuring` by width, `_weighed`, the model lock)."""

    def _widths(self) -> list[int]:
        """The micro-batch widths the current choice needs (the sizes box's, else the slider's equal ones)."""
        B = self.batch.inputs.shape[1]
        try:
            sizes = read_sizes(self.sizes.value, B)
        except ValueError:
            sizes = None
        return list(dict.fromkeys(sizes)) if sizes else [B // self.micro_batches.value]

    def _step_costs(self, m: int, sizes, device):
        """(costs, measured) for simulate: per-layer Costs of micro-batches of B/m sequences, or with `sizes` a
        list of them, one per micro-batch at its own width; measured is False while any is an estimate."""
        if not sizes:
            return self._costs_at(self.batch.inputs.shape[1] // m, device)
        each = {b: self._costs_at(b, device) for b in dict.fromkeys(sizes)}
        return [each[b][0] for b in sizes], all(ok for _, ok in each.values())

    def _costs_at(self, b: int, device):
        """(costs, measured): the layers' costs on micro-batches of b sequences. Not measured yet: the nearest
        measured size scaled per sequence now, and a background measurement that redraws when it is done."""
        T = self.batch.inputs.shape[0]
        if (T, b) in self._costs:
            return self._costs[T, b], True
        if not self._costs:                                # nothing to start from: measure now, once
            self.message.value = f"measuring the layers on micro-batches of {sequences(b)} (once)…"
            with self._model_lock:
                self._costs[T, b] = self._profile(b, device)
            return self._costs[T, b], True
        if b not in self._measuring:
            thread = threading.Thread(target=self._measure, args=(b, device), daemon=True,
                                      name=f"mpedu-explorer-measure-{b}")
            self._measuring[b] = thread
            thread.start()
        nearest = min(self._costs.values(), key=lambda c: abs(c.micro_batch[1] - b))
        return CostCurve([nearest], []).at(T, b), False    # scaled per sequence (small ones cost more)

    def _profile(self, b: int, device):
        """The layers measured on the batch's first b sequences (hold the model lock)."""
        B = self.batch.inputs.shape[1]
        part = self.batch if b == B else self.batch.split([b, B - b])[0]
        return profile(self.model, part, device, warmup=1, repeats=3)

    def _measure(self, b: int, device) -> None:
        T = self.batch.inputs.shape[0]
        try:
            with self._model_lock:                         # waits for a run to end
                costs = self._profile(b, device)
            self._costs[T, b] = costs
        except Exception as error:                         # shown in the widget, never as a traceback
            self.note.value = error_html(f"could not measure micro-batches of {sequences(b)}: {error}")
            return
        finally:
            self._measuring.pop(b, None)
        if b in self._widths() and not self.running:
            self._update()

    def _memory_costs(self, schedule, costs):
        """`costs` with the bytes of time chunks as measured (CostCurve.at over weighed chunk lengths, as the best
        plans read them): a chunk saves more than its share of the whole sequence (its state comes in), and T not a
        multiple of the chunk count gives two lengths. Weighing runs the model once per shape; while a run holds
        the model, the footprint takes each chunk as its share until the next redraw."""
        if schedule.chunks == 1:
            return costs
        T, b = self.batch.inputs.shape[0], costs.micro_batch[1]
        curve = CostCurve([costs], [], self._weighed)
        missing = {(hi - lo, b) for lo, hi in chunk_bounds(T, schedule.chunks)} - set(self._weighed)
        if missing:
            if not self._model_lock.acquire(blocking=False):
                return costs
            try:
                curve.weigh(self.model, missing, costs.device)
            finally:
                self._model_lock.release()
        return curve.at(T, b, schedule.chunks)

    def _cost_words(self, costs, measured: bool) -> str:
        """The note under the figures: cost_note, or for unequal micro-batches the widths still being measured."""
        if not isinstance(costs, list):
            return cost_note(costs, self._costs.values(), measured)
        T = self.batch.inputs.shape[0]
        if measured:
            return cost_note(min(costs, key=lambda c: c.micro_batch[1]), self._costs.values(), True)
        todo = sorted({c.micro_batch[1] for c in costs} - {b for t, b in self._costs if t == T})
        return (f"Estimated: the layers' costs on micro-batches of {', '.join(map(str, todo))} sequences are scaled "
                f"per sequence from the nearest measured size; measuring them now (the numbers update by "
                f"themselves)…")

    def _plan_costs(self) -> list:
        """The measured profiles the best plans may search on: the widths of equal micro-batches (the planner's
        counts divide the batch; a width of the sizes box alone would stand for a count it never measured)."""
        B = self.batch.inputs.shape[1]
        return [c for c in self._costs.values() if B % c.micro_batch[1] == 0]


def layer_notes(costs) -> dict:
    """Each chip's time (forward and backward of one micro-batch); from the smallest to the largest with sizes."""
    each = costs if isinstance(costs, list) else [costs]
    spans = [[(f + b) * 1e3 for f, b in zip(c.forward, c.backward)] for c in each]
    lo, hi = [min(t) for t in zip(*spans)], [max(t) for t in zip(*spans)]
    return {name: f"{a:.1f} ms" if f"{a:.1f}" == f"{z:.1f}" else f"{a:.1f}–{z:.1f} ms"
            for name, a, z in zip(each[0].names, lo, hi)}


def sizes_words(sizes) -> str:
    """"4 micro-batches" or, for unequal ones, "4 micro-batches (of 8, 16, 24, 16 sequences)"."""
    m = len(sizes)
    unequal = f" (of {', '.join(map(str, sizes))} sequences)" if len(set(sizes)) > 1 else ""
    return f"{m} micro-batch{'es' if m != 1 else ''}{unequal}"
