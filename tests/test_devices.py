"""Devices: real or virtual, listed honestly; workers run jobs in order, single-threaded, concurrently."""
import ctypes
import os
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import FUZZ, make_batch, tiny_model
from mpedu.runtime import (PR_GET_TIMERSLACK, PR_SET_TIMERSLACK, CallerThread, Device, Worker, describe_devices,
    get_device, get_devices, list_devices, format_size, parse_size, virtual_count)


def test_virtual_devices_are_listed_as_virtual():
    devices = list_devices()
    virtual = [d for d in devices if d.virtual]
    assert [d.name for d in virtual[:2]] == ["vgpu:0", "vgpu:1"]
    assert len([d for d in devices if not d.virtual]) == torch.cuda.device_count()
    text = describe_devices()
    assert "vgpu:0  virtual" in text


def test_lookup_accepts_both_spellings_and_explains_missing_devices():
    assert get_device("vgpu1") == get_device("vgpu:1")
    assert get_device("vgpu:1").torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device 'cuda:7' does not exist; this machine offers .*vgpu:0"):
        get_device("cuda:7")
    with pytest.raises(ValueError, match="asked for 99 virtual devices"):
        get_devices(99, "virtual")
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        get_devices(1, "tpu")


def test_worker_runs_jobs_in_order_and_returns_errors():
    worker = Worker(get_device("vgpu:0"))
    try:
        seen = []
        futures = [worker.submit(lambda k=k: seen.append(k) or k) for k in range(5)]
        assert [f.result() for f in futures] == list(range(5)) and seen == list(range(5))
        failing = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result()
        assert worker.submit(torch.get_num_threads).result() == 1
        assert worker.submit(lambda: threading.current_thread().name).result() == "mpedu-vgpu:0"
    finally:
        worker.stop()
    assert not worker.alive


def test_a_worker_stays_single_threaded_when_another_thread_changes_the_count():
    """torch sets a thread's count from the process-wide one when the thread first asks or runs in parallel.
    A worker started before the caller sets 2 threads (or before a lone device's job restores them) must not
    pick up that 2 at its first operation: two threads on its one pinned core ran its work 40% slower."""
    worker = Worker(get_device("vgpu:0"))
    torch.set_num_threads(2)
    try:
        assert worker.submit(torch.get_num_threads).result() == 1
        x = torch.randn(256, 256)
        assert worker.submit(lambda: (x @ x, torch.get_num_threads())[1]).result() == 1
    finally:
        torch.set_num_threads(1)
        worker.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"),
                    reason="pinning and timer slack are Linux's")
def test_a_pinned_worker_naps_on_time():
    """A pinned worker polls for its hand-offs with 10 us naps (Mailbox): its timer slack is 1 ns, where Linux's
    default (50 us, inherited from the thread that made it) would stretch each nap five-fold. Unpinned, the
    inherited slack stays."""
    zero = ctypes.c_ulong(0)
    prctl = ctypes.CDLL(None).prctl

    def slack():
        return prctl(PR_GET_TIMERSLACK, zero, zero, zero, zero)

    before = slack()       # this thread may have played a device already, which keeps a fine timer
    prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(50_000), zero, zero, zero)      # Linux's default
    try:
        pinned = Worker(get_device("vgpu:0"), core=sorted(os.sched_getaffinity(0))[0])
        loose = Worker(get_device("vgpu:1"))
    finally:
        prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(before), zero, zero, zero)
    try:
        assert pinned.submit(slack).result() == 1
        assert loose.submit(slack).result() == 50_000
    finally:
        pinned.stop()
        loose.stop()


def test_a_lone_virtual_device_runs_on_the_calling_thread_single_threaded():
    """One device has nothing to overlap: its jobs run on the caller's thread (its malloc settings hold there),
    with torch on one thread during a job and the caller's count back afterwards; errors, Ctrl-C too, come back
    through the future, as from a Worker."""
    lone = CallerThread(get_device("vgpu:0"))
    torch.set_num_threads(2)
    try:
        assert lone.submit(lambda: (threading.current_thread(), torch.get_num_threads())).result() == \
            (threading.current_thread(), 1)
        assert torch.get_num_threads() == 2
        for error in (ZeroDivisionError, KeyboardInterrupt):
            def fail():
                raise error
            with pytest.raises(error):
                lone.submit(fail).result()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    with pytest.raises(ValueError, match="only a virtual device"):
        CallerThread(Device("cuda:0", False))


