"""Workers: one persistent thread per device that runs its jobs in order, pinned to its core on virtual
devices, and the waits a caller makes for them (Ctrl-C still reaches the caller)."""
from __future__ import annotations

import ctypes
import functools
import os
import queue
import sys
import threading
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, Future, wait

import torch

from .allocator import check_worker_arena
from .devices import Device, usable_cores


def own_cores(devices: list[Device]) -> list[int] | None:
    """A core for each device when they are all virtual and there are cores enough, else None.

    A pipeline pins each worker to its core: left to the scheduler, two workers that hand tensors
    back and forth every few hundred microseconds are now and then woken on one core (the one
    that woke them) and wait there; measured on near-empty stages, 1F1B's overhead per action
    then jumps from ~17 to ~28 us for the whole run. Pinned, a virtual device is its core, as
    the course says. Not where the OS cannot pin (macOS), nor with more devices than cores.
    """
    cores = usable_cores()
    if not hasattr(os, "sched_setaffinity") or not all(d.virtual for d in devices) or len(devices) > len(cores):
        return None
    return cores[:len(devices)]


PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30      # linux/prctl.h


def fine_timer() -> bool:
    """Let the calling thread's short sleeps end on time: Linux may wake a sleeping thread up to 50 us
    late (its timer slack, to batch wake-ups), which would stretch a 10 us nap five-fold. A pinned
    worker polls for its hand-offs with such naps (Mailbox). True where it was set (Linux)."""
    return _timer_slack(1) == 1          # 1 ns: none to speak of


def _timer_slack(set_to: int | None = None) -> int | None:
    """The calling thread's timer slack in ns, or set it to `set_to` (Linux's prctl); None where there is none."""
    prctl = _prctl()
    if prctl is None:
        return None
    zero = ctypes.c_ulong(0)
    if set_to is not None:
        return set_to if prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(set_to), zero, zero, zero) == 0 else None
    return prctl(PR_GET_TIMERSLACK, zero, zero, zero, zero)


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None


def start_device(device: Device):
    """Prepare the calling thread to run `device`'s work; return its CUDA stream (None off a GPU).

    A virtual device runs torch single-threaded (one core), and checks that the memory mpedu keeps
    (mpedu.runtime.allocator) reaches its thread. A GPU's thread makes the GPU its
    current device and issues work on a stream of its own from PyTorch's pool; such streams do
    not wait for the default stream, so the Pipeline orders them against it at every step.
    """
    if device.virtual:
        # Asking first makes torch set this thread up now, from the process-wide count. Otherwise its
        # first parallel operation would, from whatever count another thread set meanwhile (a lone
        # device's job restoring the caller's 2, a user's torch.set_num_threads): the pinned worker
        # would then run two threads on its one core, measured 40% slower.
        torch.get_num_threads()
        torch.set_num_threads(1)
        check_worker_arena(device.name)
    if device.is_cuda:
        torch.cuda.set_device(device.torch_device)
        return torch.cuda.Stream(device.torch_device)
    return None


