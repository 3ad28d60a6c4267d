"""Values people give, checked and shown: a number check that names the value and what it takes, and text
cut short for an error message. Used by every layer (the data, the model's costs, the planner, training), so it
imports nothing of mpedu's."""
from __future__ import annotations

import math
import numbers


def check_number(name: str, value, *, integer: bool = False, minimum: float = 0, above: bool = False,
                  maximum: float = math.inf, none_ok: bool = False):
    """A finite number (a whole one if `integer`) at least `minimum` (more than it if `above`), below `maximum`."""
    if value is None and none_ok:
        return None
    kind = numbers.Integral if integer else numbers.Real
    bad = isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) \
        or value < minimum or (above and value == minimum) or value >= maximum
    if bad:
        need = "a whole number" if integer else "a finite number"
        bound = (f"> {minimum:g}" if above else f">= {minimum:g}") + (f" and < {maximum:g}" if maximum < math.inf else "")
        raise ValueError(f"{name}={value!r}: expected {need} {bound}" + (" or None" if none_ok else ""))
    return value


def shorten(text: str, limit: int = 60) -> str:
    """`text` whole if short, else its start and how long it was: an error never echoes a 10,000-character value."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text):,} characters)"
