"""Mailbox: the tensors in flight between a pipeline's stages, handed from one worker thread to another."""
from __future__ import annotations

import threading
import time

from ..runtime.link import Channel, Link


class Aborted(Exception):
    """Raised inside a worker when another worker failed: stop, nothing to report."""


class Deadlock(RuntimeError):
    """Every worker of a step waits for a tensor or has finished its actions: no tensor can come."""


class Mailbox:
    """Tensors in flight between stages, keyed by (what, stage, micro-batch, chunk).

    A receive waits until its tensor arrives or the step is aborted, so a failure
    anywhere wakes everyone up and no worker stays blocked. A waiting receive parks
    on its own lock (held, so acquiring it blocks); the send that fills its key
    releases that lock, waking exactly the one device that waits. A bare lock is
    the cheapest hand-off CPython has: this sits on the critical path of every
    transfer.

    With `spin` (a core for every worker), a receive first polls for up to SPIN_RECEIVE_S before
    it parks: waking a parked thread takes the kernel tens of microseconds, and a pipeline of
    small stages waits on every hand-off. Between looks it naps POLL_NAP_S, letting go of
    the interpreter lock for that long (a pinned worker's naps end on time: devices.fine_timer).
    A thread that finds that lock taken sleeps in the kernel until the holder lets go and wakes
    it (tens of microseconds here). Looking as often as it can (time.sleep(0)), a receiver spends
    most of its wait asking for the lock back, so it was often asleep in that queue when the tensor
    came, and had to be woken; napping, it mostly sleeps on a timer that ends by itself. A hand-off
    to a polling receiver took a median 40 us that way, 14 us with naps (bench/handoff.py), and
    near-empty 1F1B 5-7% less per action (toggled round by round in one process). Without a core
    of its own a polling thread would slow the one it waits for.

    With an emulated `link` a sent tensor is in the mailbox at once (the sender goes
    on), but lands only when the link's Channel for its direction says: a receive
    then sleeps until that time, freeing its core as a GPU waiting for a copy would.

    No wait is unbounded: given the step's `workers` (how many will send and receive), the mailbox
    knows when every one of them is parked in a receive or has called `finished()`. Then no
    tensor can come any more: it aborts the step with a Deadlock naming who waits for what
    (`describe(key)` says what a key is). A schedule that passed validate() never gets there.
    """

    def __init__(self, link: Link | None = None, spin: bool = False, workers: int | None = None,
                 describe=str):
        self._spin = spin
        self._workers, self._finished, self._describe = workers, 0, describe
        self.failure: Deadlock | None = None
        self._lock = threading.Lock()
        self._items: dict = {}
        self._waiting: dict = {}                # key -> the lock its receiver parks on
        self._who: dict = {}                    # key -> who waits for it
        self.aborted = False
        self._link = link if link is not None and link.emulated else None
        self._channels: dict = {}          # (from device, to device) -> Channel; each used by one sender

    def put(self, key, value, route=None, nbytes: int = 0) -> float | None:
        """Deliver `value` under `key`. On an emulated link, `route` = (from device, to device) names the
        direction; returns when the tensor lands (a perf_counter time), else None."""
        landing = None
        if self._link is not None and route is not None:
            channel = self._channels.get(route)
            if channel is None:
                channel = self._channels[route] = Channel(self._link)
            landing = channel.arrival(time.perf_counter(), nbytes)
        with self._lock:
            self._items[key] = (value, landing)
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.release()
        return landing

    def get(self, key, who=""):
        """The tensor sent under `key`, waiting for it; `who` ("vgpu:1", or (device, action), kept
        as given: formatting it on every receive would cost) only names the receiver in a Deadlock."""
        if self._spin and key not in self._items:
            deadline = time.perf_counter() + SPIN_RECEIVE_S
            while key not in self._items and not self.aborted and time.perf_counter() < deadline:
                time.sleep(POLL_NAP_S)
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                if self.aborted:
                    raise Aborted
                waiter = self._waiting[key] = threading.Lock()
                waiter.acquire()
                self._who[key] = who
                self._check_deadlock()
        if item is None:
            # blocks until put() or abort() releases it; in slices, so that the caller's thread, which may be
            # playing a device (CallerThread), runs a Ctrl-C that the kernel handed to another thread
            while not waiter.acquire(timeout=PARK_SLICE_S):
                pass
            with self._lock:
                item = self._items.pop(key, None)
            if item is None:
                raise Aborted
        value, landing = item
        if landing is not None:
            self._wait_until(landing)
        return value

    def _wait_until(self, landing: float) -> None:
        """Sleep until perf_counter() reaches `landing`. time.sleep overshoots by about 70-200 us
        on Linux, so the last 100 us are spun; sleeps are sliced to notice an abort."""
        while True:
            left = landing - time.perf_counter()
            if left <= 0:
                return
            if self.aborted:
                raise Aborted
            if left > SPIN_S:
                time.sleep(min(left - SPIN_S, 0.1))

    def finished(self) -> None:
        """A worker has run all its actions: it will send nothing more."""
        with self._lock:
            self._finished += 1
            self._check_deadlock()

    def _check_deadlock(self) -> None:
        """(Lock held.) Everyone parked or finished, someone parked: abort, saying who waits for what."""
        if self._workers is None or not self._waiting or len(self._waiting) + self._finished < self._workers:
            return
        waits = "; ".join(f"{_name(self._who.get(key))} waits for {self._describe(key)}" for key in self._waiting)
        self.failure = Deadlock(f"deadlock: every device waits for a tensor no device will send ({waits}); "
                                f"{self._finished} of {self._workers} devices had run all their actions")
        self._wake_all()

    def abort(self) -> None:
        with self._lock:
            self._wake_all()

    def _wake_all(self) -> None:
        """(Lock held.) Mark the step aborted and wake every parked receive: each then raises Aborted."""
        self.aborted = True
        waiters, self._waiting = list(self._waiting.values()), {}
        for waiter in waiters:
            waiter.release()


def _name(who) -> str:
    return " at ".join(map(str, who)) if isinstance(who, tuple) else str(who or "a receiver")


SPIN_S = 100e-6
PARK_SLICE_S = 0.05          # how long a Ctrl-C may wait for a parked receive on the caller's thread
SPIN_RECEIVE_S = 5e-3        # near-empty 1F1B: 200 us parked often (~26 us/action), 5 ms rarely (~17)
POLL_NAP_S = 10e-6           # well under a wake-up (~40 us); 5 and 20 us measured alike
