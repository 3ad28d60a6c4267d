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
from ..runtime.streams import copies_for
from .mailbox import Aborted
from .recompute import recomputes
from .schedules import Action
from .timeline import Mark


class DeviceStep:
    """What device `d` does in one step: `run()` plays `row`, a list of Actions, on the pipeline's stages."""

    def __init__(self, pipe, d: int, row, micro, scale: float, train: bool, mailbox, timeline, t0: float,
                 key, plan):
        self.device = pipe.devices[d]
        self.stages, self.last = pipe.stages, len(pipe.stages) - 1
        self.row, self.micro, self.scale, self.train = row, micro, scale, train
        self.mailbox, self.timeline, self.t0, self.key, self.plan = mailbox, timeline, t0, key, plan
        self.split = pipe.schedule.split_backward       # stages whose backward leaves W for later
        self.recompute, self.micro_batches = pipe.recompute, pipe.micro_batches
        self.copies = copies_for(self.device.torch_device, [s.device.torch_device for s in pipe.stages])
        self.marks: list[Mark] = []

    def run(self) -> None:
        self.clock = Clock(self.device, self.t0)     # made on the worker's thread (a GPU times on its stream)
        play = {"F": self.forward, "B": self.backward, "W": self.weight}
        try:
            for a in self.row:
                if self.mailbox.aborted:
                    raise Aborted
                play[a.kind](a)
            self.mailbox.finished()   # this device sends nothing more (a receive that waits for it never ends)
        finally:
            self.copies.finish()
            # the events are made when someone reads the timeline, not on the step's critical path
            device, clock, marks = self.device.name, self.clock, self.marks
            self.timeline.add_later(lambda: [mark.event(device, clock) for mark in marks])

    def forward(self, a) -> None:
        stage, copies = self.stages[a.stage], self.copies
        # (t, b) slices of the batch (see MicroBatches), or the activation stage s-1 sent
        x = copies.load(self.micro.inputs(a.mb, a.chunk)) if a.stage == 0 else self.receive("act", a)
        targets = copies.load(self.micro.targets(a.mb, a.chunk)) if a.stage == self.last else None
        # dropout draws at the slice's first batch column and time step
        where = self.key and self.key.at(a.mb * self.plan.micro_batch, self.plan.chunk_bounds[a.chunk][0])
        again = self.train and recomputes(self.recompute[a.stage], a.mb, self.micro_batches)
        start = self.clock.mark()
        out = stage.forward(a.mb, a.chunk, x, targets, self.scale, train=self.train, where=where, recompute=again)
        self.marks.append(Mark("F", a.stage, a, start, self.clock.mark(), memory=stage.saved_bytes(a.mb, a.chunk)))
        if a.stage < self.last:
            self.send(out, "act", a.stage + 1, a)

    def backward(self, a) -> None:
        stage, clock = self.stages[a.stage], self.clock
        grad = self.receive("grad", a) if a.stage < self.last else None     # the last stage's comes from its loss
        if stage.recomputes(a.mb, a.chunk):
            # R: the forward again, now keeping what backward needs (its own box)
            start = clock.mark()
            grown = stage.recompute_forward(a.mb, a.chunk)
            self.marks.append(Mark("R", a.stage, a, start, clock.mark(), memory=grown))
        held = stage.saved_bytes(a.mb, a.chunk)
        start = clock.mark()
        grad_in = stage.backward(a.mb, a.chunk, grad, weights=a.stage not in self.split)
        # freed (fused), or kept for W with the output's gradient besides (split)
        self.marks.append(Mark("B", a.stage, a, start, clock.mark(), memory=stage.saved_bytes(a.mb, a.chunk) - held))
        if a.stage > 0:
            self.send(grad_in, "grad", a.stage - 1, a)

    def weight(self, a) -> None:
        stage = self.stages[a.stage]
        held = stage.saved_bytes(a.mb, a.chunk)
        start = self.clock.mark()
        stage.backward_weight(a.mb, a.chunk)
        self.marks.append(Mark("W", a.stage, a, start, self.clock.mark(), memory=-held))

    def send(self, tensor: torch.Tensor, kind: str, dst: int, a) -> None:
        """Hand `tensor` from a's stage to stage `dst` (always on another device). The receiver detaches
        it (Stage.forward); a gradient has no graph."""
        start = self.clock.mark()
        moved = self.copies.send(tensor, dst)      # on virtual devices: the tensor itself, shared memory
        end = self.clock.mark()
        peer, nbytes = self.stages[dst].device.name, tensor.numel() * tensor.element_size()
        # on an emulated link (virtual devices only) the send lasts until the tensor lands
        landing = self.mailbox.put((kind, dst, a.mb, a.chunk), moved, (self.device.name, peer), nbytes)
        self.marks.append(Mark("send", a.stage, a, start, end if landing is None else landing, nbytes, peer))

    def receive(self, kind: str, a) -> torch.Tensor:
        moved, ready = self.mailbox.get((kind, a.stage, a.mb, a.chunk), (self.device.name, a))
        return self.copies.receive(moved, ready)


def sender_of(key) -> str:
    """A mailbox key in words: what is awaited and which action sends it."""
    kind, stage, mb, chunk = key
    sender = Action("F", stage - 1, mb, chunk) if kind == "act" else Action("B", stage + 1, mb, chunk)
    what = "the activation" if kind == "act" else "the gradient"
    return f"{what} {sender} sends to stage {stage}"
