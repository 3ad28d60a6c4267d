"""mpedu keeps freed memory for the next step (glibc), or leaves malloc alone when asked or elsewhere."""
import os
import subprocess
import sys
import textwrap

import pytest

from mpedu import allocator

GLIBC = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc") if hasattr(os, "confstr") else False


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
    from mpedu.devices import Worker, get_device
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
    assert first.startswith("glibc: freed memory kept" if GLIBC else "system malloc")


@pytest.mark.skipif(not GLIBC, reason="the malloc settings exist in glibc only")
def test_a_worker_reuses_freed_memory_instead_of_faulting_it_in_again():
    kept = float(run(FAULTS_IN_A_WORKER))
    system = float(run(FAULTS_IN_A_WORKER, MPEDU_ALLOCATOR="system"))
    pages = 100e6 / os.sysconf("SC_PAGE_SIZE")
    assert system > 0.5 * pages, f"system malloc should fault a freed 100 MB block in again, got {system} faults"
    assert kept < 0.01 * pages, f"kept memory should be reused without faults, got {kept} per round"


def test_system_leaves_malloc_alone_and_a_typo_is_named():
    assert run("import mpedu.allocator as a; print(a.state())", MPEDU_ALLOCATOR="system") == \
        "system malloc (MPEDU_ALLOCATOR=system)"
    done = subprocess.run([sys.executable, "-c", "import mpedu"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MPEDU_ALLOCATOR": "jemalloc"})
    assert done.returncode != 0
    assert "MPEDU_ALLOCATOR='jemalloc'" in done.stderr and "'system'" in done.stderr


def test_glibc_is_found_only_where_it_is(monkeypatch):
    assert (allocator.glibc() is not None) == GLIBC
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")     # a Mac: no glibc, no mallopt
    assert allocator.glibc() is None
