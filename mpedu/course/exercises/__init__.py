"""Checked exercises: the learner writes a pipeline's parts and a schedule, and is told precisely what is
right or what is wrong. Each check runs the learner's code for real, on virtual devices, against one device.

    check("boundary", send_forward, send_backward)   # the hand-off between two stages, both ways
    check("loss", micro_loss)                        # one micro-batch's share of the batch's loss
    check("worker", worker)                          # a device's thread, running the jobs of its queue
    check("naive", device0, device1)                 # one batch through two devices and back
    check("gpipe", device0, device1)                 # GPipe's step over m micro-batches, twice in a row
    check("play", play)                              # a thread per device, each playing its row of a Schedule
    check_schedule('''
        0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    ''', like="1f1b", micro_batches=4)               # a schedule by hand, against the textbook's
    judge(prediction, actual, claim, why)            # a prediction the learner made, against what a cell found

A learner's cell starts as `raise NotImplementedError`: its check says "not done yet" and fails nothing.
A check never hangs: a hand-off that waits over `base.WAIT_S` seconds is named, with what the other device
was waiting for, and every thread a check starts has ended when it returns.
"""
from __future__ import annotations

from .answers import ANSWERS, answer
from .base import Check
from .loops import check_gpipe, check_naive, check_worker
from .parts import check_boundary, check_loss, check_play
from .schedule import check_schedule

CHECKS = {"boundary": check_boundary, "loss": check_loss, "worker": check_worker, "naive": check_naive,
          "gpipe": check_gpipe, "play": check_play}


def check(exercise: str, *functions) -> Check:
    """Run the learner's functions for `exercise` (one of CHECKS) and say what they got right."""
    if exercise not in CHECKS:
        raise ValueError(f"exercise {exercise!r}: choose one of {', '.join(CHECKS)}")
    if not functions or not all(callable(f) for f in functions):
        return Check(False, [f"not yet: give check({exercise!r}, ...) the function(s) you wrote"])
    try:
        return CHECKS[exercise](*functions)
    except NotImplementedError:
        return Check(False, ["not done yet: replace the `raise NotImplementedError` with your code, then run the "
                             "check again"])


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


__all__ = ["ANSWERS", "CHECKS", "Check", "answer", "check", "check_schedule", "judge"]
