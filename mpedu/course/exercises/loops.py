"""The loops a learner writes on two devices: a worker that runs its device's jobs, the naive step, and GPipe's
step over m micro-batches. Each device's function runs on that device's own thread; they talk through two
channels, one each way:

    device 0 (thread "device 0")                        device 1 (thread "device 1")
      y = stage(x)              to_next: 0F0, 0F1 ...     x = from_prev.get().requires_grad_()
      to_next.put(y.detach())  ------------------------>  loss = nll_sum(stage(x), targets) / batch_tokens
                                                          loss.backward()
      backward(y, from_next.get())  <------------------  to_prev.put(x.grad)
                                 from_next: 1B0, 1B1 ...

Each side sends its micro-batches in order, so the k-th thing on a channel is micro-batch k's: a wait that
lasts too long is named ("device 1 waited 5 s for 0F2"), with what the other device was doing then.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from . import base
from .base import Check, Setup


class Waited(TimeoutError):
    """A device waited longer than a check allows for something the other device never sent."""


class _Stopped(Exception):
    """The check is over (another device failed or waited too long): stop waiting."""


class Channel:
    """A queue from one device to the other that never waits forever (`put`, `get` as queue.Queue's)."""

    def __init__(self, sender: int, kind: str, waits: dict, stop: threading.Event):
        self.sender, self.receiver, self.kind = sender, 1 - sender, kind      # kind: "F" outputs, "B" gradients
        self.queue, self.sent, self.taken, self.nones = queue.Queue(), 0, 0, 0
        self.waits, self.stop = waits, stop            # shared: device -> what it waits for now; the end of it all

    def put(self, item, *args, **kwargs) -> None:
        self.queue.put(item)
        self.sent += 1
        self.nones += item is None

    def get(self, *args, **kwargs):
        what = f"{self.sender}{self.kind}{self.taken}"
        self.waits[self.receiver] = what
        deadline = time.monotonic() + base.WAIT_S
        while True:
            try:
                item = self.queue.get(timeout=0.02)
                break
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped() from None
                if time.monotonic() > deadline:
                    raise Waited(self._never_sent(what)) from None
        del self.waits[self.receiver]
        self.taken += 1
        return item

    def _never_sent(self, what: str) -> str:
        """The words for a wait that timed out, with what the sender was doing at that moment. A deadlock is told
        device 0 first, whichever wait ran out first (that is up to the threads)."""
        self.stop.set()
        other = self.waits.get(self.sender)
        if other is None:
            return (f"device {self.receiver} waited {base.WAIT_S:g} s for {what}, which device {self.sender} never "
                    f"sends: its function ended after sending {self.sent}. Send every micro-batch's "
                    f"{'output' if self.kind == 'F' else 'gradient'}")
        outputs, gradients = (self, self.back) if self.kind == "F" else (self.back, self)
        waits = {self.receiver: what, self.sender: other}
        return (f"device 0 waited for {waits[0]}, which device 1 never sends, and device 1 for {waits[1]}, which "
                f"device 0 never sends: deadlock, each waits for the other to move first ({base.WAIT_S:g} s; device 0 "
                f"had sent {outputs.sent} outputs, device 1 {gradients.sent} gradients). Send what the other "
                "device needs before you wait for its answer")


def run_devices(jobs: dict) -> tuple[dict, dict, list[str]]:
    """Run each device's job on a thread of its own ("device 0", "device 1") and wait for both, never for ever.
    Returns (results, errors, still running). A job that waits on a Channel is always stopped by the end."""
    results, errors = {}, {}

    def body(d):
        try:
            results[d] = jobs[d]()
        except _Stopped:
            pass
        except BaseException as e:
            errors[d] = e
    threads = {d: threading.Thread(target=body, args=(d,), name=f"device {d}", daemon=True) for d in jobs}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + 2 * base.WAIT_S + 1
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    return results, errors, [name for name, t in ((f"device {d}", t) for d, t in threads.items()) if t.is_alive()]


def _channels() -> tuple[Channel, Channel]:
    """to_next (device 0's outputs) and from_next (device 1's gradients), each knowing the other."""
    waits, stop = {}, threading.Event()
    to_next, from_next = Channel(0, "F", waits, stop), Channel(1, "B", waits, stop)
    to_next.back, from_next.back = from_next, to_next
    return to_next, from_next


def _failure(errors: dict, running: list[str], gradients: Channel) -> Check | None:
    """The first thing that went wrong, in words: a wait, an exception, a function that never ends."""
    for e in errors.values():
        if isinstance(e, NotImplementedError):
            raise e                   # a placeholder: the learner has not written it yet
    if gradients.nones:
        return Check(False, ["device 1 sent None back as a gradient: its input had no .grad. Call .requires_grad_() "
                             "on what device 1 receives, so that its backward stops there and keeps the gradient"])
    if running:
        return Check(False, [f"{running[0]}'s function still runs after {2 * base.WAIT_S + 1:g} s without waiting "
                             "for anything: look for a loop that never ends"])
    waited = [e for e in errors.values() if isinstance(e, Waited)]
    if waited:
        return Check(False, [f"not yet: {waited[0]}"])
    for d, e in sorted(errors.items()):
        return Check(False, [f"not yet: device {d}'s function raised {type(e).__name__}: {e}"])
    return None


def _crossed(setup: Setup) -> Check | None:
    """Stage 0's gradients computed on device 1's thread: the boundary let backward run through both graphs."""
    if "device 1" in setup.stages[0].backward_threads:
        return Check(False, ["backward ran on device 1's thread for both stages: the boundary is not detached. "
                             "Send y.detach() (and call .requires_grad_() on what device 1 receives), so that each "
                             "device's backward runs through its own stage only"])
    return None


def check_worker(worker) -> Check:
    """worker(inbox): take jobs (functions) from the queue `inbox` and call each, in order, on this thread,
    until the job is None; then return."""
    inbox, ran, stop = queue.Queue(), [], threading.Event()

    class Inbox:                      # inbox.get() as a queue's, but it ends the thread once the check is over
        def get(self, *args, **kwargs):
            while not stop.is_set():
                try:
                    return inbox.get(timeout=0.02)
                except queue.Empty:
                    pass
            raise _Stopped()

    for k in range(3):
        inbox.put(lambda k=k: ran.append((k, threading.current_thread().name)))
    inbox.put(None)
    errors: dict = {}
    thread = threading.Thread(target=lambda: _catch(errors, worker, Inbox()), name="device 0", daemon=True)
    thread.start()
    thread.join(1.0)                  # three tiny jobs: a second is plenty
    alive = thread.is_alive()
    stop.set()                        # a worker that still waits stops now: no thread is left behind
    thread.join(1.0)
    done = [k for k, _ in ran]
    if isinstance(errors.get(0), NotImplementedError):
        raise errors[0]
    if isinstance(errors.get(0), TypeError) and "NoneType" in str(errors[0]):
        return Check(False, ["your worker called the None that ends it: None means stop; return when you get it"])
    if 0 in errors:
        return Check(False, [f"not yet: your worker raised {type(errors[0]).__name__}: {errors[0]}"])
    if alive:
        return Check(False, [f"your worker ran {len(done)} of 3 jobs and still waits after the None that ends it: "
                             "return when inbox.get() gives None, or the device's thread never ends"])
    if done != [0, 1, 2]:
        return Check(False, [f"your worker ran {len(done)} of 3 jobs before it returned: loop, calling each job you "
                             "take, until the job is None"])
    threads = {name for _, name in ran}
    if threads != {"device 0"}:
        return Check(False, [f"the jobs ran on {sorted(threads)}, not on the worker's own thread: call each job "
                             "where the worker runs"])
    return Check(True, ["correct: the worker ran 3 jobs in order on its own thread, and returned at None"])


def _catch(errors: dict, worker, inbox) -> None:
    try:
        worker(inbox)
    except _Stopped:
        pass
    except BaseException as e:
        errors[0] = e


def check_naive(device0, device1) -> Check:
    """device0(stage, batch, to_next, from_next) and device1(stage, batch, batch_tokens, from_prev, to_prev),
    which returns the loss: one batch, forward through both devices, backward back."""
    setup = Setup()
    to_next, from_next = _channels()
    results, errors, running = run_devices({
        0: lambda: device0(setup.stages[0], setup.batch, to_next, from_next),
        1: lambda: device1(setup.stages[1], setup.batch, setup.tokens, to_next, from_next)})
    return _judged(setup, results, errors, running, from_next, "the naive step ran each stage's backward on its device")


def check_gpipe(device0, device1, m: int = 4) -> Check:
    """device0(stage, micro_batches, to_next, from_next) and device1(stage, micro_batches, batch_tokens,
    from_prev, to_prev), which returns the batch's loss: GPipe's step, run for two steps in a row."""
    setup = Setup(width=2 * m, steps=2)
    for step, batch in enumerate(setup.batches):
        micro, tokens = batch.split(m), setup.tokens_of(step)
        to_next, from_next = _channels()
        results, errors, running = run_devices({
            0: lambda: device0(setup.stages[0], micro, to_next, from_next),
            1: lambda: device1(setup.stages[1], micro, tokens, to_next, from_next)})
        kept = [s for s in (0, 1) if step == 1 and not errors and not running and _kept_the_first_step(setup, s)]
        if kept:
            return Check(False, [f"stage {kept[0]}'s gradients after the second step are the first step's plus its "
                                 "own: .grad keeps adding up. Zero each stage's gradients when its step begins "
                                 "(stage.zero_grad() at the top of each device's function)"])
        verdict = _judged(setup, results, errors, running, from_next, f"GPipe ran {m} micro-batches on each device",
                          step)
        if not verdict.ok:
            return verdict
    verdict.lines[0] += ", two steps in a row"
    return verdict


def _kept_the_first_step(setup: Setup, s: int) -> bool:
    """Stage s's .grad holds both steps' gradients: nobody zeroed it between them."""
    (_, first), (_, second) = setup.answers
    names = {id(p): n for n, p in setup.model.named_parameters()}
    return all(p.grad is not None and (p.grad - first[names[id(p)]] - second[names[id(p)]]).abs().max() <= base.EXACT
               for p in setup.params(s))


def _judged(setup: Setup, results: dict, errors: dict, running: list[str], gradients: Channel, what: str,
            step: int = 0) -> Check:
    wrong = _crossed(setup) or _failure(errors, running, gradients)
    if wrong:
        return wrong
    loss = results.get(1)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        loss = loss.item()
    if not isinstance(loss, (int, float)):
        return Check(False, [f"device 1's function returned {loss!r}: return the loss, one number"])
    if all(p.grad is None or not p.grad.any() for p in setup.params(0)):
        return Check(False, ["stage 0's gradients are all zero: did device 0 run backward from the gradient that "
                             "device 1 sent back (its input's .grad)?"])
    return setup.verdict(float(loss), what, step)
