"""mpedu.distributed: placements and schedules map to torch; under torchrun, one process's results, and no hang."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_model
from mpedu.distributed import (FAIL_ENV, StageModule, _GradContiguous, check_tied_weights, choose_backend,
                               plan_schedule, rank_placement)
from mpedu.model import LSTMLM, LMConfig, nll_sum

ROOT = Path(__file__).resolve().parents[1]


# -- without processes ------------------------------------------------------------------

@pytest.mark.parametrize("schedule,ranks,expected,per_call", [
    ("gpipe", [0, 1], "ScheduleGPipe", 4),
    ("naive", [0, 1], "ScheduleGPipe", 1),            # one micro-batch per step() call, m calls
    ("1f1b", [0, 1], "Schedule1F1B", 4),
    ("1F1B", [0, 1, 2], "Schedule1F1B", 4),
    ("zb1", [0, 1], "ScheduleInterleavedZeroBubble", 4),
    ("zero-bubble", [0, 1], "ScheduleInterleavedZeroBubble", 4),
    ("gpipe", [0, 1, 0, 1], "ScheduleLoopedBFS", 4),
    ("1f1b", [0, 1, 0, 1], "ScheduleInterleaved1F1B", 4),
    ("interleaved", [0, 1, 0, 1], "ScheduleInterleaved1F1B", 4),
    ("zb1", [0, 1, 0, 1], "ScheduleInterleavedZeroBubble", 4),
])
def test_mpedu_schedules_map_to_torch_classes(schedule, ranks, expected, per_call):
    plan = plan_schedule(schedule, ranks, 4)
    assert plan.cls.__name__ == expected
    assert plan.per_call == per_call


@pytest.mark.parametrize("schedule,ranks,words", [
    ("interleaved", [0, 1], "v >= 2 stages"),
    ("gpipe", [0, 1, 0], "round-robin"),                  # 3 stages on 2 ranks: not looped
    ("zb1", [0, 1, 1, 0], "ZBV"),                         # a V: torch's ZBV cannot eval in this version
    ("wavefront", [0, 1], "unknown schedule"),
])
def test_unsupported_combinations_say_why(schedule, ranks, words):
    with pytest.raises(ValueError, match=words):
        plan_schedule(schedule, ranks, 4)


def test_device_labels_become_ranks_in_order_of_appearance():
    model = tiny_model()   # embed, lstm0-2, decode
    placement = rank_placement(model, "embed,lstm0:vgpu1 | lstm1-2:cuda:0 | decode:vgpu1", 2)
    assert placement.stage_devices == [0, 1, 0]
    assert str(placement) == "embed,lstm0:rank0 | lstm1-2:rank1 | decode:rank0"
    assert rank_placement(model, None, 2).stage_devices == [0, 1]     # even split over the world


@pytest.mark.parametrize("text,world,words", [
    ("embed,lstm0:a | lstm1-2,decode:b", 3, "rank 2 would hold no layers"),
    ("embed:a | lstm0:b | lstm1-2,decode:c", 2, "--nproc-per-node 3"),
    (None, 6, "a rank with no layers"),
    ("embed,lstm0 vgpu0 | lstm1-2,decode:b", 2, "layers:device"),
    ("embed,lstm0:a | lstm0-2,decode:b", 2, "placed twice"),
])
def test_placement_errors_name_the_fix(text, world, words):
    with pytest.raises(ValueError, match=words):
        rank_placement(tiny_model(), text, world)


def test_tied_weights_cannot_span_ranks():
    model = tiny_model(num_layers=1, embed_size=64, tie_weights=True)
    with pytest.raises(ValueError, match="tied weights"):
        check_tied_weights(model, rank_placement(model, "embed:a | lstm0,decode:b", 2))
    check_tied_weights(model, rank_placement(model, "embed,lstm0,decode:a", 1))   # one rank: fine


def test_the_incoming_gradient_is_made_contiguous():
    # gloo sends contiguous tensors only; a stage's input gradient may come out strided.
    x = torch.randn(3, 4, requires_grad=True)
    (plain,) = torch.autograd.grad(x.t(), x, torch.ones(4, 3))
    assert not plain.is_contiguous()
    (fixed,) = torch.autograd.grad(_GradContiguous.apply(x).t(), x, torch.ones(4, 3))
    assert fixed.is_contiguous() and torch.equal(fixed, plain)


def test_stage_module_takes_batch_first_tokens_and_returns_a_tensor():
    model = tiny_model()
    first = StageModule(["embed", "lstm0"], [model.layers["embed"], model.layers["lstm0"]])
    tokens = torch.randint(3, 61, (2, 5))                       # (b, T), as torch's step() splits dim 0
    out = first(tokens)
    assert out.shape == (5, 2, 64) and out.is_contiguous()      # (T, b, H) time-major
    first.fail = True
    with pytest.raises(RuntimeError, match=FAIL_ENV):
        first(tokens)


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
    with pytest.raises(RuntimeError, match=r"started 2 processes on this node and it has 1 GPU\(s\): start at "
                                           r"most 1 per node \(--nproc-per-node\) or use --backend gloo"):
        choose_backend("nccl", 2, 1)
    with pytest.raises(RuntimeError, match=r"has 0 GPU\(s\): use --backend gloo"):
        choose_backend("nccl", 1, 0)


def test_the_runner_needs_a_process_group():
    from mpedu.distributed import DistributedPipeline
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(RuntimeError, match="torchrun"):
        DistributedPipeline(tiny_model(), None, "gpipe", 2)


# -- under torchrun: 2 processes, gloo, 127.0.0.1 ------------------------------------------

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, env=None, timeout=120):
    """Run `torchrun --nproc-per-node 2 -m mpedu.distributed ARGS`; return (process, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "mpedu.distributed", *args]
    # CUDA_VISIBLE_DEVICES="": the ranks run gloo on the CPU, which the CPU tolerances below assume
    # (on a GPU machine they would pick NCCL; bench/gpu_check.py runs that case)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    if Path("/sys/class/net/lo").exists():
        environ.setdefault("GLOO_SOCKET_IFNAME", "lo")          # stay on the loopback interface
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@needs_gloo
def test_gpipe_and_1f1b_give_the_loss_and_gradients_of_one_process(tmp_path):
    proc, _ = torchrun("check", "--schedule", "gpipe,1f1b", "--micro-batches", "4", "--batch-size", "16",
                       "--placement", "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the reference, computed here from the exact weights and batch the ranks used
    init = torch.load(tmp_path / "check-init.pt")
    batch = torch.load(tmp_path / "check-batch.pt")
    model = LSTMLM(init["vocab_size"], LMConfig(**init["config"]))
    model.load_state_dict(init["state"])
    tokens = int((batch["targets"] != 0).sum())
    assert tokens < batch["targets"].numel()                       # padding is exercised
    logits, _ = model(batch["inputs"])
    loss = nll_sum(logits, batch["targets"]) / tokens
    loss.backward()
    report = json.loads((tmp_path / "check.json").read_text())
    for schedule in ("gpipe", "1f1b"):
        rank0 = torch.load(tmp_path / f"grads-{schedule}-rank0.pt")
        rank1 = torch.load(tmp_path / f"grads-{schedule}-rank1.pt")
        # each process holds only its own layers' gradients
        assert {k.split(".")[1] for k in rank0} == {"embed", "lstm0"}
        assert {k.split(".")[1] for k in rank1} == {"lstm1", "decode"}
        grads = {**rank0, **rank1}
        assert set(grads) == {name for name, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")
        assert report["schedules"][schedule]["loss"] == pytest.approx(loss.item(), rel=1e-6)
        # each rank's timeline: F and B of every micro-batch, on that rank's own stage
        events = json.loads((tmp_path / f"timeline-{schedule}.json").read_text())["events"]
        for rank in (0, 1):
            done = {(e["kind"], e["mb"]) for e in events if e["device"] == f"rank:{rank}" and e["stage"] == rank
                    and e["kind"] in "FB"}
            assert done == {(k, i) for k in "FB" for i in range(4)}


@needs_gloo
def test_train_gives_the_single_process_result(tmp_path):
    from mpedu.data import load_corpus
    from mpedu.train import load_model, train
    proc, _ = torchrun("train", "--limit-batches", "2", "--epochs", "1", "--schedule", "1f1b", "--json",
                       "--out", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["torch_schedule"] == "Schedule1F1B" and summary["world_size"] == 2
    corpus = load_corpus()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
    history = train(model, corpus, epochs=1, limit_batches=2, progress=False, log=lambda *a: None)
    for key in ("train_ppl", "valid_ppl", "test_ppl"):
        assert summary[key] == pytest.approx(history.summary()[key], rel=1e-4), key
    trained, _ = load_model(tmp_path / "model.pt")             # gathered from both ranks by rank 0
    for (name, a), b in zip(model.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert {e["device"] for e in timeline["events"]} == {"rank:0", "rank:1"}


@needs_gloo
def test_a_failing_rank_makes_every_rank_exit_soon(tmp_path):
    proc, seconds = torchrun("train", "--limit-batches", "2", "--epochs", "1", "--out", str(tmp_path),
                             "--no-progress", env={FAIL_ENV: "1"}, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert seconds < 60, f"took {seconds:.0f} s"
    assert "failure injected" in output
    # torchrun stopped the healthy rank 0 (SIGTERM) once rank 1 failed: nobody hangs, nobody exits 0
    assert "exitcode  : 0" not in output
