"""What one hand-off between two virtual devices costs at the least, on this machine: the floor under
`overhead.py`'s per-action figure.

    python bench/handoff.py [--hand-offs 300] [--rounds 3]

Two workers pinned to their cores, as a pipeline's are, and mpedu's Mailbox between them. The
receiver already waits for the tensor (the sender sleeps 2 ms before each send); the send stamps
the time, and the receiver reads how long after that it held the tensor. What the sender does
right after sending decides it:

  releases     sleeps 1 ms: the interpreter is free at once (a pipeline's sender entering a long
               torch operation, which lets go of it)
  python       runs Python for 0.3 ms, holding the interpreter (a sender's bookkeeping before its
               next operation)
  parked       releases, but the receiver has parked on its lock (no core to spare for polling)

The receiver needs Python's interpreter lock to see the tensor and go on: while the sender runs
Python it waits for all of it (CPython 3.11 has no way around that lock for two threads of one
process). A thread that asks for the lock while another holds it sleeps in the kernel until woken,
tens of microseconds here; the polling receiver naps between looks (mailbox.POLL_NAP_S) so that it
is rarely in that queue when the tensor comes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine, pinned_workers  # noqa: E402

from mpedu.core import Mailbox  # noqa: E402

AFTER = ("releases", "python", "parked")


def hand_offs(after: str, n: int) -> list[float]:
    """Seconds from each send to the waiting receiver holding the tensor, `n` times."""
    workers = pinned_workers(["vgpu:0", "vgpu:1"])
    mailbox = Mailbox(spin=after != "parked")

    def send():
        for i in range(n):
            time.sleep(2e-3)                        # the receiver is waiting by now
            mailbox.put(i, time.perf_counter())
            if after == "python":
                end = time.perf_counter() + 0.3e-3
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(1e-3)

    def receive():
        took = []
        for i in range(n):
            sent = mailbox.get(i)
            took.append(time.perf_counter() - sent)
        return took

    try:
        received = workers[1].submit(receive)
        workers[0].submit(send).result()
        return received.result()
    finally:
        for w in workers:
            w.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hand-offs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rounds = {after: [] for after in AFTER}
    for r in range(args.rounds):
        for after in (AFTER if r % 2 == 0 else AFTER[::-1]):
            rounds[after].append(hand_offs(after, args.hand_offs))
    print(f"send -> a waiting receiver holds the tensor, two pinned workers, {args.hand_offs} hand-offs x "
          f"{args.rounds} rounds in turn (us)")
    print(f"{'after the send, the sender':<28}{'p10':>7}{'median':>8}{'p90':>7}   round medians")
    result = {}
    for after in AFTER:
        every = [s * 1e6 for one in rounds[after] for s in one]
        deciles = statistics.quantiles(every, n=10)
        medians = [statistics.median(one) * 1e6 for one in rounds[after]]
        print(f"{after:<28}{deciles[0]:>7.0f}{statistics.median(every):>8.0f}{deciles[-1]:>7.0f}   "
              + ", ".join(f"{m:.0f}" for m in medians))
        result[after] = {"p10_us": deciles[0], "median_us": statistics.median(every), "p90_us": deciles[-1],
                         "round_medians_us": medians}
    finish("handoff", {"benchmark": "handoff", "hand_offs": args.hand_offs, "rounds": args.rounds,
                       "us": result, "machine": machine()})


if __name__ == "__main__":
    main()
