"""Values people give, checked and shown: a number check that names the value and what it takes, sizes
parsed ("2MB") and written ("1.59 MB") one way, and text cut short for an error message. Used by every
layer (the data, the model's costs, the planner, training), so it imports nothing of mpedu's."""
from __future__ import annotations

import contextlib
import math
import numbers
import re


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


_UNITS = {"": 1, "b": 1, "byte": 1, "bytes": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_size(value) -> int:
    """Bytes from a size: a number of bytes, or text such as "2MB", "512 kB", "1.5GiB" (kB = 1000, KiB = 1024).

    Used for memory caps, e.g. `Pipeline(..., memory_cap={"vgpu:0": "2MB"})`.
    """
    number = None
    with contextlib.suppress(OverflowError):     # 10**400 bytes is not a size either
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and len(value) < 64:
            match = _SIZE_RE.match(value.lower())
            if match:
                unit = _UNITS.get(match.group(2)) or _UNITS.get(match.group(2) + "b")   # "2M" means "2MB"
                number = float(match.group(1)) * unit if unit else None
    if number is None or not math.isfinite(number) or number < 1:
        try:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        except ValueError:                        # an int too long for repr()
            shown = "(a number with more than 4300 digits)"
        raise ValueError(f"memory size {shown} is not a size of at least one byte; write a number of bytes "
                         f"or a number with a unit, e.g. '2MB', '512kB', '1.5GiB'")
    return int(number)


SIZE_UNITS = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3, "bytes": 1.0}   # what format_size writes, largest first


def format_size(nbytes: float, up: bool = False) -> str:
    """A size for people: 1.59 MB, 950 kB, 12 bytes (powers of 1000, like parse_size's MB). up=True rounds up
    (a minimum to type back: "at least 556 kB" for 555,072 bytes, which "555 kB" would miss)."""
    units = list(SIZE_UNITS.items())
    for k, (unit, scale) in enumerate(units):
        if nbytes >= scale or unit == "bytes":
            value = nbytes / scale
            if up and value > 0:                     # to 3 significant digits (bytes: whole ones), upwards
                step = 1.0 if unit == "bytes" else 10.0 ** (math.floor(math.log10(value)) - 2)
                value = math.ceil(round(value / step, 9)) * step
            if float(f"{value:.3g}") >= 1000 and k > 0:    # 999,999 bytes: "1 MB", not "1e+03 kB"
                unit, value = units[k - 1][0], value / 1000
            if unit == "bytes":
                return f"{value:.0f} byte" if round(value) == 1 else f"{value:.0f} bytes"
            return f"{value:.3g} {unit}"
