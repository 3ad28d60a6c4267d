"""One device's part of a pipeline step: play its row of the schedule, action by action.

    F (stage s, micro-batch i): receive s's input (from stage s-1, or the batch), forward, send the output on
    B (stage s, micro-batch i): receive the output's gradient (from stage s+1, or the loss), backward, send
                                the input's gradient back
    W (stage s, micro-batch i): the weight gradients a split backward (zero bubble) left for later

Each hand-off goes through the step's Mailbox; the receiving stage detaches what it receives
(Stage.forward), so each stage's backward runs its own graph only, on its own device's thread.
What each action did and when is noted as a Mark, made into the timeline's Events after the step.
"""
from __future__ import annotations

import torch

from ..runtime.clock import Clock
from .mailbox import Aborted
from .runner import count_targets
from .schedules import Action
from .timeline import Mark, new_mark


class DeviceStep:
    """What device `d` does in one step: `run()` plays `row`, a list of Actions, on the pipeline's stages.

    On the step's critical path: each action costs a few microseconds of Python here, so what a method
    reads often is bound once (self.note, self.mark, the input slicers) rather than looked up each time."""

    @classmethod
    def play(cls, *args) -> "DeviceStep":
        """Made and run on the device's own thread, so that the caller's thread, which starts the first device,
        only hands out the step's shared parts: the DeviceStep, with the step's tokens and summed NLL where it
        holds the last stage."""
        job = cls(*args)
        job.run()
        return job

    def __init__(self, pipe, d: int, row, batch, micro, train: bool, mailbox, timeline, t0: float, key, plan,
                 reset: dict):
        self.device = pipe.devices[d]
        self.stages, self.last = pipe.stages, len(pipe.stages) - 1
        self.own = [s for s in pipe.stages if s.device.name == self.device.name]
        self.reset = reset                  # Stage.reset's arguments for this step (mpedu.core.carry)
        # where this device holds the last stage: it checks the batch's targets and counts its tokens (the loss is
        # scaled by 1 / tokens), and sums the step's NLL
        self.holds_loss, self.batch, self.vocab_size = pipe.stages[-1] in self.own, batch, pipe.model.vocab_size
        self.tokens: int | None = None
        self.nll_sum: float | None = None
        self.row, self.scale, self.train = row, 1.0, train
        self.mailbox, self.timeline, self.t0, self.key = mailbox, timeline, t0, key
        self.starts, self.chunk_starts = plan.starts, plan.chunk_starts     # first column, first time step
        self.split = pipe.schedule.split_backward       # stages whose backward leaves W for later
        # per stage and micro-batch: whether its forward is re-run in the backward (activation recomputation)
        self.again = pipe.recomputing[train]
        self.copies = pipe.copies[d]
        self.inputs = self.copies.loader(micro.inputs)      # (t, b) slices of the batch, where this device reads
        self.targets = self.copies.loader(micro.targets)
        self.marks: list[Mark] = []
        self.note = self.marks.append

    def run(self) -> None:
        clock = self.clock = Clock(self.device, self.t0)   # made on the worker's thread (a GPU times on its stream)
        self.mark = clock.mark
        forward, backward, weight, mailbox = self.forward, self.backward, self.weight, self.mailbox
        try:
            if self.holds_loss:     # checked here, while the first stage computes: the caller checked the inputs
                self.tokens = count_targets(self.batch, self.vocab_size)
                self.scale = 1.0 / self.tokens
            for stage in self.own:      # the last step's tensors freed, the weights read again (Stage.reset)
                stage.reset(**self.reset)
            for a in self.row:
                if mailbox.aborted:
                    raise Aborted
                kind = a.kind
                forward(a) if kind == "F" else backward(a) if kind == "B" else weight(a)
            mailbox.finished()   # this device sends nothing more (a receive that waits for it never ends)
            if self.holds_loss:     # the loss's one sync: here, while others may still compute
                nll = self.stages[-1].nll
                self.nll_sum = float(torch.stack(list(nll.values())).double().sum())
                nll.clear()                     # freed now rather than at the next step's start
        except BaseException:
            # the other devices stop waiting for what this one will never send: one of them may be the caller's
            # thread (CallerThread), which would otherwise wait for ever and never see this error
            mailbox.abort()
            raise
        finally:
            self.copies.finish()
            # the events are made when someone reads the timeline, not on the step's critical path
            device, marks = self.device.name, self.marks
            self.timeline.add_later(lambda: [m.event(device, clock) for m in marks])

    def forward(self, a) -> None:
        s, mb, chunk = a.stage, a.mb, a.chunk
        stage, mark = self.stages[s], self.mark
        # everything but the input first: once a sent input arrives, only the box is left to run
        targets = self.targets(mb, chunk) if s == self.last else None
        # dropout draws at the slice's first batch column and time step (no key: evaluation, no dropout): the
        # micro-batches' sizes so far, equal or not, so that its masks are that slice of one device's
        where = self.key and self.key.at(self.starts[mb], self.chunk_starts[chunk])
        again = self.again[s][mb]
        x = self.inputs(mb, chunk) if s == 0 else self.receive("act", a)     # or what stage s-1 sent
        start = mark()
        out = stage.forward(mb, chunk, x, targets, self.scale, train=self.train, where=where, recompute=again)
        end = mark()
        if s < self.last:           # sent before the bookkeeping: the next stage may be waiting for it
            self.send(out, "act", s + 1, a)
        # the box's memory, as a step has always counted it: what the forward left held
        self.note(new_mark(("F", s, a, start, end, 0, "", stage.saved_bytes(mb, chunk))))

    def backward(self, a) -> None:
        s, mb, chunk = a.stage, a.mb, a.chunk
        stage, mark = self.stages[s], self.mark
        grad = self.receive("grad", a) if s < self.last else None     # the last stage's comes from its loss
        if stage.recomputes(mb, chunk):
            # R: the forward again, now keeping what backward needs (its own box)
            start = mark()
            grown = stage.recompute_forward(mb, chunk)
            self.note(new_mark(("R", s, a, start, mark(), 0, "", grown)))
        held = stage.saved_bytes(mb, chunk)
        start = mark()
        grad_in = stage.backward(mb, chunk, grad, weights=s not in self.split)
        end = mark()
        if s > 0:                   # sent first, as in forward
            self.send(grad_in, "grad", s - 1, a)
        # freed (fused), or kept for W with the output's gradient besides (split)
        self.note(new_mark(("B", s, a, start, end, 0, "", stage.saved_bytes(mb, chunk) - held)))

    def weight(self, a) -> None:
        stage, mark = self.stages[a.stage], self.mark
        held = stage.saved_bytes(a.mb, a.chunk)
        start = mark()
        stage.backward_weight(a.mb, a.chunk)
        self.note(new_mark(("W", a.stage, a, start, mark(), 0, "", -held)))

    def send(self, tensor: torch.Tensor, kind: str, dst: int, a) -> None:
        """Hand `tensor` from a's stage to stage `dst`. The receiver detaches it (Stage.forward); a gradient
        has no graph. Between two stages of one device (the V shape's middle) nothing travels: no link, no mark."""
        if self.stages[dst].device.name == self.device.name:
            self.mailbox.put((kind, dst, a.mb, a.chunk), (tensor, None))     # (what arrives, no event to wait)
            return
        mark = self.mark
        start = mark()
        moved = self.copies.send(tensor, dst)      # on virtual devices: the tensor itself, shared memory
        end = mark()
        peer, nbytes = self.stages[dst].device.name, tensor.numel() * tensor.element_size()
        # on an emulated link (virtual devices only) the send lasts until the tensor lands
        landing = self.mailbox.put((kind, dst, a.mb, a.chunk), moved, (self.device.name, peer), nbytes)
        self.note(new_mark(("send", a.stage, a, start, end if landing is None else landing, nbytes, peer, 0)))

    def receive(self, kind: str, a) -> torch.Tensor:
        moved, ready = self.mailbox.get((kind, a.stage, a.mb, a.chunk), (self.device.name, a))
        return self.copies.receive(moved, ready)


def sender_of(key) -> str:
    """A mailbox key in words: what is awaited and which action sends it."""
    kind, stage, mb, chunk = key
    sender = Action("F", stage - 1, mb, chunk) if kind == "act" else Action("B", stage + 1, mb, chunk)
    what = "the activation" if kind == "act" else "the gradient"
    return f"{what} {sender} sends to stage {stage}"