class Worker:
    """A persistent thread that runs one device's jobs in order.

    Jobs are plain callables; `submit` returns a Future. A virtual device's thread
    runs torch single-threaded; a CUDA device's thread issues work on its own stream.
    """

    runs_here = False        # a job runs on this worker's own thread, not the caller's (CallerThread)

    def __init__(self, device: Device, start=None, core: int | None = None):
        """`start(device)` runs first in the new thread and returns the CUDA stream to issue work on
        (None off a GPU); the default is `start_device`. `core` pins the thread to that CPU core
        (see own_cores). If it raises (a GPU in exclusive-process
        mode that another process holds, no memory left for a CUDA context), the constructor raises
        a RuntimeError naming the device, instead of waiting for a thread that will never be ready."""
        self.device = device
        self.stream = None
        self._start = start or start_device
        self._core = core
        self._start_error: BaseException | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"mpedu-{device.name}", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        while not self._ready.wait(1.0):
            if not self._thread.is_alive():   # ended without setting ready: never wait for it
                break
        if self._start_error is not None or not self._ready.is_set():
            why = repr(self._start_error) if self._start_error is not None else "its thread ended"
            advice = (" Check that the GPU is free (nvidia-smi: another process, exclusive-process mode, no "
                      "memory left for a CUDA context) or place these layers on other devices."
                      if device.is_cuda else "")
            raise RuntimeError(f"could not start the worker of {device}: {why}.{advice}") from self._start_error

    def _loop(self) -> None:
        try:
            if self._core is not None:
                os.sched_setaffinity(0, {self._core})     # 0: this thread (Linux schedules threads)
                fine_timer()                              # its polls for a hand-off nap ~10 us (Mailbox)
            self.stream = self._start(self.device)
        except BaseException as exc:    # handed to the constructor, which raises it
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        result = fn()
                else:
                    result = fn()
            except BaseException as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)
            else:
                future.set_result(result)
            # drop references now: an idle worker must not keep a Pipeline alive
            job = fn = future = result = None

    def submit(self, fn) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError(f"the worker of {self.device} has stopped; build a new Pipeline")
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def stop(self, wait: bool = True) -> None:
        """Ask the thread to end after the jobs already queued; optionally wait for it."""
        self._jobs.put(None)
        if wait:
            self.join()

    def join(self) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class CallerThread:
    """A virtual device's worker that is the calling thread itself (Worker's interface): `submit` runs
    the job there and then, and returns its Future done.

    A lone device: nothing runs at the same time, so a thread of its own would add only a hand-off
    per step, and something worse: glibc serves another thread from an arena of heaps of at most
    64 MiB, so a larger tensor (the 90 MB logits of an `mxnet8` batch) is mapped afresh and faulted
    in page by page at every step (mpedu.runtime.allocator). The calling thread's memory obeys the
    settings mpedu makes. The first of several virtual devices with a core each (`polls`): the caller
    would only wait for the step anyway, and two wake-ups a step are saved, the first worker's at
    the start and the caller's own at the end (each a futex and a cross-core interrupt, 50-150 us on
    a VM). Its receives then poll with 10 us naps, as a pinned Worker's do, so the thread gets a fine timer
    the first time it plays, and keeps it (its sleeps end on time instead of up to 50 us late; nothing else
    about the thread changes). It is not pinned: the other workers are pinned to the other cores, and the
    scheduler leaves it on the free one. Pinning it to its core for each step and giving back its cores and
    timer after cost five system calls a step, 50-80 us in a cold step; near-empty 1F1B measured 1 us per
    action faster without them, rounds in turn in one process. Its jobs run single-threaded, as on any
    virtual device: torch's thread count is 1 during a job and restored after it (setting it costs well
    under a microsecond).
    """

    stream = None
    runs_here = True         # `submit` runs the job on the calling thread before it returns

    def __init__(self, device: Device, polls: bool = False):
        if not device.virtual:
            raise ValueError(f"only a virtual device runs on the calling thread, not {device}")
        self.device, self._polls = device, polls
        self.alive = True          # until stop(), as a Worker's thread

    def submit(self, fn) -> Future:
        if not self.alive:
            raise RuntimeError(f"the worker of {self.device} has stopped; build a new Pipeline")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        if self._polls and not getattr(_fine_timers, "set", False):
            _fine_timers.set = fine_timer() or True     # (True where there is no timer slack to set: not Linux)
        try:
            future.set_result(fn())
        except BaseException as exc:    # Ctrl-C included: the caller reads it from the future, as from a Worker
            future.set_exception(exc)
        finally:
            torch.set_num_threads(threads)
        return future

    def stop(self, wait: bool = True) -> None:
        self.alive = False

    def join(self) -> None:
        pass


_fine_timers = threading.local()     # .set: this thread has played a polling CallerThread's device (its fine timer)


