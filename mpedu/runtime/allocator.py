"""Keep freed memory for the next step: glibc's malloc settings, made from inside mpedu at import.

A training step allocates the same large tensors every time (the decoder's logits of
`mxnet8`, T*B*V floats, are 90 MB). glibc's defaults hand large freed blocks back to the
kernel (munmap, or trimming a heap), so each step faults them in again, page by page, and
the kernel zeroes every page: about 150,000 minor faults per `mxnet8` step, some 15% of
its time on one core. mpedu's default, `keep`, stops that: no `mmap` for large blocks
(M_MMAP_MAX 0), no trimming (M_TRIM_THRESHOLD -1, "never"), and a 64 MiB top pad
(M_TOP_PAD), without which glibc still unmaps a worker thread's extra heap as soon as
all of it is free.

One gap remains. glibc gives each thread an arena of its own, made of heaps of at most
64 MiB, so in a worker thread a block larger than that is mapped afresh every time (a
one-device run of `mxnet8` on a worker, whose whole-batch logits are 90 MB: ~90,000 faults
a step). A lone virtual device therefore runs on the calling thread (devices.CallerThread),
whose memory follows these settings; a pipeline's workers hold a micro-batch each, rarely
that much. `one-arena` closes the gap for every thread by putting all of them in the main arena
(M_ARENA_MAX 1, which only holds for threads that have not allocated yet: mpedu sets it at
import, each worker checks where its memory comes from, `state()` names any that landed
elsewhere). Its price, measured: two workers take the one arena's lock for every tensor,
which costs about 5% of two virtual devices' work on small tensors (`mpedu.predict.cores.measure_cores`,
`bench/speedup.py`, `bench/overhead.py`; `bench/vs_intraop.py` times both choices). So
`keep` is the default, and `one-arena` is for workers that hold tensors over 64 MiB.

Either way memory freed by a step stays with the process (its peak, as PyTorch's CUDA
caching allocator keeps GPU memory). `MPEDU_ALLOCATOR=keep|one-arena|system` chooses;
`system` leaves malloc alone. Without glibc (macOS, musl) nothing is changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
import warnings

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
NEVER = -1                      # M_TRIM_THRESHOLD -1: glibc stores SIZE_MAX, "disables trimming completely"
KEEP = ((M_MMAP_MAX, 0, "no mmap"), (M_TRIM_THRESHOLD, NEVER, "no trim"), (M_TOP_PAD, 64 << 20, "64 MiB pad"))
ONE_ARENA = ((M_ARENA_MAX, 1, "one arena"),) + KEEP
CHOICES = {"keep": KEEP, "one-arena": ONE_ARENA, "system": ()}

_lock = threading.Lock()
_state: str | None = None       # what keep_freed_memory did; None until it ran
_elsewhere: set[str] = set()    # one-arena: workers whose malloc serves them from another arena


def glibc():
    """The C library when it is glibc (it has mallopt and says its version), else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version        # glibc only: musl has no such symbol
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def in_main_arena() -> bool | None:
    """Does malloc serve the calling thread from the main arena, the process's [heap] (None: cannot tell)?"""
    libc = glibc()
    if libc is None:
        return None
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    block = libc.malloc(64)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    return lo <= block < hi
        return False             # no [heap] at all: the main arena is not in use
    except OSError:
        return None
    finally:
        libc.free(block)


def check_worker_arena(name: str) -> None:
    """Called in a new worker thread: under one-arena, note it when its memory comes from another arena."""
    if "one arena" in keep_freed_memory() and in_main_arena() is False:
        with _lock:
            _elsewhere.add(name)


def keep_freed_memory() -> str:
    """Set glibc's malloc as MPEDU_ALLOCATOR says (once per process); return what was done, in words.

    Idempotent and thread-safe; the variable is read at the first call (mpedu's import).
    """
    global _state
    with _lock:
        if _state is None:
            _state = _apply(os.environ.get("MPEDU_ALLOCATOR", "keep").strip().lower())
        return _state


def _apply(choice: str) -> str:
    if choice not in CHOICES:
        warnings.warn(f"MPEDU_ALLOCATOR={choice!r} is not a choice: use 'keep' (mpedu's default: freed memory "
                      "stays with the process for the next step), 'one-arena' (also one malloc arena for every "
                      "thread) or 'system' (malloc as it is); leaving malloc as it is", stacklevel=3)
        return f"system malloc (MPEDU_ALLOCATOR={choice!r} is not a choice)"
    if choice == "system":
        return "system malloc (MPEDU_ALLOCATOR=system)"
    libc = glibc()
    if libc is None:
        return "system malloc (not glibc: nothing to set)"
    settings = CHOICES[choice]
    refused = [name for param, value, name in settings if libc.mallopt(param, value) != 1]
    kept = ", ".join(name for _, _, name in settings if name not in refused)
    text = f"glibc: freed memory kept ({kept})" if kept else "system malloc (glibc refused every setting)"
    return text + (f"; glibc refused: {', '.join(refused)}" if refused and kept else "")


def state() -> str:
    """What mpedu did to malloc, in words, with the workers one-arena could not reach."""
    text = keep_freed_memory()
    if _elsewhere:
        text += (f"; worker(s) {', '.join(sorted(_elsewhere))} took another thread's arena, where blocks over "
                 "64 MiB are still mapped afresh: start Python with MALLOC_ARENA_MAX=1")
    return text
