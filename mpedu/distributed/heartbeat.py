"""A watchdog for torchrun ranks: every rank beats; a peer silent for `limit` seconds ends every rank at once.

Why. A collective (gloo or NCCL) waits for a silent peer until the process-group timeout,
which must be long: a slow first step, an evaluation or a checkpoint on one rank is not a
fault. A rank that is stopped (SIGSTOP, a debugger), deadlocked in the kernel, or whose
machine vanished is different: it is not slow, it is gone. Its heartbeat tells the two apart.

How. Each rank runs a daemon thread that, every `limit / 8` seconds, adds 1 to its counter
`beat/<rank>` in the rendezvous store (torchrun's TCPStore, which its agent serves, so it
outlives any one rank) and reads everyone else's counter. A counter that has not moved for
`limit` seconds of this rank's own monotonic clock (no clocks are compared across machines)
names a silent rank: this rank prints one line and exits 1. torchrun then stops the rest,
the stopped one included (SIGTERM, then SIGKILL after its grace period). A rank that
finishes sets `done/<rank>`, so a peer still writing its files never takes it for silent.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

LIMIT = 45.0            # seconds of silence that mean a peer is gone (torchrun adds up to 30 s to stop it)


class Heartbeat:
    """Start with `Heartbeat(rank, world, limit).start()`; `stop()` when this rank is done."""

    def __init__(self, rank: int, world: int, limit: float = LIMIT, *, store=None, say=None, exit=os._exit):
        self.rank, self.world, self.limit = rank, world, float(limit)
        self.period = max(0.05, self.limit / 8)
        self._store, self._say, self._exit = store, say, exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _connect(self):
        if self._store is None:   # a client of torchrun's store (MASTER_ADDR:MASTER_PORT), ours alone
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=self.limit), wait_for_workers=False)
            run = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
            self._store = dist.PrefixStore(f"mpedu-heartbeat/{run}/", store)
        return self._store

    def start(self) -> "Heartbeat":
        if self.world > 1:
            self._thread = threading.Thread(target=self._run, name="mpedu-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """This rank is done: peers stop watching it, and it stops watching them."""
        if self._thread is None:
            return
        self._stop.set()
        try:
            self._connect().set(f"done/{self.rank}", "1")
        except Exception:          # the store is gone with torchrun: nobody is left to watch us
            pass
        self._thread.join(timeout=self.period + 1)

    def _fail(self, message: str) -> None:
        line = f"mpedu.distributed: error (rank {self.rank}): {message}"
        (self._say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
        self._exit(1)

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as e:
            return self._fail(f"cannot reach torchrun's store at {os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')} for the heartbeat ({e.__class__.__name__}); stopping")
        peers = [r for r in range(self.world) if r != self.rank]
        seen = {r: (None, time.monotonic()) for r in peers}       # rank -> (last count, when it changed)
        while not self._stop.is_set():
            try:
                store.add(f"beat/{self.rank}", 1)
                for r in peers:
                    if store.check([f"done/{r}"]):
                        continue
                    count = store.add(f"beat/{r}", 0)             # reads the counter without blocking
                    last, since = seen[r]
                    if count != last:
                        seen[r] = (count, time.monotonic())
                    elif time.monotonic() - since > self.limit:
                        return self._fail(
                            f"rank {r} has been silent for {time.monotonic() - since:.0f} s (stopped, hung, or its "
                            f"machine is gone); stopping every rank. If a rank may pause that long, raise "
                            f"--heartbeat (now {self.limit:g} s)")
            except Exception as e:    # the store itself stopped answering within `limit`
                if self._stop.is_set():
                    return
                return self._fail(f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                                  f"{os.environ.get('MASTER_PORT')} stopped answering ({e.__class__.__name__}); "
                                  "torchrun, or the rank that serves the store (rank 0 without torchrun), is gone "
                                  "or stopped; stopping")
            self._stop.wait(self.period)
