"""Checked exercises: the learner writes a pipeline's parts and a schedule, and is told precisely what is
right or what is wrong. Each check runs the learner's code for real, on virtual devices, against one device.

    check("boundary", send_forward, send_backward)   # the hand-off between two stages, both ways
    check("loss", micro_loss)                        # one micro-batch's share of the batch's loss
    check("play", play)                              # a thread per device, each playing its row of a Schedule
    check_schedule('''
        0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    ''', like="1f1b", micro_batches=4)

reads the text (one line per device, the form mpedu prints), validates it (the grid, with a deadlock or a
bad action marked), simulates it at textbook costs (F = 1, B = 2; B = W = 1 where the backward is split),
runs it for real on virtual devices against one device, and compares it with the textbook schedule: its
length, its bubble, and the micro-batches each device holds at once.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch

from ..core import Pipeline, ReferencePipeline, SingleDevice, check_batch
from ..core.schedules import ScheduleError, make, read
from ..lm import LSTMLM, BucketIterator, load_corpus, nll_sum
from ..predict.simulator import peak_in_flight, simulate
from ..runtime import Link

TEXTBOOK = {"naive": "naive", "gpipe": "GPipe", "1f1b": "1F1B", "zb1": "zero bubble (ZB-H1)"}
PLACEMENTS = {1: "embed,lstm0,lstm1,decode:vgpu0", 2: "embed,lstm0:vgpu0 | lstm1,decode:vgpu1",
              3: "embed,lstm0:vgpu0 | lstm1:vgpu1 | decode:vgpu2",
              4: "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu2 | decode:vgpu3"}
EXACT = 1e-5           # gradients further from one device's than this are wrong, not rounding
WAIT_S = 5.0           # a check's hand-off that takes longer is a deadlock (the engine's steps take milliseconds)


@dataclass
class Check:
    """A check's verdict: `ok`, and the lines that say why (shown as the cell's output)."""

    ok: bool
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__


def check_schedule(text: str, like: str = "1f1b", micro_batches: int = 4, devices: int = 2) -> Check:
    """Check a hand-written schedule for `devices` devices (stage d on device d) and `micro_batches`
    micro-batches against the textbook schedule `like` ("gpipe", "1f1b", "zb1" or "naive")."""
    if like not in TEXTBOOK:
        raise ValueError(f"like={like!r}: compare with one of {', '.join(TEXTBOOK)}")
    if devices not in PLACEMENTS:
        raise ValueError(f"devices={devices}: the exercises run the tiny model, on 1 to {max(PLACEMENTS)} devices")
    stage_devices, name = list(range(devices)), TEXTBOOK[like]
    try:
        yours = read(text, stage_devices, micro_batches, name="yours")
    except (ScheduleError, ValueError) as e:
        return Check(False, ["not yet: " + str(e), _hint(str(e), f"{like!r}, {stage_devices}, {micro_batches}")])
    textbook = make(like, stage_devices, micro_batches)
    lines = [f"valid: every device's actions can run in order, every micro-batch gets its "
             f"{'F, B and W' if yours.split_backward else 'F and B'} ({_counts(yours)})", yours.grid()]
    ok = True
    if textbook.split_backward and not yours.split_backward:
        lines.append(f"but {name} splits each backward into B (the input's gradient, which the stage before waits "
                     "for) and W (the weights' gradient, which can wait): write W actions too")
        ok = False
    unit, free = [1.0] * devices, Link(latency_s=0.0)        # textbook costs, and hand-offs that take no time
    mine, theirs = simulate(yours, unit, link=free), simulate(textbook, unit, link=free)
    held, held_textbook = peak_in_flight(mine), peak_in_flight(theirs)
    lines.append(f"at textbook costs ({'F = B = W = 1' if yours.split_backward else 'F = 1, B = 2'}): "
                 f"{mine.makespan:g} time units, bubble {mine.bubble_fraction:.0%}; "
                 f"{name}: {theirs.makespan:g}, bubble {theirs.bubble_fraction:.0%}")
    lines.append("micro-batches held at once, per device: yours " + _per_device(held)
                 + f"; {name}'s " + _per_device(held_textbook))
    for d, (mine_d, theirs_d) in enumerate(zip(held.values(), held_textbook.values())):
        if mine_d > theirs_d:
            ok = False
            lines.append(f"unlike {name}: holds {mine_d:g} micro-batches on device {d} where {name} holds "
                         f"{theirs_d:g} (start backwards sooner: a micro-batch is held until its "
                         f"{'W' if yours.split_backward else 'B'})")
    if mine.makespan > theirs.makespan + 1e-9:
        ok = False
        idle = ", ".join(f"device {d} idles {mine.idle(n):g} of {mine.makespan:g} ({name}: {theirs.idle(n):g} of "
                         f"{theirs.makespan:g})" for d, n in enumerate(mine.devices))
        lines.append(f"unlike {name}: {mine.makespan:g} time units where {name} takes {theirs.makespan:g}: {idle}")
    lines.append(_run_for_real(yours, devices))
    ok = ok and lines[-1].startswith("correct")
    lines.insert(0, f"matches {name}" if ok else f"valid, but not {name} yet")
    return Check(ok, lines)


def _counts(schedule) -> str:
    kinds = sorted({a.kind for row in schedule.actions for a in row}, key="FBW".index)
    per = [f"{sum(a.kind == k for a in schedule.actions[0])} {k}" for k in kinds]
    return f"device 0 runs {', '.join(per)}" + (" and so does every device" if all(
        sorted(a.kind for a in row) == sorted(a.kind for a in schedule.actions[0]) for row in schedule.actions) else "")


def _per_device(held: dict) -> str:
    return " / ".join(f"{v:g}" for v in held.values())


def _hint(message: str, textbook: str) -> str:
    if "deadlock" in message:
        return ("hint: an F needs the stage before's F of the same micro-batch; a B needs its own F and the stage "
                "after's B. Some device waits for an action that can only come after its wait.")
    if "is missing" in message:
        return ("hint: every stage runs F and B (and W, in zero bubble) for every micro-batch; a schedule that skips "
                "one trains on part of the batch, so it is not a schedule of this step.")
    if "device lines" in message:
        return "hint: write one line per device, its actions in the order it runs them, e.g. '0F0 0F1 0B0 0B1'."
    if "lives on device" in message:
        return "hint: stage d lives on device d here, so device d's line holds only actions dF.., dB.. (and dW..)."
    return f"hint: compare with mpedu.core.schedules.make({textbook}).grid()"


def _run_for_real(schedule, devices: int) -> str:
    """Train one step with the schedule on virtual devices and with one device; compare loss and gradients."""
    setup = _Setup(width=2 * schedule.micro_batches)
    pipe = Pipeline(setup.model, PLACEMENTS[devices], schedule)
    try:
        loss = pipe.train_step(setup.batch).loss
    finally:
        pipe.close()
    worst = max((p.grad - setup.grads[name]).abs().max().item() for name, p in setup.model.named_parameters())
    if worst <= EXACT and abs(loss - setup.loss) <= EXACT * max(1.0, abs(setup.loss)):
        return (f"correct: run for real on {devices} virtual devices, the loss and every gradient equal one "
                f"device's (max difference {worst:.0e})")
    return f"wrong: run for real, the gradients differ from one device's by up to {worst:.1e}"


# -- the learner's own code -------------------------------------------------------------------------------------

def check(exercise: str, *functions) -> Check:
    """Run the learner's functions for `exercise` ("boundary", "loss" or "play") and say what they got right."""
    checks = {"boundary": _check_boundary, "loss": _check_loss, "play": _check_play}
    if exercise not in checks:
        raise ValueError(f"exercise {exercise!r}: choose one of {', '.join(checks)}")
    if not functions or not all(callable(f) for f in functions):
        return Check(False, [f"not yet: give check({exercise!r}, ...) the function(s) you wrote"])
    try:
        return checks[exercise](*functions)
    except NotImplementedError:
        return Check(False, ["not done yet: replace the `raise NotImplementedError` with your code, then run the "
                             "check again"])


