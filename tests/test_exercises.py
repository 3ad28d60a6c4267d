"""The checked exercises: a hand-written schedule is validated, simulated, run for real and compared with the
textbook's, and every typical mistake is named in words."""
import time
from types import SimpleNamespace

import pytest
import torch

from mpedu.core import schedules
from mpedu.course import exercises

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
    monkeypatch.setattr("mpedu.course.exercises.EXACT", 0.0)      # (no valid schedule gives wrong gradients here)
    result = check_schedule(text_of("1f1b"))
    assert not result.ok and "wrong: run for real, the gradients differ from one device's by up to" in str(result)


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="like='pipedream': compare with one of naive, gpipe, 1f1b, zb1"):
        check_schedule("0F0 0B0", like="pipedream")
    with pytest.raises(ValueError, match="devices=7: the exercises run the tiny model, on 1 to 4 devices"):
        check_schedule("0F0 0B0", devices=7)


# ---- the learner's own code -------------------------------------------------------------------------------

import threading  # noqa: E402



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
    from mpedu.lm import nll_sum
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
    assert check("play", threaded_play).ok
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


def test_a_placeholder_is_not_done_yet_and_an_unknown_exercise_is_named():
    def placeholder(schedule, run):
        raise NotImplementedError
    assert str(check("play", placeholder)).startswith("not done yet")
    assert str(check("boundary")).startswith("not yet: give check('boundary', ...)")
    with pytest.raises(ValueError, match="exercise 'stage': choose one of boundary, loss, play"):
        check("stage", right_forward)


def test_a_prediction_is_judged_and_a_missing_one_is_asked_for():
    claim, why = "1F1B's bubble is smaller than GPipe's", "both take 15 time units"
    assert exercises.judge(False, False, claim, why).ok
    wrong = exercises.judge(True, False, claim, why)
    assert not wrong.ok and str(wrong) == ("your prediction does not hold: it is false that 1F1B's bubble is smaller "
                                           "than GPipe's\nboth take 15 time units")
    assert str(exercises.judge(None, False, claim, why)).startswith("make your prediction first: is it true that")
    assert "set it to True or False" in str(exercises.judge("yes", False, claim, why))
