"""The torchrun watchdog: a silent rank is named, and every rank ends, within about a minute."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from mpedu.distributed import LIMIT, Heartbeat
from test_distributed import torchrun_job

ROOT = Path(__file__).resolve().parents[1]


def _watch(store, rank, world, limit, lines):
    """A Heartbeat whose exit is recorded instead of ending the test process."""
    exits = []
    beat = Heartbeat(rank, world, limit, store=store, say=lines.append, exit=exits.append)
    return beat, exits


def _until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def test_a_peer_that_stops_beating_is_named_and_a_beating_one_is_not():
    store = dist.HashStore()
    lines = []
    a, a_exits = _watch(store, 0, 3, 0.6, lines)
    b, b_exits = _watch(store, 1, 3, 0.6, lines)
    # rank 2 never beats: ranks 0 and 1 both name it, and neither names the other
    a.start(), b.start()
    assert _until(lambda: a_exits and b_exits, 10), lines
    assert a_exits == [1] and b_exits == [1]
    assert all("rank 2 has been silent" in line and "--heartbeat" in line for line in lines), lines
    assert not any("rank 0 has" in line or "rank 1 has" in line for line in lines)


def test_a_rank_that_finished_is_not_silent():
    store = dist.HashStore()
    lines = []
    a, a_exits = _watch(store, 0, 2, 0.5, lines)
    b, b_exits = _watch(store, 1, 2, 0.5, lines)
    a.start(), b.start()
    time.sleep(0.3)
    b.stop()                     # rank 1 is done (its files written); rank 0 goes on writing for a while
    time.sleep(1.5)
    a.stop()
    assert not a_exits and not b_exits and not lines


def test_the_default_limit_ends_a_stopped_run_well_within_two_minutes():
    # detection (LIMIT) + torchrun's 30 s grace before SIGKILL of the stopped rank
    assert 10 <= LIMIT and LIMIT + 30 <= 90


# -- under torchrun: SIGSTOP one rank ---------------------------------------------------



def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@torchrun_job
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc (Linux)")
def test_a_stopped_rank_ends_every_process_naming_it(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "mpedu.distributed", "train",
           "--epochs", "50", "--out", str(tmp_path), "--no-progress",    # long enough to be stopped mid-run
           "--heartbeat", "10"]                 # the watchdog's limit, 45 s by default, shortened
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    ranks = {}
    try:
        # training has begun once rank 0 prints its first line
        assert _until(lambda: any("mpedu.distributed train:" in line for line in output) or proc.poll() is not None,
                      120), "".join(output)
        assert proc.poll() is None, "".join(output)
        ranks = {_rank_of(k): k for k in _children(proc.pid)}
        assert set(ranks) == {0, 1}, ranks
        time.sleep(1.0)                              # inside a step
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=150)
        seconds = time.monotonic() - stopped
    finally:
        for pid in ranks.values():                   # never leave a stopped process behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    text = "".join(output)
    assert proc.returncode != 0, text
    assert not any(_running(pid) for pid in ranks.values())
    assert seconds < 120, f"took {seconds:.0f} s"
    named = [line for line in text.splitlines() if "rank 1 has been silent" in line]
    assert named and named[0].startswith("mpedu.distributed: error (rank 0)"), text
    # torchrun itself ends with its ChildFailedError summary; no rank prints a traceback of its own
    # (mpedu's own files: a checkout in a folder named mpedu holds torch's too, under mpedu/.venv)
    assert not re.search(r'File "' + re.escape(str(ROOT / "mpedu")) + r'[/\\]', text), text
    print(f"stopped rank ended the run after {seconds:.0f} s")