def test_a_one_device_pipeline_steps_on_the_calling_thread():
    from mpedu.core import Pipeline
    model = tiny_model(num_layers=2)
    seen = []
    with Pipeline(model, "embed,lstm0,lstm1,decode:vgpu0", "gpipe", 2) as pipe:
        original = pipe.stages[0].forward
        pipe.stages[0].forward = lambda *a, **k: (seen.append(threading.current_thread()), original(*a, **k))[1]
        pipe.train_step(make_batch())
    assert seen == [threading.current_thread()] * 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs an OS that pins threads and two cores")
def test_a_pipelines_workers_are_pinned_one_per_core_when_there_are_cores_enough():
    from mpedu.core import Pipeline
    cores = sorted(os.sched_getaffinity(0))
    model = tiny_model(num_layers=2)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "1f1b", 2) as pipe:
        pinned = [w.submit(lambda: os.sched_getaffinity(0)).result() for w in pipe._workers]
    assert pinned == [set(cores), {cores[1]}]     # vgpu:0 plays on the caller's thread, which stays free
    assert os.sched_getaffinity(0) == set(cores)
    many = len(cores) + 1                                   # more devices than cores: left to the scheduler
    with Pipeline(tiny_model(num_layers=many), many, "gpipe", 2) as pipe:
        assert all(w.submit(lambda: os.sched_getaffinity(0)).result() == set(cores) for w in pipe._workers)


def test_two_virtual_devices_compute_at_the_same_time():
    """Each worker runs torch work; their busy intervals overlap (torch releases the GIL)."""
    workers = [Worker(get_device(f"vgpu:{i}")) for i in range(2)]
    a = torch.randn(256, 256)

    def busy():
        start = time.perf_counter()
        for _ in range(60):
            a @ a
        return start, time.perf_counter()

    try:
        (s0, e0), (s1, e1) = [f.result() for f in [w.submit(busy) for w in workers]]
    finally:
        for w in workers:
            w.stop()
    assert max(s0, s1) < min(e0, e1), "the two devices never ran at once"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="this OS cannot restrict a process's cores")
