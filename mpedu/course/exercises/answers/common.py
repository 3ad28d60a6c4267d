"""What every answer check shares: the Exercise record, verdict lines, reading a number, a choice between stated options."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..base import Check


@dataclass
class Exercise:
    """One exercise's check: `judge(value, **needs)` gives the verdict for an answer that is not None."""

    ask: str                                        # what to set, as "not done yet" says it
    hint: str
    judge: Callable[..., Check]
    needs: tuple[str, ...] = ()                     # the notebook objects the check is given
    options: dict[str, str] = field(default_factory=dict)     # a choice's options, by letter


def _ok(*lines: str) -> Check:
    return Check(True, ["correct: " + lines[0], *lines[1:]])


def _wrong(*lines: str) -> Check:
    return Check(False, ["not yet: " + lines[0], *lines[1:]])


def _number(value, what: str) -> float | Check:
    """A learner's number as a float, or the Check that says it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return _wrong(f"{what} should be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        return _wrong(f"{what} should be a finite number, got {number}")
    return number


def _near(x: float, target: float, rel: float) -> bool:
    return abs(x - target) <= rel * abs(target)


# ---- choices ---------------------------------------------------------------------------------------------

def _choice(ask: str, hint: str, right: str, options: dict[str, tuple[str, str]]) -> Exercise:
    """An exercise answered by one letter of `options` (letter: (the option's text, why it is right or wrong))."""
    def judge(value):
        letter = str(value).strip().strip("()").lower()
        if letter not in options:
            return _wrong(f"answer {value!r}: choose one of {', '.join(repr(k) for k in options)}")
        text, why = options[letter]
        return _ok(f"{letter}) {text}", why) if letter == right else _wrong(f"{letter}) {text}", why)
    return Exercise(ask, hint, judge, options={k: text for k, (text, _) in options.items()})


def _device_name(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"vgpu:{value}"
    text = str(value).strip()
    return text if ":" in text else text.replace("vgpu", "vgpu:").replace("cuda", "cuda:")


def _layers_by_device(placement) -> dict[str, list[str]]:
    held: dict[str, list[str]] = {}
    for device, names in placement.stages:
        held.setdefault(str(device), []).extend(names)
    return held


def _pair(value, name: str, example: str) -> tuple | Check:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return _wrong(f"{name} = {value!r}: give a pair, {example}")
    return tuple(value)


def _numbers(value, name: str, example: str, whats: tuple[str, str]) -> tuple[float, float] | Check:
    """A learner's pair of numbers as floats, or the Check that says what is wrong with it."""
    pair = _pair(value, name, example)
    if isinstance(pair, Check):
        return pair
    numbers = tuple(_number(x, what) for x, what in zip(pair, whats))
    return next((x for x in numbers if isinstance(x, Check)), numbers)