class _Setup:
    """The tiny model cut in two (embed, lstm0 | lstm1, decode), a batch of `width` sentences, and one device's
    loss and gradients."""

    def __init__(self, width: int = 8):
        corpus = load_corpus()
        self.batch = next(iter(BucketIterator(corpus.train, width, buckets=[12], seed=0)))
        torch.manual_seed(0)
        self.model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab), dropout=0.0)
        single = copy.deepcopy(self.model)
        self.loss = SingleDevice(single).train_step(self.batch).loss
        self.grads = {n: p.grad.clone() for n, p in single.named_parameters()}
        self.tokens = check_batch(self.batch, self.model.vocab_size)
        self.stages = [[self.model.layers[n] for n in names] for names in (("embed", "lstm0"), ("lstm1", "decode"))]

    def run(self, s: int, x):
        for layer in self.stages[s]:
            x, _ = layer(x)
        return x

    def params(self, s: int) -> list:
        return [p for layer in self.stages[s] for p in layer.parameters()]

    def verdict(self, loss: float, what: str) -> Check:
        """Correct if the loss and every gradient equal one device's; else the first stage that differs."""
        worst = {}
        for name, p in self.model.named_parameters():
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            worst[name] = (got - self.grads[name]).abs().max().item()
        if abs(loss - self.loss) > EXACT * abs(self.loss):
            ratio = loss / self.loss
            return Check(False, [f"the loss is {ratio:.3g}x one device's ({loss:.4f} vs {self.loss:.4f}): divide each "
                                 f"micro-batch's summed loss by the whole batch's tokens ({self.tokens}), so that "
                                 "the micro-batches' losses add up to the batch's mean"])
        bad = [n for n, w in worst.items() if w > EXACT]
        if bad:
            return Check(False, [f"wrong: {what}; the gradients of {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
                                 f" differ from one device's by up to {max(worst[n] for n in bad):.2e}"])
        return Check(True, [f"correct: {what}; the loss and every gradient equal one device's (max difference "
                            f"{max(worst.values()):.0e})"])


