"""The whole idea of a pipeline on one page: a thread per device, a queue per hand-off, a schedule to play.

This is the pipeline to read; `mpedu.Pipeline` is the one to run (it adds streams, memory caps, recomputation,
dropout positions, links, a timeline). Both play the same `Schedule`s to the same loss and gradients (tested).

The model is cut into stages (runs of consecutive layers on one device); the batch into m micro-batches.
Each device runs its row of the schedule, top to bottom, on its own thread:

    GPipe, 2 devices, m = 3          time ->
        device 0   0F0 0F1 0F2             0B0 0B1 0B2
        device 1       1F0 1F1 1F2 1B0 1B1 1B2

An action waits only for what it needs. `sF i` needs stage s-1's output for micro-batch i; `sB i` needs
stage s+1's gradient of that output. Those arrive through a queue, one per hand-off:

    stage s-1 (device a)                                stage s (device b)
      y = layers(x) ---- y.detach(), moved to b ----> x = received.requires_grad_()
                                                        y' = layers(x)        (b's own graph starts at x)
      backward(y, g) <--- x.grad, moved to a -------- backward(y', g')        (ends at x: fills x.grad)

Detaching at the boundary makes this a pipeline: each device's autograd graph ends at its own input, so
each thread runs backward through its own stage only, when its schedule says. Without it, the last stage's
backward would run through every device's graph at once, on one thread.

Micro-batch i's loss is its summed log-loss over the *whole batch's* tokens, so the m backward passes add up, in
.grad, to one device's gradient. Zero bubble splits a backward: B (the input's gradient), then W (the weights').
"""
import queue
import threading

import torch

from ..lm.model import nll_sum
from .placement import Placement
from .runner import StepResult, check_batch, fit_width
from .schedules import make

TIMEOUT_S = 60.0   # a hand-off that takes longer means a bug: say which device waited for what


class ReferencePipeline:
    """`ReferencePipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=4)`: `schedule`
    is a name or a `Schedule`, checked before any thread starts; `train_step(batch)` accumulates `.grad`."""

    def __init__(self, model, placement, schedule="gpipe", micro_batches: int = 1):
        self.model = model
        self.placement = placement if isinstance(placement, Placement) else Placement.parse(placement, model)
        self.stages = [(d.torch_device, [model.layers[name].to(d.torch_device) for name in names])
                       for d, names in self.placement.stages]          # [(device, [layers])], in model order
        if isinstance(schedule, str):
            schedule = make(schedule, self.placement.stage_devices, micro_batches)
        self.schedule = schedule.validate()               # a deadlock is refused here, not discovered later
        if list(schedule.stage_devices) != self.placement.stage_devices:
            raise ValueError(f"the schedule puts stages on devices {list(schedule.stage_devices)}, the placement "
                             f"on {self.placement.stage_devices}; build the schedule for this placement")
        if schedule.chunks != 1:
            raise ValueError("the reference pipeline cuts micro-batches, not time chunks: use mpedu.Pipeline")
        self.micro_batches, self.timeout_s = schedule.micro_batches, TIMEOUT_S

    def train_step(self, batch) -> StepResult:
        self.begin(batch)
        self.play()
        return StepResult(loss := sum(self.losses.values()), loss * self.tokens, self.tokens)   # mean, sum, tokens

    def begin(self, batch) -> None:
        """Cut the batch into micro-batches and make the queues a step's hand-offs go through."""
        self.tokens, n, m = check_batch(batch, self.model.vocab_size), len(self.stages), self.micro_batches
        self.model.train()
        self.micro = fit_width(batch, m).split(m)                                     # m x (T, B/m)
        # one queue per hand-off, keyed (s, i): the input of stage s, and the gradient of its output
        self.activations = {(s, i): queue.Queue() for s in range(1, n) for i in range(m)}
        self.gradients = {(s, i): queue.Queue() for s in range(n - 1) for i in range(m)}
        self.inputs, self.outputs = {}, {}      # (s, i) -> the stage's input and output, kept from F to B
        self.output_grads, self.losses = {}, {}  # (s, i) -> the output's gradient, kept from B to W; i -> loss
        self.failed = threading.Event()

    def play(self) -> None:
        """Play the schedule: one thread per device runs its row of actions in order."""
        errors: list[BaseException] = []

        def job(d: int) -> None:
            try:
                for action in self.schedule.actions[d]:
                    getattr(self, action.kind)(action.stage, action.mb)      # self.F, self.B or self.W
            except BaseException as e:          # tell the other devices to stop waiting, and report it
                errors.append(e)
                self.failed.set()

        threads = [threading.Thread(target=job, args=(d,), name=f"device {d}")
                   for d in range(self.schedule.num_devices)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    # -- the three actions ------------------------------------------------------------------
    def F(self, s: int, i: int) -> None:
        """Forward micro-batch i through stage s, then hand its output to stage s + 1."""
        device, layers = self.stages[s]
        if s == 0:
            x = self.micro[i].inputs.to(device)                            # (T, b) token ids
        else:
            x = self.receive(self.activations[(s, i)], f"stage {s - 1}'s output for micro-batch {i}")
            x.requires_grad_()                                             # the boundary: a leaf of this graph
        self.inputs[(s, i)] = x
        y = x
        for layer in layers:
            y, _ = layer(y)                                                # (T, b, E or H), last: (T, b, V)
        if s == len(self.stages) - 1:
            targets = self.micro[i].targets.to(device)
            y = nll_sum(y, targets) / self.tokens                          # this micro-batch's share of the loss
            self.losses[i] = y.item()
        else:
            self.activations[(s + 1, i)].put(y.detach().to(self.stages[s + 1][0]))
        self.outputs[(s, i)] = y

    def B(self, s: int, i: int) -> None:
        """Backward micro-batch i through stage s (only the input's gradient if W follows), hand it upstream."""
        grad = None if s == len(self.stages) - 1 else self.receive(   # None: the output is the loss itself
            self.gradients[(s, i)], f"stage {s + 1}'s input gradient for micro-batch {i}")
        x = self.inputs.pop((s, i))
        if s in self.schedule.split_backward:
            self.output_grads[(s, i)] = grad
            if s > 0:                                                 # keep the graph: W walks it again
                torch.autograd.backward(self.outputs[(s, i)], grad, inputs=[x], retain_graph=True)
        else:
            y = self.outputs.pop((s, i))
            if y.requires_grad:                                       # (not when every layer is frozen)
                torch.autograd.backward(y, grad)                      # every gradient of this stage
        if s > 0:
            self.gradients[(s - 1, i)].put(x.grad.to(self.stages[s - 1][0]))

    def W(self, s: int, i: int) -> None:
        """The weight gradients of stage s for micro-batch i (zero-bubble schedules)."""
        params = [p for layer in self.stages[s][1] for p in layer.parameters() if p.requires_grad]
        y, grad = self.outputs.pop((s, i)), self.output_grads.pop((s, i))
        if params:
            torch.autograd.backward(y, grad, inputs=params)

    def receive(self, q: queue.Queue, what: str) -> torch.Tensor:
        """The next message on `q`; stop if another device failed, and never wait forever."""
        for _ in range(int(self.timeout_s / 0.05)):
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if self.failed.is_set():
                    raise RuntimeError("another device failed") from None
        raise TimeoutError(f"{threading.current_thread().name} waited {self.timeout_s:g} s for {what}")