def test_devices_count_the_cores_this_process_may_use_not_the_machines():
    """Under taskset or a container's CPU set, fewer cores are usable than os.cpu_count() reports."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        text = describe_devices()
        count = virtual_count()
    finally:
        os.sched_setaffinity(0, allowed)
    assert "vgpu:0  virtual: one worker thread on the CPU (its own core; 1 core)" in text
    assert "vgpu:1  virtual: one worker thread on the CPU (shares a core with another; 1 core)" in text
    assert count == 8, "at least 8 virtual devices, whatever the core count"


def test_a_worker_that_cannot_start_says_why_instead_of_hanging():
    """A GPU whose thread cannot start (exclusive-process mode, no memory for a CUDA context) once
    left the constructor waiting for ever; here the start fails the same way on any machine."""
    def no_context(device):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"could not start the worker of vgpu:0: .*busy or unavailable") as info:
        Worker(get_device("vgpu:0"), start=no_context)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert time.perf_counter() - started < 30


def test_a_pipeline_whose_second_device_cannot_start_ends_the_first(monkeypatch):
    import mpedu.runtime.workers as workers
    from mpedu.core import Pipeline
    from conftest import tiny_model
    made = []

    def worker(device, core=None):
        if device.name == "vgpu:1":
            raise RuntimeError(f"could not start the worker of {device}: injected")
        made.append(Worker(device, core=core))
        return made[-1]

    monkeypatch.setattr(workers, "Worker", worker)
    monkeypatch.setattr(workers, "own_cores", lambda devices: None)    # unpinned: vgpu:0 has a Worker too
    with pytest.raises(RuntimeError, match="could not start the worker of vgpu:1"):
        Pipeline(tiny_model(), "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1")
    assert len(made) == 1
    made[0].join()             # stopped: the join returns
    assert not made[0].alive


def test_unmarked_tests_see_virtual_devices_only():
    """conftest pins a device count to virtual devices outside tests marked `cuda` (a GPU machine would
    otherwise give `Pipeline(model, 2)` two GPUs under CPU tolerances)."""
    assert [d.name for d in get_devices(2)] == ["vgpu:0", "vgpu:1"]
    assert all(d.virtual for d in list_devices())


# ---------------------------------------------------------------- sizes

@given(st.one_of(st.text(max_size=12), st.integers(-10, 10**30), st.floats(), st.none(), st.booleans()))
@FUZZ
def test_sizes_parse_or_say_what_a_size_looks_like(value):
    try:
        assert parse_size(value) >= 1
    except ValueError as e:
        assert "is not a size" in str(e) and "'2MB'" in str(e)


def test_sizes_for_people_round_up_when_asked_and_never_print_an_exponent():
    from mpedu.runtime import format_size
    assert (format_size(555_072), format_size(555_072, up=True)) == ("555 kB", "556 kB")   # a minimum to type back
    assert format_size(555_000, up=True) == "555 kB" and format_size(12.2, up=True) == "13 bytes"
    assert parse_size(format_size(555_072, up=True)) >= 555_072
    assert format_size(999_999) == "1 MB" and format_size(2.5e12) == "2.5 TB"   # not "1e+03 kB"


@pytest.mark.parametrize("nbytes", [1, 12, 999, 1234, 5_555_555])
def test_every_size_mpedu_writes_reads_back_as_a_memory_cap(nbytes):
    # "--memory-cap '12 bytes'" as a refusal printed it; above 999 bytes to the 3 digits written
    assert parse_size(format_size(nbytes)) == pytest.approx(nbytes, rel=5e-3)
    assert format_size(1) == "1 byte"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs an OS that pins threads and two cores")
def test_the_first_of_two_pinned_devices_plays_on_the_callers_thread_and_gives_it_back_as_it_was():
    """With a core each, the caller plays vgpu:0 itself (no wake-up for its worker at the start, none for the
    caller at the end): unpinned (the other worker keeps to the other core), with torch on one thread and the
    interpreter lock changing hands quickly during the step, both as they were after it, an error's step
    included; its receives poll, so it gets a fine timer at its first step and keeps it."""
    from mpedu.core import Pipeline
    cores = sorted(os.sched_getaffinity(0))
    prctl = ctypes.CDLL(None).prctl
    zero = ctypes.c_ulong(0)

    def now():
        return (os.sched_getaffinity(0), torch.get_num_threads(), sys.getswitchinterval())

    def slack():
        return prctl(PR_GET_TIMERSLACK, zero, zero, zero, zero)

    seen, before = {}, now()
    model = tiny_model(num_layers=2)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "1f1b", 2) as pipe:
        assert isinstance(pipe._workers[0], CallerThread) and isinstance(pipe._workers[1], Worker)
        assert pipe._workers[1].submit(lambda: os.sched_getaffinity(0)).result() == {cores[1]}
        original = pipe.stages[0].forward

        def noted(*args, **kwargs):
            seen[threading.current_thread()] = (*now(), slack())
            return original(*args, **kwargs)
        pipe.stages[0].forward = noted
        pipe.train_step(make_batch())
        assert seen == {threading.current_thread(): (set(cores), 1, pytest.approx(10e-6), 1)}
        assert now() == before and slack() == 1

        def fail(*args, **kwargs):
            raise ZeroDivisionError
        pipe.stages[0].forward = fail
        with pytest.raises(ZeroDivisionError):
            pipe.train_step(make_batch())
        assert now() == before


def test_quick_switching_holds_until_the_last_of_several_steps_at_once_ends():
    from mpedu.runtime import QuickSwitching
    before = sys.getswitchinterval()
    first, second = QuickSwitching(), QuickSwitching()
    with first:
        assert sys.getswitchinterval() == pytest.approx(10e-6)
        second.__enter__()
    assert sys.getswitchinterval() == pytest.approx(10e-6)     # the second step still runs
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="Ctrl-C reaches the main thread")
@pytest.mark.usefixtures("python_handles_ctrl_c")
def test_a_receive_parked_on_the_main_thread_runs_a_ctrl_c_that_another_thread_received():
    """The caller's thread may play a device; a Ctrl-C the kernel hands to another thread only flags the main
    thread, which a receive parked without end would never look at. Parked in slices, it does, within one."""
    import signal
    from mpedu.core import Mailbox
    mailbox = Mailbox()
    key = ("act", 1, 0, 0)
    late = threading.Timer(5.0, lambda: mailbox.put(key, "sent"))    # without slices: the receive returns this

    def interrupt_from_here():
        parked_by = time.perf_counter() + 4.0                  # the state the test is about: the receive parked
        while key not in mailbox._waiting and time.perf_counter() < parked_by:
            time.sleep(0.001)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    poker = threading.Thread(target=interrupt_from_here)
    late.start()
    poker.start()
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            mailbox.get(key)
        assert time.perf_counter() - start < 2.0
    finally:
        late.cancel()
        poker.join()