def _on_thread(name: str, fn, wait_s: float = WAIT_S):
    """fn() on a thread called `name` (a device's), with its exception handed back; never waits forever."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        raise TimeoutError(f"{name} ran for over {wait_s:g} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _check_boundary(send_forward, send_backward=None) -> Check:
    """send_forward(y): what stage 1 receives of stage 0's output y. send_backward(x): what stage 0 receives of
    stage 1's input x after stage 1's backward (the gradient of y)."""
    setup = _Setup()
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
    loss = _on_thread("device 1", stage1)
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
    _on_thread("device 0", lambda: torch.autograd.backward(y, grad))
    if all(p.grad is None or not p.grad.any() for p in setup.params(0)):
        return Check(False, ["stage 0's gradients are all zero: did you hand the input's .grad upstream?"])
    return setup.verdict(loss, "each device ran backward through its own stage only")


def _check_loss(micro_loss) -> Check:
    """micro_loss(logits, targets, batch_tokens, m): the loss to run backward on for one of m micro-batches."""
    m, setup = 4, _Setup()
    total = 0.0
    for micro in setup.batch.split(m):
        logits = setup.run(1, setup.run(0, micro.inputs))
        loss = micro_loss(logits, micro.targets, setup.tokens, m)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return Check(False, [f"micro_loss returned {loss!r}: return one number, a 0-d tensor to call backward on"])
        loss.backward()
        total += loss.item()
    return setup.verdict(total, f"{m} micro-batches' backward passes added up in .grad")


def _check_play(play) -> Check:
    """play(schedule, run): run(action) for every action of every device's row, each device on its own thread,
    returning when all are done."""
    setup = _Setup()
    pipe = ReferencePipeline(setup.model, PLACEMENTS[2], "1f1b", micro_batches=4)
    pipe.timeout_s = WAIT_S
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
        _on_thread("your play", lambda: play(pipe.schedule, run), wait_s=2 * WAIT_S + 1)
    except Exception as e:                  # a deadlock surfaces as a receive's TimeoutError
        error = e
    if isinstance(error, NotImplementedError):
        raise error                         # the placeholder: not done yet
    done_at_return = len(done)
    for t in [t for t in threading.enumerate() if t not in before]:
        t.join(WAIT_S)                      # threads play started: let them finish (or time out) ...
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
    return setup.verdict(sum(pipe.losses.values()), "each device played its row of 1F1B on its own thread")


def judge(prediction, actual: bool, claim: str, why: str) -> Check:
    """A learner's prediction (True, False, or None: not made yet) against what the cell measured or simulated:
    whether `claim` is true (`actual`), and `why`."""
    if prediction is None:
        return Check(False, [f"make your prediction first: is it true that {claim}? Set it to True or False above, "
                             "then run this cell again", f"(what the cell found: {why})"])
    if not isinstance(prediction, bool):
        return Check(False, [f"prediction={prediction!r}: set it to True or False"])
    verdict = "your prediction holds" if prediction == actual else "your prediction does not hold"
    return Check(prediction == actual, [f"{verdict}: it is {'true' if actual else 'false'} that {claim}", why])
