"""Keep freed memory for the next step: glibc's malloc settings, made from inside mpedu.

A training step allocates the same large tensors every time (the decoder's logits of
`mxnet8`, T*B*V floats, are 90 MB). glibc's defaults hand large freed blocks back to the
kernel (munmap, or trimming the heap top), so each step faults them in again, page by
page, and the kernel zeroes every page: about 150,000 minor faults per `mxnet8` step,
some 15% of its time on one core. Two settings stop that for the main thread's arena:
no `mmap` for large blocks (M_MMAP_MAX = 0) and no trimming (a huge M_TRIM_THRESHOLD).

They are not enough for a worker thread. glibc gives other threads arenas of their
own, made of heaps of at most 64 MiB: a larger block is mmapped whatever the
settings, and a heap whose memory is all free is unmapped at once. A virtual device's
worker then still faults ~90,000 times a step. One arena for every thread
(M_ARENA_MAX = 1) keeps it all in the main arena; it must be set before the first
worker thread allocates, which is why `keep_freed_memory` runs when mpedu starts a
worker (and once at import). Measured cost and benefit: `bench/vs_intraop.py`.

The price: memory freed by a step stays with the process (its peak, as PyTorch's CUDA
caching allocator keeps GPU memory). `MPEDU_ALLOCATOR=system` leaves malloc alone.
Without glibc (macOS, musl) nothing is changed and `state()` says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 2**31 - 1          # mallopt takes an int: 2 GiB of free heap top is never handed back

_lock = threading.Lock()
_state: str | None = None        # what keep_freed_memory did; None until it ran


def glibc():
    """The C library when it is glibc (it has mallopt and says its version), else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version       # glibc only: musl has no such symbol
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse (once per process); return what was done.

    Idempotent and thread-safe. `MPEDU_ALLOCATOR=system` (read at the first call) skips it.
    """
    global _state
    with _lock:
        if _state is not None:
            return _state
        choice = os.environ.get("MPEDU_ALLOCATOR", "keep").strip().lower()
        if choice not in ("keep", "system"):
            raise ValueError(f"MPEDU_ALLOCATOR={choice!r}: use 'keep' (mpedu's default: freed memory stays with "
                             "the process for the next step) or 'system' (malloc's own settings)")
        libc = glibc() if choice == "keep" else None
        if choice == "system":
            _state = "system malloc (MPEDU_ALLOCATOR=system)"
        elif libc is None:
            _state = "system malloc (not glibc: nothing to set)"
        else:
            done = [libc.mallopt(M_ARENA_MAX, 1), libc.mallopt(M_MMAP_MAX, 0),
                    libc.mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM)]
            _state = ("glibc: freed memory kept (one arena, no mmap, no trim)" if all(done)
                      else "glibc: mallopt refused a setting; system malloc")
        return _state


def state() -> str:
    """What the allocator is doing, in words (after keep_freed_memory has run)."""
    return _state or "not set yet (mpedu sets it when it starts a worker)"
