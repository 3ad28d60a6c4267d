"""Keep freed memory for the next step: glibc's malloc settings, made from inside mpedu at import.

A training step allocates the same large tensors every time (the decoder's logits of
`mxnet8`, T*B*V floats, are 90 MB). glibc's defaults hand large freed blocks back to the
kernel (munmap, or trimming the heap top), so each step faults them in again, page by
page, and the kernel zeroes every page: about 150,000 minor faults per `mxnet8` step,
some 15% of its time on one core. Two settings stop that for the main arena: no `mmap`
for large blocks (M_MMAP_MAX = 0) and no trimming (M_TRIM_THRESHOLD = -1, "never").

They are not enough for a worker thread. glibc gives other threads arenas of their
own, made of heaps of at most 64 MiB: a larger block is mmapped whatever the settings,
and a heap whose memory is all free is unmapped at once, so a virtual device's worker
still faults ~90,000 times a step. One arena for every thread (M_ARENA_MAX = 1) keeps
all of it in the main arena. That only holds while no other thread has made an arena
of its own: an arena, once made, is handed on to later threads too. So mpedu sets it at
import, each virtual device's worker checks where its memory comes from
(`check_worker_arena`), and `state()` names the workers that landed elsewhere (possible
in a Jupyter kernel, whose threads allocate before the first cell). Starting Python with
MALLOC_ARENA_MAX=1 in the environment avoids that. Measured: `bench/vs_intraop.py`.

The price: memory freed by a step stays with the process (its peak, as PyTorch's CUDA
caching allocator keeps GPU memory), and every thread takes the one arena's lock.
`MPEDU_ALLOCATOR=system` leaves malloc alone. Without glibc (macOS, musl) nothing is
changed and `state()` says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
import warnings

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER = -1                      # M_TRIM_THRESHOLD -1: glibc stores SIZE_MAX, "disables trimming completely"
SETTINGS = ((M_ARENA_MAX, 1, "one arena"), (M_MMAP_MAX, 0, "no mmap"), (M_TRIM_THRESHOLD, NEVER, "no trim"))

_lock = threading.Lock()
_state: str | None = None       # what keep_freed_memory did; None until it ran
_elsewhere: set[str] = set()    # workers whose thread malloc serves from an arena other than the main one


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
    """Called in a new worker thread: note it when kept memory cannot reach it (another thread's arena)."""
    if "one arena" in keep_freed_memory() and in_main_arena() is False:
        with _lock:
            _elsewhere.add(name)


def keep_freed_memory() -> str:
    """Make glibc keep freed memory for reuse (once per process); return what was done, in words.

    Idempotent and thread-safe. `MPEDU_ALLOCATOR=system` (read at the first call) leaves malloc alone.
    """
    global _state
    with _lock:
        if _state is None:
            _state = _apply(os.environ.get("MPEDU_ALLOCATOR", "keep").strip().lower())
        return _state


def _apply(choice: str) -> str:
    if choice == "system":
        return "system malloc (MPEDU_ALLOCATOR=system)"
    if choice != "keep":
        warnings.warn(f"MPEDU_ALLOCATOR={choice!r} is not a choice: use 'keep' (mpedu's default: freed memory "
                      "stays with the process for the next step) or 'system' (malloc as it is); leaving malloc "
                      "as it is", stacklevel=3)
        return f"system malloc (MPEDU_ALLOCATOR={choice!r} is not a choice)"
    libc = glibc()
    if libc is None:
        return "system malloc (not glibc: nothing to set)"
    refused = [name for param, value, name in SETTINGS if libc.mallopt(param, value) != 1]
    kept = ", ".join(name for _, _, name in SETTINGS if name not in refused)
    text = f"glibc: freed memory kept ({kept})" if kept else "system malloc (glibc refused every setting)"
    return text + (f"; glibc refused: {', '.join(refused)}" if refused and kept else "")


def state() -> str:
    """What mpedu did to malloc, in words, with the workers it could not reach."""
    text = keep_freed_memory()
    if _elsewhere:
        text += (f"; worker(s) {', '.join(sorted(_elsewhere))} took another thread's arena, where blocks over "
                 "64 MiB are still mapped afresh: start Python with MALLOC_ARENA_MAX=1")
    return text
