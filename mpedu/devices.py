"""Devices: a real `cuda:N`, or a virtual `vgpu:N` that is one CPU worker thread."""
from __future__ import annotations

import contextlib
import ctypes
import math
import numbers
import os
import queue
import re
import sys
import threading
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass

import torch

from .allocator import check_worker_arena


@dataclass(frozen=True)
class Device:
    """A place where a stage runs.

    `vgpu:N` devices share the CPU's memory; each runs its ops single-threaded on
    its own worker thread, so k virtual devices on k cores really run at once.
    """

    name: str            # "vgpu:0", "cuda:1", "cpu"
    virtual: bool

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.virtual or self.name == "cpu" else torch.device(self.name)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def __str__(self) -> str:
        return self.name


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (a container or `taskset` may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def virtual_count() -> int:
    """Virtual devices on offer: one per CPU core, and at least 8 so a learner can try deeper
    pipelines anywhere (beyond the core count they take turns on the cores)."""
    return max(8, len(usable_cores()))


def list_devices() -> list[Device]:
    """Every device this machine offers: real CUDA GPUs first, then virtual ones."""
    real = [Device(f"cuda:{i}", False) for i in range(torch.cuda.device_count())]
    return real + [Device(f"vgpu:{i}", True) for i in range(virtual_count())]


def describe_devices() -> str:
    """A few lines a learner can read: which devices are real and which are virtual."""
    lines, cores = [], len(usable_cores())
    for d in list_devices():
        if d.virtual:
            index = int(d.name.split(":")[1])
            share = "its own core" if index < cores else "shares a core with another"
            lines.append(f"{d.name:>8}  virtual: one worker thread on the CPU ({share}; {cores} "
                         f"core{'s' if cores > 1 else ''})")
        else:
            lines.append(f"{d.name:>8}  real: {torch.cuda.get_device_name(d.torch_device)}")
    return "\n".join(lines)


def get_device(name: str | Device) -> Device:
    """Look a device up by name (`vgpu0` is accepted for `vgpu:0`)."""
    if isinstance(name, Device):
        return name
    text = str(name).strip().lower()
    if text == "cpu":
        return Device("cpu", False)
    if text[:4] in ("vgpu", "cuda") and text[4:5] != ":":
        text = f"{text[:4]}:{text[4:]}"
    for d in list_devices():
        if d.name == text:
            return d
    offered = ", ".join(d.name for d in list_devices())
    hint = "" if torch.cuda.is_available() else " (no CUDA GPU here: use virtual devices vgpu:N)"
    raise ValueError(f"device {name!r} does not exist; this machine offers {offered}{hint}")


def get_devices(n: int, kind: str = "auto") -> list[Device]:
    """The first n devices of a kind: "cuda", "virtual", or "auto" (CUDA when it has n GPUs)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"need at least one device, got {n!r}")
    cuda = [d for d in list_devices() if not d.virtual]
    virtual = [d for d in list_devices() if d.virtual]
    if kind == "auto":
        kind = "cuda" if len(cuda) >= n else "virtual"
    pool = {"cuda": cuda, "virtual": virtual}.get(kind)
    if pool is None:
        raise ValueError(f"unknown device kind {kind!r}; use 'auto', 'cuda' or 'virtual'")
    if len(pool) < n:
        raise ValueError(f"asked for {n} {kind} devices but this machine has {len(pool)}: "
                         f"{', '.join(d.name for d in pool) or 'none'}")
    return pool[:n]


def device_list(devices) -> list[Device]:
    """Devices from a count (the first n: get_devices), one name, or a list of names or Devices,
    each once."""
    if isinstance(devices, int) and not isinstance(devices, bool):
        return get_devices(devices)
    if isinstance(devices, (str, Device)):
        devices = [devices]
    try:
        devs = [get_device(d) for d in devices]
    except TypeError:
        raise TypeError(f"devices={devices!r}: give a count, e.g. 2, or names, e.g. ['vgpu:0', 'vgpu:1']") from None
    if not devs:
        raise ValueError("devices=[] names no device: give a count, e.g. 2, or names, e.g. ['vgpu:0', 'vgpu:1']")
    twice = sorted({d.name for d in devs if devs.count(d) > 1})
    if twice:
        raise ValueError(f"devices {[d.name for d in devs]} name {', '.join(twice)} twice; give each device once")
    return devs


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
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return False
    zero = ctypes.c_ulong(0)
    return prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), zero, zero, zero) == 0    # 1 ns: none to speak of


def start_device(device: Device):
    """Prepare the calling thread to run `device`'s work; return its CUDA stream (None off a GPU).

    A virtual device runs torch single-threaded (one core), and checks that the memory mpedu keeps
    (mpedu.allocator) reaches its thread. A GPU's thread makes the GPU its
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
    """A lone virtual device's worker that is the calling thread itself (Worker's interface).

    With one device nothing runs at the same time, so a thread of its own would add only a
    hand-off per step, and something worse: glibc serves another thread from an arena of heaps of
    at most 64 MiB, so a larger tensor (the 90 MB logits of an `mxnet8` batch) is mapped afresh and
    faulted in page by page at every step (mpedu.allocator). The calling thread's memory obeys the
    settings mpedu makes. Its jobs run single-threaded, as on any virtual device: torch's thread
    count is 1 during a job and restored after it (setting it costs well under a microsecond).
    """

    stream = None
    alive = True

    def __init__(self, device: Device):
        if not device.virtual:
            raise ValueError(f"only a virtual device runs on the calling thread, not {device}")
        self.device = device

    def submit(self, fn) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            future.set_result(fn())
        except BaseException as exc:    # Ctrl-C included: the caller reads it from the future, as from a Worker
            future.set_exception(exc)
        finally:
            torch.set_num_threads(threads)
        return future

    def stop(self, wait: bool = True) -> None:
        pass

    def join(self) -> None:
        pass


CHECK_SIGNALS_S = 0.05     # how long a Ctrl-C may go unnoticed while the caller waits for its workers


def wait_interruptibly(futures, return_when=ALL_COMPLETED):
    """`concurrent.futures.wait` that Ctrl-C interrupts whichever thread the kernel hands the signal to.

    The kernel gives a process-wide SIGINT to any thread that does not block it, a worker's too, and
    Python runs the handler (which raises KeyboardInterrupt) only on the main thread, once that thread
    runs. A main thread asleep on a lock is woken by the signal only if the kernel chose it: otherwise
    it sleeps until the step ends, and the interrupt comes late or not at all. So it wakes every
    CHECK_SIGNALS_S to run a pending handler (a wake-up 20 times a second costs nothing measurable).
    """
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
