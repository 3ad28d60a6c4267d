"""mpedu.distributed.group: every rank of a node picks the same backend; the runner needs a process group."""
import pytest
import torch.distributed as dist

from conftest import tiny_model
from mpedu.distributed import DistributedPipeline, choose_backend


@pytest.mark.parametrize("processes,gpus,expected", [
    (2, 0, "gloo"),
    (2, 1, "gloo"),     # two processes on one GPU: gloo for both (per-rank choice gave rank 0 NCCL: a hang)
    (2, 2, "nccl"),
    (2, 8, "nccl"),
    (4, 2, "gloo"),
])
def test_every_rank_of_a_node_chooses_the_same_backend(processes, gpus, expected):
    # what each local rank decides sees only what all of them see alike
    assert {choose_backend("auto", processes, gpus) for _ in range(processes)} == {expected}
    assert choose_backend("gloo", processes, gpus) == "gloo"


def test_nccl_with_more_processes_than_gpus_says_what_to_do():
    with pytest.raises(ValueError, match=r"started 2 processes on this node and it has 1 GPU\(s\): start at "
                                           r"most 1 per node \(--nproc-per-node\) or use --backend gloo"):
        choose_backend("nccl", 2, 1)
    with pytest.raises(ValueError, match=r"has 0 GPU\(s\): use --backend gloo"):
        choose_backend("nccl", 1, 0)


def test_the_runner_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(RuntimeError, match="torchrun"):
        DistributedPipeline(tiny_model(), None, "gpipe", 2)


def test_a_worker_ends_with_its_torchrun_only(monkeypatch, capsys):
    # a process whose parent is PID 1 ended itself without a word, torchrun or not (tini, docker --init, a
    # scheduler that sets RANK itself); now only a torchrun worker (TORCHELASTIC_RUN_ID) orphaned says so and ends
    import os
    import sys
    from mpedu.distributed import group
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    killed = []
    monkeypatch.setattr(os, "getppid", lambda: 1)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(group.Path, "read_bytes", lambda self: b"/sbin/init")
    import ctypes
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: type("libc", (), {"prctl": staticmethod(lambda *a: 0)})())
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    group._end_with_the_launcher()
    assert killed == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")
    group._end_with_the_launcher()
    assert len(killed) == 1 and "rank 1: the torchrun that started this process has gone" in capsys.readouterr().err


def test_a_rank_whose_peer_went_silent_says_the_peer_may_be_stopped_or_gone(monkeypatch, capsys):
    # what rank 0 prints when the backend gives up on a peer (--timeout, no heartbeat): the silent rank says
    # nothing itself (stopped by Ctrl-Z or a debugger, or killed), so this line must say it may be
    import mpedu.distributed.cli as dcli
    import mpedu.distributed.commands as commands

    def peer_gone(args):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(commands, "run_train", peer_gone)
    assert dcli.main(["train", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpedu.distributed: error (rank 0): talking to the other ranks failed (RuntimeError: ")
    assert "a rank that says nothing may be stopped, e.g. by Ctrl-Z or a debugger, or gone" in err


def test_a_long_refusal_under_torchrun_is_cut_like_the_threads_commands(monkeypatch, capsys):
    import mpedu.distributed.cli as dcli
    import mpedu.distributed.commands as commands

    def huge(args):
        raise ValueError("0B3: appears twice\n" + "   dev 0 " + " 0F1" * 50_000)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(commands, "run_train", huge)
    assert dcli.main(["train", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpedu.distributed: error (rank 1): 0B3: appears twice") and len(err) < 2_200
    assert "(200,028 characters)" in err


def test_ranks_compare_schedule_files_by_content_and_show_a_digest_not_the_text(tmp_path):
    from mpedu.distributed.commands import _content
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("0F0 0B0\n1F0 1B0\n")
    b.write_text("0F0 0B0\n1F0 1B0\n")
    assert _content(str(a)) == _content(str(b))                     # paths differ between machines
    assert _content(str(a)).startswith("a file of 3 lines, sha256 ") and "0F0" not in _content(str(a))
    b.write_text("0F0 0B0\n1F0 1B0 \n")
    assert _content(str(a)) != _content(str(b)) and _content("gpipe") == "gpipe"