class QuickSwitching:
    """`with QuickSwitching():` Python's interpreter lock changes hands after STEP_SWITCH_S instead of 5 ms while
    the block runs (sys.setswitchinterval, process-wide; the first block in sets it, the last one out gives the
    old value back, so pipelines stepping in several threads at once do not undo each other's).

    Why. Two workers compute in Python at once and hand tensors to each other. A receiver that finds the
    lock taken waits; each time the holder lets go of it for a torch call, the waiter is woken, but the holder
    is back before the waiter runs (a wake-up across cores costs tens of microseconds on a VM, the call one
    or two), so the waiter waits on, until the holder sleeps or runs a long kernel: near-empty 1F1B's
    hand-offs took a median 130-210 us that way. After the switch interval a waiter asks the holder to let
    go and wait for it to take over: the same hand-offs took 95-110 us with 10 us, and the step's overhead
    per action fell from 47 to 32 us (1F1B), 34 to 27 (GPipe) and 22 to 19 (zero bubble), rounds in turn
    in one process, and the step's wall time 2-8% (forced switches lengthen each device's boxes a little).
    5 us measured no better. Not measured on real layers, whose kernels run without the lock: a waiter there
    seldom waits long enough to force a switch."""

    _lock = threading.Lock()
    _inside = 0
    _before = 0.0

    def __enter__(self):
        with QuickSwitching._lock:
            if QuickSwitching._inside == 0:
                QuickSwitching._before = sys.getswitchinterval()
                sys.setswitchinterval(STEP_SWITCH_S)
            QuickSwitching._inside += 1
        return self

    def __exit__(self, *exc):
        with QuickSwitching._lock:
            QuickSwitching._inside -= 1
            if QuickSwitching._inside == 0:
                sys.setswitchinterval(QuickSwitching._before)


STEP_SWITCH_S = 10e-6
CHECK_SIGNALS_S = 0.05     # how long a Ctrl-C may go unnoticed while the caller waits for its workers


def wait_interruptibly(futures, return_when=ALL_COMPLETED):
    """`concurrent.futures.wait` that Ctrl-C interrupts whichever thread the kernel hands the signal to.

    The kernel gives a process-wide SIGINT to any thread that does not block it, a worker's too, and
    Python runs the handler (which raises KeyboardInterrupt) only on the main thread, once that thread
    runs. A main thread asleep on a lock is woken by the signal only if the kernel chose it: otherwise
    it sleeps until the step ends, and the interrupt comes late or not at all. So it wakes every
    CHECK_SIGNALS_S to run a pending handler (a wake-up 20 times a second costs nothing measurable).
    """
    if all(f.done() for f in futures):     # often so: the caller's thread played the device that ends last
        return set(futures), set()
    while True:
        done, pending = wait(futures, timeout=CHECK_SIGNALS_S, return_when=return_when)
        if not pending or (return_when == FIRST_EXCEPTION
                           and any(not f.cancelled() and f.exception() is not None for f in done)):
            return done, pending


def result_of(future: Future):
    """`future.result()`, interruptible by Ctrl-C as `wait_interruptibly` is."""
    wait_interruptibly([future])
    return future.result()


def wait_uninterrupted(futures) -> None:
    """Wait for the workers to stop even if Ctrl-C is pressed again meanwhile."""
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue


def stop_workers(workers) -> None:
    """Ask every worker to stop, without waiting (a finalizer may call this)."""
    for worker in workers:
        worker.stop(wait=False)


def start_workers(devices: list[Device]) -> tuple[list, bool]:
    """One worker per device for a pipeline, and whether each has a core of its own.

    Virtual devices with a core each get their worker pinned to it (own_cores), and may poll for a
    hand-off instead of sleeping (no one else needs that core). A lone virtual device runs on the
    caller's thread (CallerThread: there is nothing to overlap). If one cannot start (a GPU), the
    workers already started are stopped before the error goes on. With a core each, the first device
    runs on the caller's thread too (CallerThread): submit its job last."""
    cores = own_cores(devices) if len(devices) > 1 else None
    lone = len(devices) == 1 and devices[0].virtual
    workers = []
    try:
        for k, device in enumerate(devices):
            if lone or (cores and k == 0):      # the caller plays the first device; the others keep off its core
                workers.append(CallerThread(device, polls=bool(cores)))
            else:
                workers.append(Worker(device, core=cores[k] if cores else None))
    except BaseException:
        stop_workers(workers)
        raise
    return workers, cores is not None
