"""Checks for the exercises at the end of notebooks 0, 1, 2 and 4 to 9 (notebook 3's steps have their own,
`exercises.check`). The learner sets a placeholder to an answer (a number, a name, a pair, a choice between
stated options, or a function), and `answer` says "correct: ..." or what is wrong, with a hint towards the
right reasoning:

    answer("00.2", 1.5)                                      # notebook 0, exercise 2: a number
    answer("00.3", "b")                                      # a choice: the options are listed while not done yet
    answer("01.2", 0.74, lengths=lengths, ...)               # a number the check computes from the notebook's data
    answer("02.1", naive_bubble)                             # a function, tried on stage costs against the simulator
    answer("02.2", "vgpu:2", timeline=three.timeline, ...)   # judged against this run's measured timeline
    answer("05.2", (True, 10.0), costs=costs, ...)           # a pair, judged against this notebook's profile

An exercise is "NN.k": notebook NN, exercise k. ANSWERS[exercise] is its `Exercise`: what to set (`ask`), a
hint, and the notebook objects the check needs (`needs`, passed as keywords). Whatever depends on the machine
(a timeline, a memory report, the corpus's lengths) is passed in from the notebook, never written here, so that
an answer is judged against the learner's own run. A placeholder left as None, or a function that still raises
NotImplementedError, gets "not done yet: ..." with the hint, and fails nothing: the committed notebooks keep
their placeholders, and a hidden cell after each runs the check on a worked answer.
"""
from __future__ import annotations

from ..base import Check
from .common import Exercise
from .early import EARLY
from .later import LATER

ANSWERS: dict[str, Exercise] = dict(sorted({**EARLY, **LATER}.items()))     # "NN.k" in notebook order


def answer(exercise: str, value, **given) -> Check:
    """Check the learner's `value` for `exercise` ("NN.k", a key of ANSWERS), given the notebook objects the
    exercise needs (ANSWERS[exercise].needs, as keywords). None: not done yet, with the hint."""
    if exercise not in ANSWERS:
        raise ValueError(f"exercise {exercise!r}: choose one of {', '.join(ANSWERS)}")
    ex = ANSWERS[exercise]
    missing = [name for name in ex.needs if name not in given]
    if missing:
        raise TypeError(f"answer({exercise!r}, ...) needs {', '.join(f'{n}=...' for n in missing)} from the notebook")
    options = [f"  {k}) {text}" for k, text in ex.options.items()]
    if value is None:
        return Check(False, [f"not done yet: {ex.ask}, then run this cell again", *options, f"hint: {ex.hint}"])
    try:
        return ex.judge(value, **{name: given[name] for name in ex.needs})
    except NotImplementedError:
        return Check(False, ["not done yet: replace the `raise NotImplementedError` with your code, then run this "
                             "cell again", f"hint: {ex.hint}"])
