"""The checked exercises: a hand-written schedule is validated, simulated, run for real and compared with the
textbook's, and every typical mistake is named in words."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from mpedu.core import schedules
from mpedu.course import exercises
from mpedu.lm import nll_sum

check_schedule, check = exercises.check_schedule, exercises.check

NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "zb1": "zero bubble (ZB-H1)"}


def text_of(name: str, m: int = 4, p: int = 2) -> str:
    """A schedule as a learner writes it: one line per device."""
    return "\n".join(" ".join(map(str, row)) for row in schedules.make(name, list(range(p)), m).actions)


def test_the_textbook_orders_pass_and_are_exact():
    for like in ("gpipe", "1f1b", "zb1"):
        result = check_schedule(text_of(like), like=like)
        assert result.ok, str(result)
        assert str(result).startswith(f"matches {NAMES[like]}")
        assert "correct: run for real on 2 virtual devices, the loss and every gradient equal one device's" in \
            str(result)


def test_gpipe_and_1f1b_take_equally_long_at_textbook_costs_but_hold_different_amounts():
    gpipe = str(check_schedule(text_of("gpipe"), like="1f1b"))
    assert "15 time units, bubble 20%; 1F1B: 15, bubble 20%" in gpipe           # (m + p - 1)(F + B) both
    assert "holds 4 micro-batches on device 0 where 1F1B holds 2" in gpipe
    assert "holds 4 micro-batches on device 1 where 1F1B holds 1" in gpipe
    assert gpipe.startswith("valid, but not 1F1B yet")


def test_a_deadlock_is_refused_with_the_waiting_device_and_a_hint():
    result = check_schedule("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0", like="1f1b", micro_batches=2)
    assert not result.ok
    text = str(result)
    assert "deadlock" in text and "device 1 waits at 1F1 for 0F1" in text and "ERROR HERE" in text
    assert "hint: an F needs the stage before's F of the same micro-batch" in text


def test_skipping_a_micro_batch_cannot_pass():
    text = text_of("1f1b").replace(" 0B3", "")
    result = check_schedule(text)
    assert not result.ok and "0B3 is missing" in str(result) and "trains on part of the batch" in str(result)
    fewer = check_schedule(text_of("1f1b", m=2), micro_batches=4)        # a schedule of 2 where 4 are asked for
    assert not fewer.ok and "0F2 is missing" in str(fewer)


def test_wrong_lines_and_wrong_devices_are_named():
    one_line = check_schedule("0F0 0F1 0B0 0B1", micro_batches=2)
    assert not one_line.ok and "1 device lines but the placement uses 2 devices" in str(one_line)
    swapped = check_schedule("1F0 1B0\n0F0 0B0", micro_batches=1)
    assert not swapped.ok and "stage 1 lives on device 1, not device 0" in str(swapped)
    assert "device d's line holds only actions dF" in str(swapped)


def test_an_order_that_waits_more_than_the_textbook_says_where():
    slow = text_of("1f1b").replace("0F0 0F1 0B0", "0F0 0B0 0F1", 1)
    result = check_schedule(slow)
    assert not result.ok
    assert "18 time units where 1F1B takes 15: device 0 idles 6 of 18 (1F1B: 3 of 15)" in str(result)


def test_zero_bubble_needs_its_w_actions():
    result = check_schedule(text_of("1f1b"), like="zb1")
    assert not result.ok and "write W actions too" in str(result)


def test_gradients_that_differ_from_one_device_are_called_wrong(monkeypatch):
    monkeypatch.setattr("mpedu.course.exercises.base.EXACT", 0.0)      # (no valid schedule gives wrong gradients here)
    result = check_schedule(text_of("1f1b"))
    assert not result.ok and "wrong: run for real, the gradients differ from one device's by up to" in str(result)


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="like='pipedream': compare with one of naive, gpipe, 1f1b, zb1"):
        check_schedule("0F0 0B0", like="pipedream")
    with pytest.raises(ValueError, match="devices=7: the exercises run the tiny model, on 1 to 4 devices"):
        check_schedule("0F0 0B0", devices=7)


# ---- the learner's own code -------------------------------------------------------------------------------

def right_forward(y):
    return y.detach().requires_grad_()


def right_backward(x):
    return x.grad


def test_the_right_boundary_passes_and_each_mistake_is_named():
    assert check("boundary", right_forward, right_backward).ok
    assert "the boundary is not detached" in str(check("boundary", lambda y: y, right_backward))
    assert "call .requires_grad_() on what stage 1 receives" in str(check("boundary", lambda y: y.detach(), right_backward))
    zero = check("boundary", right_forward, lambda x: torch.zeros_like(x.grad))
    assert str(zero) == "stage 0's gradients are all zero: did you hand the input's .grad upstream?"
    assert "send_backward returned None" in str(check("boundary", right_forward, lambda x: None))
    assert "wrong: " in str(check("boundary", right_forward, lambda x: x.detach()))     # the activation, not its grad
    assert "send_forward returned tuple" in str(check("boundary", lambda y: (y,), right_backward))


def test_the_loss_check_names_the_scaling():
    assert check("loss", lambda logits, targets, tokens, m: nll_sum(logits, targets) / tokens).ok
    per_micro = check("loss", lambda logits, targets, tokens, m: nll_sum(logits, targets) / (targets != 0).sum())
    assert not per_micro.ok and "the loss is 4" in str(per_micro) and "by the whole batch's tokens" in str(per_micro)
    summed = check("loss", lambda logits, targets, tokens, m: nll_sum(logits, targets))
    assert not summed.ok and "x one device's" in str(summed)


def threaded_play(schedule, run):
    def job(row):
        for action in row:
            run(action)
    threads = [threading.Thread(target=job, args=(row,)) for row in schedule.actions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_the_play_check_accepts_threads_and_names_a_one_thread_deadlock_within_its_timeout():
    right = check("play", threaded_play)
    assert right.ok and str(right).startswith("correct: each device played its row of GPipe and of 1F1B on its own")
    before = threading.active_count()
    started = time.perf_counter()
    one_thread = check("play", lambda schedule, run: [run(a) for row in schedule.actions for a in row])
    assert time.perf_counter() - started < 15                        # the check's 5 s wait, then out
    assert not one_thread.ok and "deadlock: both devices' actions ran on one thread" in str(one_thread)
    assert "waited 5 s for stage 1's input gradient for micro-batch 0" in str(one_thread)
    assert threading.active_count() == before                        # no thread left behind


def test_the_play_check_wants_each_row_in_its_order():
    def sorted_rows(schedule, run):
        threaded_play(SimpleNamespace(actions=[sorted(row, key=lambda a: (a.kind != "F", a.mb)) for row in
                                               schedule.actions]), run)
    wrong = check("play", sorted_rows)
    assert not wrong.ok and "device 0 ran 0F0 0F1 0F2 0F3 0B0" in str(wrong) and "play each row in order" in str(wrong)
    assert str(wrong).startswith("on 1F1B: ")                # GPipe's rows are already in that order: it passed


def test_a_placeholder_is_not_done_yet_and_an_unknown_exercise_is_named():
    def placeholder(schedule, run):
        raise NotImplementedError
    assert str(check("play", placeholder)).startswith("not done yet")
    assert str(check("boundary")).startswith("not yet: give check('boundary', ...)")
    with pytest.raises(ValueError, match="exercise 'stage': choose one of boundary, loss, worker, naive, gpipe, play"):
        check("stage", right_forward)


def test_a_prediction_is_judged_and_a_missing_one_is_asked_for():
    claim, why = "1F1B's bubble is smaller than GPipe's", "both take 15 time units"
    assert exercises.judge(False, False, claim, why).ok
    wrong = exercises.judge(True, False, claim, why)
    assert not wrong.ok and str(wrong) == ("your prediction does not hold: it is false that 1F1B's bubble is smaller "
                                           "than GPipe's\nboth take 15 time units")
    assert str(exercises.judge(None, False, claim, why)).startswith("make your prediction first: is it true that")
    assert "set it to True or False" in str(exercises.judge("yes", False, claim, why))


# ---- the loops on two devices: a worker, the naive step, GPipe's step -----------------------------------------


@pytest.fixture
def short_waits(monkeypatch):
    """A deadlock is named after 1 s instead of 5; and no check leaves a thread behind."""
    monkeypatch.setattr(exercises.base, "WAIT_S", 1.0)
    before = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) <= before, "a check left a thread running"


def worker(inbox):
    while True:
        job = inbox.get()
        if job is None:
            return
        job()


def test_the_worker_check_accepts_a_queue_loop_and_names_three_mistakes(short_waits):
    assert str(check("worker", worker)) == "correct: the worker ran 3 jobs in order on its own thread, and returned at None"

    def never_stops(inbox):
        while True:
            job = inbox.get()
            if job is not None:
                job()

    def calls_none(inbox):
        while True:
            inbox.get()()
    assert "still waits after the None that ends it" in str(check("worker", never_stops))
    assert "ran 1 of 3 jobs before it returned: loop" in str(check("worker", lambda inbox: inbox.get()()))
    assert "called the None that ends it" in str(check("worker", calls_none))


def naive0(stage, batch, to_next, from_next):
    y = stage(batch.inputs)
    to_next.put(y.detach())
    torch.autograd.backward(y, from_next.get())


def naive1(stage, batch, batch_tokens, from_prev, to_prev):
    x = from_prev.get().requires_grad_()
    loss = nll_sum(stage(x), batch.targets) / batch_tokens
    loss.backward()
    to_prev.put(x.grad)
    return loss.item()


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")   # (the mistake itself)
def test_the_naive_check_runs_each_device_on_its_thread_and_names_the_mistakes(short_waits):
    right = check("naive", naive0, naive1)
    assert right.ok and str(right).startswith("correct: the naive step ran each stage's backward on its device")

    def undetached(stage, batch, to_next, from_next):
        y = stage(batch.inputs)
        to_next.put(y)
        torch.autograd.backward(y, from_next.get())

    def no_leaf(stage, batch, batch_tokens, from_prev, to_prev):
        x = from_prev.get()
        loss = nll_sum(stage(x), batch.targets) / batch_tokens
        loss.backward()
        to_prev.put(x.grad)
        return loss.item()

    def waits_first(stage, batch, to_next, from_next):
        y = stage(batch.inputs)
        grad = from_next.get()              # before sending y: each device waits for the other
        to_next.put(y.detach())
        torch.autograd.backward(y, grad)
    assert "backward ran on device 1's thread for both stages: the boundary is not detached" in str(
        check("naive", undetached, naive1))
    assert "device 1 sent None back as a gradient: its input had no .grad" in str(check("naive", naive0, no_leaf))
    started = time.perf_counter()
    dead = str(check("naive", waits_first, naive1))
    assert time.perf_counter() - started < 5
    assert ("device 0 waited for 1B0, which device 1 never sends, and device 1 for 0F0, which device 0 never sends: "
            "deadlock, each waits for the other to move first (1 s; device 0 had sent 0 outputs, device 1 0 gradients)"
            ) in dead


def gpipe0(stage, micro_batches, to_next, from_next, zero=True):
    if zero:
        stage.zero_grad()
    outputs = []
    for mb in micro_batches:
        outputs.append(stage(mb.inputs))
        to_next.put(outputs[-1].detach())
    for y in outputs:
        torch.autograd.backward(y, from_next.get())


def gpipe1(stage, micro_batches, batch_tokens, from_prev, to_prev, own_mean=False):
    stage.zero_grad()
    total = 0.0
    for mb in micro_batches:
        x = from_prev.get().requires_grad_()
        tokens = (mb.targets != 0).sum() if own_mean else batch_tokens
        loss = nll_sum(stage(x), mb.targets) / tokens
        loss.backward()
        to_prev.put(x.grad)
        total += loss.item()
    return total


def test_the_gpipe_check_takes_two_steps_and_names_scaling_zeroing_deadlock_and_a_skipped_micro_batch(short_waits):
    right = check("gpipe", gpipe0, gpipe1)
    assert right.ok and str(right).endswith("two steps in a row")
    own_mean = str(check("gpipe", gpipe0, lambda *a: gpipe1(*a, own_mean=True)))
    assert own_mean.startswith("the loss is 4x one device's") and "by the whole batch's tokens" in own_mean
    unzeroed = str(check("gpipe", lambda *a: gpipe0(*a, zero=False), gpipe1))
    assert unzeroed.startswith("stage 0's gradients after the second step are the first step's plus its own")

    def one_at_a_time(stage, micro_batches, to_next, from_next):    # waits for each gradient before the next F
        stage.zero_grad()
        for mb in micro_batches:
            y = stage(mb.inputs)
            to_next.put(y.detach())
            torch.autograd.backward(y, from_next.get())

    def skips_the_last(stage, micro_batches, to_next, from_next):
        gpipe0(stage, micro_batches[:-1], to_next, from_next)

    def all_forwards_first(stage, micro_batches, batch_tokens, from_prev, to_prev):
        xs = [from_prev.get().requires_grad_() for _ in micro_batches]
        losses = [nll_sum(stage(x), mb.targets) / batch_tokens for x, mb in zip(xs, micro_batches)]
        for x, loss in zip(xs, losses):
            loss.backward()
            to_prev.put(x.grad)
        return sum(loss.item() for loss in losses)
    assert ("device 0 waited for 1B0, which device 1 never sends, and device 1 for 0F1, which device 0 never sends: "
            "deadlock") in str(check("gpipe", one_at_a_time, all_forwards_first))
    skipped = str(check("gpipe", skips_the_last, gpipe1))
    assert "device 1 waited 1 s for 0F3, which device 0 never sends: its function ended after sending 3" in skipped


def test_an_empty_schedule_is_not_done_yet():
    assert str(check_schedule("\n  # my 1F1B\n")).startswith("not done yet: write your schedule between the quotes")


def test_a_loop_placeholder_is_not_done_yet(short_waits):
    def placeholder(*args):
        raise NotImplementedError
    for name, functions in (("worker", [placeholder]), ("naive", [placeholder, naive1]),
                            ("gpipe", [gpipe0, placeholder])):
        assert str(check(name, *functions)).startswith("not done yet"), name
