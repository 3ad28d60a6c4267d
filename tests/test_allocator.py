"""mpedu keeps freed memory for the next step (glibc), or leaves malloc alone when asked or elsewhere."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from mpedu.runtime import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def run(code: str, **env) -> str:
    """Run `code` in a fresh Python (malloc settings are per process); return its last printed line."""
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MPEDU_ALLOCATOR"))}, **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


# A worker thread allocates, fills and frees a 100 MB tensor, five times per window, three windows:
# minor page faults per round in its best window (the first windows may still grow the heap).
FAULTS_IN_A_WORKER = """
    import resource, threading
    import mpedu, torch
    from mpedu.runtime import Worker, get_device
    def window():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(5):
            torch.ones(25_000_000)
        return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 5
    worker = Worker(get_device("vgpu:0"))
    print(min(worker.submit(window).result() for _ in range(3)))
    worker.stop()
"""


def test_keeping_is_idempotent_and_says_what_it_did():
    first = allocator.keep_freed_memory()
    assert allocator.keep_freed_memory() == first == allocator.state()
    assert first == ("glibc: freed memory kept (no mmap, no trim, 64 MiB pad)" if GLIBC else
                     "system malloc (not glibc: nothing to set)")


@pytest.mark.skipif(not GLIBC, reason="the malloc settings exist in glibc only")
@pytest.mark.parametrize("mb", [40, 100])
def test_a_worker_reuses_freed_memory_instead_of_faulting_it_in_again(mb):
    """keep: a block within a worker's 64 MiB heaps is reused; a larger one only under one-arena."""
    code = FAULTS_IN_A_WORKER.replace("25_000_000", str(mb * 250_000))
    faults = {choice: float(run(code, MPEDU_ALLOCATOR=choice)) for choice in ("system", "keep", "one-arena")}
    # (relative: with transparent huge pages always on, a fresh block faults ~50 times, not ~24,000)
    assert faults["system"] > 0, f"system malloc should map a freed {mb} MB block afresh: {faults}"
    assert faults["one-arena"] < 0.05 * faults["system"], faults
    if mb < 64:
        assert faults["keep"] < 0.05 * faults["system"], faults
    else:                                   # the gap one-arena closes: mapped afresh in a thread's own arena
        assert faults["keep"] > 0.5 * faults["system"], faults


# One virtual device steps on the calling thread, so its logits of more than 64 MiB (35 x 64 x 8,000 floats,
# 72 MB) come from memory mpedu keeps; on a worker thread they would be mapped afresh at every step.
FAULTS_OF_A_ONE_DEVICE_STEP = """
    import resource
    import torch
    from mpedu.lm import Batch, LSTMLM
    from mpedu.core import Pipeline
    torch.manual_seed(0)
    targets = torch.randint(3, 8000, (35, 64))
    batch = Batch(torch.cat([torch.full((1, 64), 2), targets[:-1]]), targets, targets != 0, 35, False)
    pipe = Pipeline(LSTMLM.from_config("tiny", 8000), "embed,lstm0,lstm1,decode:vgpu0", "gpipe", 1)
    def window():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(2):
            pipe.train_step(batch)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 2
    print(min(window() for _ in range(3)))
"""


@pytest.mark.skipif(not GLIBC, reason="the malloc settings exist in glibc only")
def test_one_device_keeps_its_large_blocks_too():
    faults = {choice: float(run(FAULTS_OF_A_ONE_DEVICE_STEP, MPEDU_ALLOCATOR=choice)) for choice in ("system", "keep")}
    # measured: system ~70,000 a step, keep ~2,000 (a worker thread under keep: ~70,000 again)
    assert faults["system"] > 0, faults
    assert faults["keep"] < 0.2 * faults["system"], faults


def test_system_leaves_malloc_alone_and_a_typo_is_named_without_breaking_the_import():
    assert run("import mpedu.runtime.allocator as a; print(a.state())", MPEDU_ALLOCATOR="system") == \
        "system malloc (MPEDU_ALLOCATOR=system)"
    done = subprocess.run([sys.executable, "-c", "import mpedu; print(mpedu.runtime.allocator.state())"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MPEDU_ALLOCATOR": "jemalloc"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "system malloc (MPEDU_ALLOCATOR='jemalloc' is not a choice)"
    assert "MPEDU_ALLOCATOR='jemalloc' is not a choice" in done.stderr and "'system'" in done.stderr


# A thread that allocated before mpedu was imported made an arena of its own; glibc hands it on to a later thread.
WORKERS_AFTER_AN_ALLOCATING_THREAD = """
    import ctypes, threading, time
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    ready = threading.Event()
    threading.Thread(target=lambda: (libc.malloc(100), ready.set(), time.sleep(60)), daemon=True).start()
    ready.wait()
    import mpedu
    from mpedu.runtime import Worker, get_device
    workers = [Worker(get_device(f"vgpu:{k}")) for k in range(2)]
    print(mpedu.runtime.allocator.in_main_arena(), mpedu.runtime.allocator.state())
"""
ONE_ARENA = "glibc: freed memory kept (one arena, no mmap, no trim, 64 MiB pad)"


@pytest.mark.skipif(not GLIBC, reason="arenas are glibc's")
def test_one_arena_names_a_worker_on_another_threads_arena_and_the_variable_avoids_it():
    named = run(WORKERS_AFTER_AN_ALLOCATING_THREAD, MPEDU_ALLOCATOR="one-arena")
    assert named.startswith(f"True {ONE_ARENA}; worker(s) vgpu:")
    assert "took another thread's arena" in named and "MALLOC_ARENA_MAX=1" in named
    assert run(WORKERS_AFTER_AN_ALLOCATING_THREAD, MPEDU_ALLOCATOR="one-arena", MALLOC_ARENA_MAX="1") == \
        f"True {ONE_ARENA}"
    # keep gives each worker an arena of its own on purpose: nothing to name
    assert run(WORKERS_AFTER_AN_ALLOCATING_THREAD) == "True glibc: freed memory kept (no mmap, no trim, 64 MiB pad)"


def test_glibc_is_found_only_where_it_is(monkeypatch):
    assert (allocator.glibc() is not None) == GLIBC
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")     # a Mac: no glibc, no mallopt
    assert allocator.glibc() is None
