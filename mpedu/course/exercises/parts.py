"""The parts of a pipeline a learner writes first: the boundary between two stages, one micro-batch's loss,
and the player that runs a Schedule with a thread per device."""
from __future__ import annotations

import threading

import torch

from ...core import ReferencePipeline
from ...lm import nll_sum
from . import base
from .base import PLACEMENTS, Check, Setup, on_thread


def check_boundary(send_forward, send_backward=None) -> Check:
    """send_forward(y): what stage 1 receives of stage 0's output y. send_backward(x): what stage 0 receives of
    stage 1's input x after stage 1's backward (the gradient of y)."""
    setup = Setup()
    inputs, targets = setup.batch.inputs, setup.batch.targets
    y = setup.run(0, inputs)                                            # device 0: (T, B, E)
    x = send_forward(y)
    if not isinstance(x, torch.Tensor) or x.shape != y.shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        return Check(False, [f"send_forward returned {got}: return stage 0's output as stage 1 should receive it, "
                             f"a tensor of shape {tuple(y.shape)}"])

    def stage1():
        loss = nll_sum(setup.run(1, x), targets) / setup.tokens
        loss.backward()
        return loss.item()
    loss = on_thread("device 1", stage1)
    if any(p.grad is not None for p in setup.params(0)):
        return Check(False, ["backward ran through both stages' graphs from device 1's thread: the boundary is not "
                             "detached. Hand over y.detach(), so that stage 1's graph starts at its own input"])
    if x.grad is None:
        return Check(False, ["stage 1's input has no .grad after its backward: call .requires_grad_() on what "
                             "stage 1 receives, so that backward stops there and keeps the gradient for stage 0"])
    if send_backward is None:
        return Check(False, ["send_forward is right. Now write send_backward(x): what stage 0 gets back"])
    grad = send_backward(x)
    if grad is None or not isinstance(grad, torch.Tensor) or grad.shape != y.shape:
        got = tuple(grad.shape) if isinstance(grad, torch.Tensor) else "None" if grad is None else type(grad).__name__
        return Check(False, [f"send_backward returned {got}: hand stage 0 the gradient of its output, a tensor of "
                             f"shape {tuple(y.shape)} (stage 1's input's .grad)"])
    on_thread("device 0", lambda: torch.autograd.backward(y, grad))
    if all(p.grad is None or not p.grad.any() for p in setup.params(0)):
        return Check(False, ["stage 0's gradients are all zero: did you hand the input's .grad upstream?"])
    return setup.verdict(loss, "each device ran backward through its own stage only")


def check_loss(micro_loss) -> Check:
    """micro_loss(logits, targets, batch_tokens, m): the loss to run backward on for one of m micro-batches."""
    m, setup = 4, Setup()
    total = 0.0
    for micro in setup.batch.split(m):
        logits = setup.run(1, setup.run(0, micro.inputs))
        loss = micro_loss(logits, micro.targets, setup.tokens, m)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return Check(False, [f"micro_loss returned {loss!r}: return one number, a 0-d tensor to call backward on"])
        loss.backward()
        total += loss.item()
    return setup.verdict(total, f"{m} micro-batches' backward passes added up in .grad")


def check_play(play) -> Check:
    """play(schedule, run): run(action) for every action of every device's row, each device on its own thread,
    returning when all are done. Played on GPipe, then on 1F1B: a player must not know which it plays."""
    verdicts = []
    for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        verdict = _play_one(play, name, label)
        if not verdict.ok:
            return Check(False, [f"on {label}: {verdict.lines[0]}", *verdict.lines[1:]])
        verdicts.append(verdict)
    return verdicts[-1]


def _play_one(play, schedule: str, label: str) -> Check:
    setup = Setup()
    pipe = ReferencePipeline(setup.model, PLACEMENTS[2], schedule, micro_batches=4)
    pipe.timeout_s = base.WAIT_S
    pipe.begin(setup.batch)
    ran, done, failed = [], [], []          # (thread, action) as each starts; each once finished; what raised

    def run(action):
        ran.append((threading.current_thread().name, action))
        try:
            getattr(pipe, action.kind)(action.stage, action.mb)
        except Exception as e:
            failed.append(e)
            raise
        done.append(action)
    before, error = set(threading.enumerate()), None
    try:
        on_thread("your play", lambda: play(pipe.schedule, run), wait_s=2 * base.WAIT_S + 1)
    except Exception as e:                  # a deadlock surfaces as a receive's TimeoutError
        error = e
    if isinstance(error, NotImplementedError):
        raise error                         # the placeholder: not done yet
    done_at_return = len(done)
    for t in [t for t in threading.enumerate() if t not in before]:
        t.join(base.WAIT_S)                      # threads play started: let them finish (or time out) ...
    pipe.failed.set()                       # ... and stop any that still wait on a hand-off
    threads = {d: {name for name, a in ran if pipe.schedule.stage_devices[a.stage] == d} for d in (0, 1)}
    error = error or next((e for e in failed if not isinstance(e, RuntimeError)), None)   # (not "another failed")
    if error is not None:
        lines = [f"not yet: {type(error).__name__}: {error}"]
        if isinstance(error, TimeoutError) and (threads[0] & threads[1] or len(set().union(*threads.values())) < 2):
            lines.append("deadlock: both devices' actions ran on one thread, one after the other, so a device waited "
                         "for a hand-off that the same thread would only make later. Give each device its own thread")
        return Check(False, lines)
    if threads[0] & threads[1]:
        return Check(False, [f"both devices' actions ran on {sorted(threads[0] & threads[1])}: each device needs a "
                             "thread of its own, or one device's wait blocks the other"])
    expected = sum(len(row) for row in pipe.schedule.actions)
    if done_at_return < expected:
        return Check(False, [f"play returned when {done_at_return} of {expected} actions had run: start every device's "
                             "thread, then join them all before returning, so the step is over when play is"])
    order = {d: [a for name, a in ran if pipe.schedule.stage_devices[a.stage] == d] for d in (0, 1)}
    for d, row in enumerate(pipe.schedule.actions):
        if order[d] != list(row):
            return Check(False, [f"device {d} ran {' '.join(map(str, order[d]))}, not its row "
                                 f"{' '.join(map(str, row))}: play each row in order"])
    what = f"each device played its row of {'GPipe and of ' if label == '1F1B' else ''}{label} on its own thread"
    return setup.verdict(sum(pipe.losses.values()), what)
