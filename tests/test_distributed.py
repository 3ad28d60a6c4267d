"""mpedu.distributed's command line (cli, commands): under torchrun, one process's results, and no hang.

The package's other modules have their own test files (test_distributed_<module>.py); the torchrun
launches are here, few and each checking several things (they are slow on a small machine)."""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpedu.runtime import LOCK_NAME
from mpedu.distributed import build_parser, compare, pipeline_devices
from mpedu.lm import LSTMLM, LMConfig, nll_sum

ROOT = Path(__file__).resolve().parents[1]

HAND = """# a learner's own order for 2 devices and 4 micro-batches: stage 1 takes micro-batch 1 before 0
0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1F1 1F0 1B0 1F2 1B1 1F3 1B2 1B3
"""


# -- without processes ------------------------------------------------------------------

@pytest.mark.parametrize("argv,world,expected", [
    ([], 4, 4), (["--pipeline-devices", "2"], 4, 2), (["--devices", "2"], 2, 2),
    (["--devices", "2", "--pipeline-devices", "2"], 4, 2),
])
def test_pipeline_devices_come_from_the_options_or_the_world(argv, world, expected):
    args = build_parser().parse_args(["check", *argv])
    assert pipeline_devices(args, world) == expected


@pytest.mark.parametrize("argv,world,words", [
    (["--devices", "3"], 2, "--nproc-per-node 3"),
    (["--devices", "3", "--pipeline-devices", "2"], 4, "give one of them"),
])
def test_disagreeing_device_counts_say_what_to_do(argv, world, words):
    with pytest.raises(ValueError, match=words):
        pipeline_devices(build_parser().parse_args(["check", *argv]), world)


def test_heartbeat_and_timeout_refuse_values_that_end_every_run(capsys):
    """--heartbeat 0.001 ended every run at once ("rank 1 has been silent for 0 s"); --timeout 0.001 in C++ frames."""
    parser = build_parser()
    for option, value in (("--heartbeat", "0.001"), ("--timeout", "5")):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", option, value])
        assert f"argument {option}: expected at least" in capsys.readouterr().err
    args = parser.parse_args(["train", "--heartbeat", "0", "--timeout", "30"])
    assert (args.heartbeat, args.timeout) == (0, 30)


def test_options_a_torchrun_job_does_not_take_are_refused_in_words(capsys):
    """--resume, --bptt and the others of python -m mpedu train got argparse's "unrecognized arguments"; each now
    says why a torchrun job does not take it, and none leaves an attribute behind (the recipe reads a missing
    --bptt as "no stream mode")."""
    from mpedu.distributed import NOT_OFFERED
    parser = build_parser()
    for option in NOT_OFFERED:
        with pytest.raises(SystemExit):
            parser.parse_args(["train", option, "1"] if option != "--resume" else ["train", option])
        assert f"{option} is not offered under torchrun: " in capsys.readouterr().err
    args = parser.parse_args(["train", "--config", "small"])
    assert not any(hasattr(args, option[2:].replace("-", "_")) for option in NOT_OFFERED)


def test_the_check_fails_when_one_replica_differs():
    ref = {"a": torch.ones(3), "b": torch.zeros(2)}
    same = [{"a": torch.ones(3)}, {"b": torch.zeros(2)}, {"a": torch.ones(3)}, {"b": torch.zeros(2)}]
    assert compare(same, ref, 1.0, 1.0, 1e-5, 1e-7)[0]
    off = [dict(part) for part in same]
    off[2] = {"a": torch.tensor([1.0, 1.0, 1.001])}      # replica 1's copy of "a" drifted
    equal, line, entry = compare(off, ref, 1.0, 1.0, 1e-5, 1e-7)
    assert not equal and "DIFFERENT" in line and entry["worst_parameter"] == "a"
    assert not compare(same[:1], ref, 1.0, 1.0, 1e-5, 1e-7)[0]          # no gradient for "b"
    assert not compare(same, ref, 1.01, 1.0, 1e-5, 1e-7)[0]             # the loss differs


# -- under torchrun: 2 processes, gloo, 127.0.0.1 ------------------------------------------

def torchrun_job(test):
    """A test that starts torchrun jobs (gloo on 127.0.0.1; about 14 s of CPU each to start): skipped without
    gloo, and marked `torchrun`, so that -m "not torchrun" leaves them out of a quick run."""
    no_gloo = not dist.is_available() or not dist.is_gloo_available()
    return pytest.mark.torchrun(pytest.mark.skipif(no_gloo, reason="torch.distributed with gloo is missing")(test))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, env=None, timeout=120, processes=2, script=None):
    """Run `torchrun --nproc-per-node PROCESSES -m mpedu.distributed ARGS` (or the Python file `script` with
    ARGS); return (process, seconds)."""
    target = [str(script)] if script is not None else ["-m", "mpedu.distributed"]
    target += args
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(processes),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *target]
    # CUDA_VISIBLE_DEVICES="": the ranks run gloo on the CPU, which the CPU tolerances below assume
    # (on a GPU machine they would pick NCCL; bench/gpu_check.py runs that case)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    if Path("/sys/class/net/lo").exists():
        environ.setdefault("GLOO_SOCKET_IFNAME", "lo")          # stay on the loopback interface
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def assert_trained_as_one_process(summary, model_file):
    """A torchrun job's perplexities and gathered weights (rank 0 writes every rank's layers) equal one process
    training the tiny model for the same 2 batches."""
    from mpedu.training import load_model
    from mpedu.lm import load_corpus
    from mpedu.training import train
    corpus = load_corpus()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
    history = train(model, corpus, epochs=1, limit_batches=2, progress=False, log=lambda *a: None)
    for key in ("train_ppl", "valid_ppl", "test_ppl"):
        assert summary[key] == pytest.approx(history.summary()[key], rel=1e-4), key
    trained, _ = load_model(model_file)
    for (name, a), b in zip(model.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


@torchrun_job
def test_gpipe_1f1b_and_a_hand_written_schedule_give_the_loss_and_gradients_of_one_process(tmp_path):
    (tmp_path / "mine.txt").write_text(HAND)      # run as written: mpedu validates it, torch's runtime plays it
    proc, _ = torchrun("check", "--schedule", f"gpipe,1f1b,{tmp_path / 'mine.txt'}", "--micro-batches", "4",
                       "--batch-size", "16", "--placement", "embed,lstm0:vgpu0 | lstm1,decode:vgpu1",
                       "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to one process: 3 schedule(s)" in proc.stdout
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
    for schedule in ("gpipe", "1f1b", "mine"):
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
        events = json.loads((tmp_path / f"check-{schedule}.timeline.json").read_text())["events"]
        for rank in (0, 1):
            done = {(e["kind"], e["mb"]) for e in events if e["device"] == f"rank:{rank}" and e["stage"] == rank
                    and e["kind"] in "FB"}
            assert done == {(k, i) for k in "FB" for i in range(4)}
    # the hand-written order ran as written (torch's runtime read its losses back by position: backward 0
    # started from micro-batch 1's loss, and rank 0's gradients were 40-57% off)
    events = json.loads((tmp_path / "check-mine.timeline.json").read_text())["events"]
    rank1 = [f"{e['stage']}{e['kind']}{e['mb']}" for e in sorted(events, key=lambda e: e["start"])
             if e["device"] == "rank:1" and e["kind"] in "FB"]
    assert rank1 == HAND.splitlines()[2].split()


@torchrun_job
def test_train_gives_the_single_process_result(tmp_path):
    # --runtime torch: PyTorch's own Schedule1F1B (the 4-process test below trains with mpedu's action lists)
    proc, _ = torchrun("train", "--limit-batches", "2", "--epochs", "1", "--schedule", "1f1b", "--json",
                       "--out", str(tmp_path), "--no-progress", "--runtime", "torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["torch_schedule"] == "Schedule1F1B" and summary["world_size"] == 2
    assert_trained_as_one_process(summary, tmp_path / "model.pt")
    timeline = json.loads((tmp_path / "last_step.timeline.json").read_text())
    assert {e["device"] for e in timeline["events"]} == {"rank:0", "rank:1"}


def one_process_gradients(out: Path):
    """The loss and gradients of the whole model in this process, from the weights and batch a `check --out`
    job saved (check-init.pt, check-batch.pt)."""
    init, batch = torch.load(out / "check-init.pt"), torch.load(out / "check-batch.pt")
    model = LSTMLM(init["vocab_size"], LMConfig(**init["config"]))
    model.load_state_dict(init["state"])
    logits, _ = model(batch["inputs"])
    loss = nll_sum(logits, batch["targets"]) / int((batch["targets"] != 0).sum())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@torchrun_job
def test_zbv_and_dualpipev_run_the_v_with_the_loss_gradients_and_training_of_one_process(tmp_path):
    # no --placement: the V, rank 0 holding stages 0 (embed) and 3 (decode), rank 1 stages 1 and 2 (the LSTMs)
    proc, _ = torchrun("check", "--schedule", "zbv,dualpipev", "--micro-batches", "4", "--batch-size", "16",
                       "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to one process: 2 schedule(s)" in proc.stdout
    loss, want = one_process_gradients(tmp_path)
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["placement"] == "embed:rank0 | lstm0:rank1 | lstm1:rank1 | decode:rank0"
    zbv = {0: "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3",
           1: "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3"}
    for schedule in ("zbv", "dualpipev"):
        rank0 = torch.load(tmp_path / f"grads-{schedule}-rank0.pt")
        rank1 = torch.load(tmp_path / f"grads-{schedule}-rank1.pt")
        assert {k.split(".")[1] for k in rank0} == {"embed", "decode"}        # each rank: its two stages
        assert {k.split(".")[1] for k in rank1} == {"lstm0", "lstm1"}
        grads = {**rank0, **rank1}
        assert set(grads) == set(want)
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")
        assert report["schedules"][schedule]["loss"] == pytest.approx(loss, rel=1e-6)
        events = json.loads((tmp_path / f"check-{schedule}.timeline.json").read_text())["events"]
        for rank in (0, 1):
            ran = [f"{e['stage']}{e['kind']}{e['mb']}" for e in sorted(events, key=lambda e: e["start"])
                   if e["device"] == f"rank:{rank}" and e["kind"] in "FBW"]
            assert sorted(ran) == sorted(f"{s}{k}{i}" for s in (rank, 3 - rank) for k in "FBW" for i in range(4))
            if schedule == "zbv":                                   # mpedu's order, as torch's runtime played it
                assert " ".join(ran) == zbv[rank]
    # and train: 2 steps of zbv, then evaluation (where rank 1's two stages hand over no gradient), as one process
    proc, _ = torchrun("train", "--schedule", "zbv", "--limit-batches", "2", "--epochs", "1", "--json",
                       "--out", str(tmp_path / "train"), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["schedule"], summary["placement"]) == ("zbv", report["placement"])
    assert_trained_as_one_process(summary, tmp_path / "train" / "model.pt")


TIED_CLIP = """
import torch, torch.distributed as dist
from mpedu.distributed import DistributedPipeline, setup
from mpedu.lm import LSTMLM, LMConfig
setup("gloo")
from mpedu.lm import Batch
torch.manual_seed(0)
model = LSTMLM(50, LMConfig(embed_size=16, hidden_size=16, num_layers=2, tie_weights=True))
reference = LSTMLM(50, LMConfig(embed_size=16, hidden_size=16, num_layers=2, tie_weights=True))
reference.load_state_dict(model.state_dict())
g = torch.Generator().manual_seed(1)
targets = torch.randint(3, 50, (6, 4), generator=g)
batch = Batch(torch.randint(3, 50, (6, 4), generator=g), targets, targets != 0, int((targets != 0).sum()), False)
pipe = DistributedPipeline(model, "embed:a | lstm0:b | lstm1,decode:a", "gpipe", 2, width=4, clip=0.01)
pipe.train_step(batch)
mine = pipe.owned_grads()
if dist.get_rank() == 0:
    from mpedu.core import SingleDevice
    SingleDevice(reference).train_step(batch)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    want = dict(reference.named_parameters())
    worst = max(float(((g - want[n].grad).abs().max() / want[n].grad.abs().max())) for n, g in mine.items())
    print("tied", "layers.embed.embedding.weight" in mine, "worst", worst)
pipe.close()
dist.destroy_process_group()
"""


NAN_CASES = ("weight", "gradient", "clipped")
NAN_WEIGHT = """
import sys
import torch, torch.distributed as dist
from mpedu.distributed import DistributedPipeline, setup
from mpedu.lm import load_corpus
from mpedu.training import NumericFault
from mpedu.lm import LSTMLM
from mpedu.training import train
setup("gloo")
corpus = load_corpus()
for CASE in CASES_HERE:                  # one job, case after case: a torchrun job costs ~14 s of CPU to start
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
    pipe = DistributedPipeline(model, "embed,lstm0:a | lstm1,decode:b", "gpipe", 2, width=16,
                               clip=None if CASE == "gradient" else 0.25)
    if CASE == "clipped" and dist.get_rank() == 0:     # rank 0's gradient overflows, then the clip spreads it
        model.layers["lstm0"].lstm.weight_hh_l0.register_hook(lambda g: g * float("inf"))
    if CASE != "clipped" and dist.get_rank() == 1:
        weight = model.layers["lstm1"].lstm.weight_hh_l0
        if CASE == "weight":
            with torch.no_grad():
                weight[0, 0] = float("nan")
        else:                      # a gradient overflows on rank 1 only; the loss stays finite
            weight.register_hook(lambda g: g * float("inf"))
    try:
        train(model, corpus, runner=pipe, epochs=1, batch_size=16, limit_batches=2, progress=False,
              log=lambda *a: None)
    except NumericFault as e:
        # one write per line: the ranks share torchrun's unbuffered stdout, and a print writes its newline
        # apart, so another rank's line could land between the two
        sys.stdout.write(f"{CASE}: rank {dist.get_rank()} fault {e.layer} stage {e.stage}: {e}\\n")
    pipe.close()
    dist.barrier()                 # both ranks are done with this case before the next one's pipeline
dist.destroy_process_group()
"""


def _run_script(tmp_path, text: str):
    """torchrun on 2 processes of the Python program `text`."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return torchrun(script=script)[0]


@torchrun_job
def test_every_rank_names_the_layer_a_nan_came_from(tmp_path):
    """A NaN weight in lstm1 on rank 1: rank 0 looked at its own stale copy of lstm1 and blamed lstm0's gradient
    (the clip had spread the NaN there); now each rank searches its own layers and all name the same one. A
    gradient that overflows on rank 1 alone (the loss finite, no clip) fails the step on rank 0 too, which
    would otherwise step on and wait for rank 1. One that overflows on rank 0 under the clip: rank 1 blamed
    its own decode, into which the clip's all-reduce had spread the NaN."""
    proc = _run_script(tmp_path, NAN_WEIGHT.replace("CASES_HERE", repr(NAN_CASES)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for case in NAN_CASES:
        what = "its weight (\\S+) holds 1 nan" if case == "weight" else "the gradient of (\\S+) holds"
        found = sorted(re.findall(rf"^{case}: rank (\d) fault (\w+) stage \d: .*?First non-finite: layer \w+ "
                                  r"\(stage \d on rank:\d\): " + what, proc.stdout, flags=re.MULTILINE))
        if case == "clipped":        # the overflow reaches the layer's other weights in the same backward
            found = [(rank, layer, "lstm.weight_hh_l0") for rank, layer, _ in found]
        layer = "lstm0" if case == "clipped" else "lstm1"
        assert found == [("0", layer, "lstm.weight_hh_l0"), ("1", layer, "lstm.weight_hh_l0")], (case, proc.stdout)
    clipped = [line for line in proc.stdout.splitlines() if line.startswith("clipped:")]
    assert any("the clip (now 0.25)" in line for line in clipped), proc.stdout


FROZEN_RANK = """
import torch, torch.distributed as dist
from mpedu.distributed import DistributedPipeline, setup
from mpedu.lm import load_corpus
from mpedu.lm import LSTMLM
from mpedu.training import train
setup("gloo", timeout=60)
corpus = load_corpus()
torch.manual_seed(0)
model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
for name in ("embed", "lstm0"):                    # rank 0 holds no gradient at all
    model.layers[name].requires_grad_(False)
pipe = DistributedPipeline(model, "embed,lstm0:a | lstm1,decode:b", "gpipe", 4, width=32)
if dist.get_rank() == 1:                           # lstm1's gradient overflows in the first step only
    calls = []
    model.layers["lstm1"].lstm.weight_hh_l0.register_hook(lambda g: calls.append(1) or (g * float("inf")
                                                                                       if len(calls) == 1 else g))
history = train(model, corpus, runner=pipe, epochs=1, batch_size=32, limit_batches=3, progress=False,
                skip_bad_batches=True, log=lambda *a: None)
print(f"rank {dist.get_rank()} skipped {history.summary()['skipped_batches']}", flush=True)
pipe.close()
dist.destroy_process_group()
"""


@torchrun_job
def test_a_rank_without_gradients_skips_the_batch_the_others_cannot_step_on(tmp_path):
    """Rank 0's layers are all frozen, so it holds no gradient in which another rank's NaN could show: it stepped
    on while rank 1 skipped, and both waited for each other until the timeout. The step's result now says
    whether every rank's gradients were finite."""
    proc = _run_script(tmp_path, FROZEN_RANK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d) skipped (\d)", proc.stdout)) == [("0", "1"), ("1", "1")], proc.stdout


SKIP_ONE = """
import os, sys
from mpedu.distributed import cli
from mpedu.lm import LSTMLM
made = LSTMLM.from_config
def from_config(name, vocab_size, **overrides):   # rank 1's lstm1 gradient overflows in the first step only
    model = made(name, vocab_size, **overrides)
    if os.environ["RANK"] == "1":
        calls = []
        def hook(g):
            calls.append(1)
            return g * float("inf") if len(calls) == 1 else g
        model.layers["lstm1"].lstm.weight_hh_l0.register_hook(hook)
    return model
LSTMLM.from_config = from_config
sys.exit(cli.main(["train", "--skip-bad-batches", "--limit-batches", "3", "--epochs", "1", "--json",
                   "--no-progress", "--out", sys.argv[1]]))
"""


@torchrun_job
def test_skip_bad_batches_under_torchrun_skips_on_every_rank_and_trains_on(tmp_path):
    """--skip-bad-batches (once refused under torchrun): a gradient that overflows on rank 1 alone skips that
    batch on both ranks, which step on together through the other two batches and exit 0."""
    script = tmp_path / "skip.py"
    script.write_text(SKIP_ONE)
    proc, _ = torchrun(str(tmp_path / "out"), script=script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped batch 0 of epoch 1 (step 1)" in proc.stdout, proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["skipped_batches"] == 1 and summary["steps"] == 2, summary
    assert (tmp_path / "out" / "model.pt").is_file()


@torchrun_job
def test_a_weight_tied_on_one_rank_is_clipped_once(tmp_path):
    """embed and decode share a weight on rank 0 (stages 0 and 2): the clip counted it twice in the norm and
    scaled its gradient twice (0.96 relative error against one process)."""
    proc = _run_script(tmp_path, TIED_CLIP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("tied"))
    assert line.startswith("tied True") and float(line.split()[-1]) < 1e-5, line


@torchrun_job
def test_train_keeps_the_recipes_decay_refuses_a_bad_out_first_and_says_when_it_diverged(tmp_path):
    # small's recipe: lr 20, divided by 2 after each epoch from epoch 4 on (the halving rule ran instead)
    proc, _ = torchrun("train", "--config", "small", "--epochs", "5", "--limit-batches", "1", "--out",
                       str(tmp_path / "small"), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lrs = [float(re.search(r" lr (\S+)", line).group(1))
           for line in proc.stdout.splitlines() if line.startswith("epoch")]
    assert lrs == [20, 20, 20, 20, 10], proc.stdout
    # --out a file: every rank stops before training (it trained to the end, then lost the weights)
    (tmp_path / "afile").write_text("x")
    proc, _ = torchrun("train", "--limit-batches", "2", "--epochs", "1", "--out", str(tmp_path / "afile"),
                       "--no-progress")
    assert proc.returncode != 0 and "is a file, not a folder" in proc.stderr
    assert not [line for line in proc.stdout.splitlines() if line.startswith("epoch")], proc.stdout
    assert proc.stderr.count("mpedu.distributed: error (rank") == 2, proc.stderr
    # a diverged run exits 1 and says so (it exited 0 with infinite perplexities)
    proc, _ = torchrun("train", "--limit-batches", "4", "--epochs", "1", "--lr", "1e7", "--clip", "0", "--out",
                       str(tmp_path / "nan"), "--no-progress")
    assert proc.returncode != 0 and "training diverged" in proc.stderr, proc.stdout + proc.stderr


@torchrun_job
def test_a_failing_rank_makes_every_rank_exit_soon(tmp_path):
    proc, seconds = torchrun("1", "train", "--limit-batches", "2", "--epochs", "1", "--out", str(tmp_path),
                             "--no-progress", script=ROOT / "tests" / "failing_rank.py", timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert seconds < 60, f"took {seconds:.0f} s"
    assert "failure injected" in output
    # torchrun stopped the healthy rank 0 (SIGTERM) once rank 1 failed: nobody hangs, nobody exits 0
    assert "exitcode  : 0" not in output


# -- under torchrun: 4 processes = 2 replicas x a 2-rank pipeline --------------------------

@torchrun_job
def test_two_replicas_of_a_two_stage_pipeline_check_equal_to_one_process(tmp_path):
    from mpedu.lm import Batch
    from mpedu.core import SingleDevice
    proc, _ = torchrun("check", "--pipeline-devices", "2", "--schedule", "1f1b,zb1", "--micro-batches", "4",
                       "--batch-size", "16", "--dropout", "0.3", "--seed", "1", "--out", str(tmp_path),
                       processes=4, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal to one process: 2 schedule(s) on 4 processes (2 replica(s) x 2 pipeline ranks)" in proc.stdout
    # the reference, computed here: one process on the whole batch, with the same dropout masks
    init, saved = torch.load(tmp_path / "check-init.pt"), torch.load(tmp_path / "check-batch.pt")
    model = LSTMLM(init["vocab_size"], LMConfig(**init["config"]))
    model.load_state_dict(init["state"])
    one = SingleDevice(model)
    one.dropout_seed = init["seed"]
    batch = Batch(saved["inputs"], saved["targets"], saved["targets"] != 0, saved["inputs"].shape[0], False)
    loss = one.train_step(batch).loss
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["pipeline_devices"] == 2 and report["world_size"] == 4
    for schedule in ("1f1b", "zb1"):
        assert report["schedules"][schedule]["loss"] == pytest.approx(loss, rel=1e-6)
        grads = [torch.load(tmp_path / f"grads-{schedule}-rank{r}.pt") for r in range(4)]
        # rank r holds pipeline rank r % 2 of replica r // 2; after the all-reduce both replicas hold the
        # gradient of the whole batch, not of their half
        for r, part in enumerate(grads):
            assert {k.split(".")[1] for k in part} == ({"embed", "lstm0"} if r % 2 == 0 else {"lstm1", "decode"})
            for name, g in part.items():
                torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-7,
                                           msg=f"{schedule} rank {r} {name}")
        timeline = json.loads((tmp_path / f"check-{schedule}.timeline.json").read_text())
        assert timeline["devices"] == [f"rank:{r}" for r in range(4)]
        assert sorted(e["device"] for e in timeline["events"] if e["kind"] == "allreduce") == timeline["devices"]
        assert report["schedules"][schedule]["all_reduces"] == 4


@torchrun_job
def test_two_replicas_train_as_one_process_on_the_whole_batch(tmp_path):
    proc, _ = torchrun("train", "--pipeline-devices", "2", "--limit-batches", "2", "--epochs", "1", "--json",
                       "--out", str(tmp_path), "--no-progress", processes=4, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["replicas"], summary["pipeline_devices"], summary["world_size"]) == (2, 2, 4)
    assert summary["runtime"] == "mpedu" and summary["torch_schedule"] == "_PipelineScheduleRuntime"
    assert_trained_as_one_process(summary, tmp_path / "model.pt")
    # one picture of the last step: four rows, each with its all-reduce after its backwards
    timeline = json.loads((tmp_path / "last_step.timeline.json").read_text())
    assert timeline["devices"] == [f"rank:{r}" for r in range(4)]
    for r in range(4):
        mine = [e for e in timeline["events"] if e["device"] == f"rank:{r}"]
        [reduce] = [e for e in mine if e["kind"] == "allreduce"]
        assert reduce["start"] >= max(e["end"] for e in mine if e["kind"] == "B")
    # the rows share one clock (rank 0's, as every process on one machine reads it): a collective ends on
    # no rank before its partner began it, and no stage starts a micro-batch before it was sent to it
    reduces = {e["device"]: e for e in timeline["events"] if e["kind"] == "allreduce"}
    for a, b in (("rank:0", "rank:2"), ("rank:1", "rank:3")):
        assert reduces[a]["end"] >= reduces[b]["start"] and reduces[b]["end"] >= reduces[a]["start"], reduces
    for send in (e for e in timeline["events"] if e["kind"] == "send" and e["stage"] == 0):
        [consumer] = [e for e in timeline["events"] if e["device"] == send["peer"] and e["kind"] == "F"
                      and e["mb"] == send["mb"]]
        assert consumer["start"] >= send["start"], (send, consumer)
    assert (tmp_path / "last_step.png").stat().st_size > 0


CLIP_AND_FROZEN = """
import torch, torch.distributed as dist
from mpedu.distributed import DistributedPipeline, setup
from mpedu.lm import load_corpus
from mpedu.lm import LSTMLM
from mpedu.training import train
setup("gloo")
corpus = load_corpus()
FROZEN = dist.get_world_size() == 4          # 2 replicas x 2 stages, stage 0 frozen: no gradient to all-reduce
def build():
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
    for name in ("embed", "lstm0") if FROZEN else ():
        model.layers[name].requires_grad_(False)
    return model
quiet = dict(epochs=1, batch_size=32, limit_batches=2, progress=False, log=lambda *a: None, clip=0.01)
model = build()
pipe = DistributedPipeline(model, "embed,lstm0:a | lstm1,decode:b", "gpipe", 4, width=32,
                           pipeline_devices=2)   # no clip here: train's clip=0.01 goes over both ranks
train(model, corpus, runner=pipe, **quiet)
state = pipe.gather_state_dict()
if dist.get_rank() == 0:
    reference = build()
    train(reference, corpus, **quiet)
    worst = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())
    print(f"worst {worst:.3g}", flush=True)
pipe.close()
dist.destroy_process_group()
"""


@torchrun_job
@pytest.mark.parametrize("processes", [2, 4])
def test_train_clips_over_every_rank_and_a_frozen_stage_needs_no_all_reduce(tmp_path, processes):
    """train(..., clip=0.01, runner=pipe) clipped each rank's own layers by their own norm (weights 0.08 off one
    process); it clips over all ranks now. With 2 replicas of a pipeline whose first stage is frozen, that
    stage's ranks have no gradient to all-reduce (torch.cat of nothing failed)."""
    script = tmp_path / "script.py"
    script.write_text(CLIP_AND_FROZEN)
    proc, _ = torchrun(script=script, processes=processes, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    worst = float(re.search(r"worst (\S+)", proc.stdout).group(1))
    assert worst < 1e-5, proc.stdout


DIFFERENT = """
import os, sys
from mpedu.distributed import cli
argv = ["train", "--limit-batches", "2", "--epochs", "1", "--no-progress", "--out", sys.argv[1]]
sys.exit(cli.main(argv + (["--lr", "0.001"] if os.environ["RANK"] == "1" else [])))
"""


@torchrun_job
def test_ranks_started_with_different_options_are_refused_before_training(tmp_path):
    """Each machine types its own command: rank 1's --lr 0.001 trained silently with it while rank 0 reported
    10 (a different --seed broke a collective with a C++ abort). Every rank now compares, and all refuse."""
    script = tmp_path / "different.py"
    script.write_text(DIFFERENT)
    proc, _ = torchrun(str(tmp_path / "out"), script=script)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"error (rank {rank}): the ranks were started with different --lr (rank 0: 10.0; rank 1: 0.001)"
                in proc.stderr), proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()
    # a folder holding a one-process run's checkpoint: that run's --resume would overwrite this job's model.pt
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "checkpoint.pt").write_bytes(b"a run of python -m mpedu train")
    proc, _ = torchrun("train", "--limit-batches", "1", "--epochs", "1", "--out", str(tmp_path / "single"))
    assert proc.returncode != 0 and "holds the checkpoint.pt of a python -m mpedu train run" in proc.stderr, \
        proc.stderr
    assert sorted(p.name for p in (tmp_path / "single").iterdir() if p.name != LOCK_NAME) == ["checkpoint.pt"]


ORIGINS = """
import time, torch.distributed as dist
from mpedu.distributed import setup
from mpedu.distributed.timing import shared_origin
setup("gloo")
origins = [None] * dist.get_world_size()
for same_host in (True, False):                  # False: the estimate across machines, here on one
    dist.all_gather_object(origins, shared_origin(same_host=same_host))
    if dist.get_rank() == 0:
        print(f"same_host={same_host} spread {max(origins) - min(origins):.6f}", flush=True)
dist.destroy_process_group()
"""


@torchrun_job
def test_every_rank_finds_one_origin_on_either_path(tmp_path):
    """On one machine the origins are the same reading of the shared monotonic clock; estimated as across
    machines (rank 0's clock broadcast, the least arrival gap), they land within a few milliseconds of it."""
    proc = _run_script(tmp_path, ORIGINS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spreads = dict(re.findall(r"same_host=(\w+) spread (\S+)", proc.stdout))
    assert float(spreads["True"]) == 0.0 and 0.0 <= float(spreads["False"]) < 0.01, proc.stdout


DIFFERENT_DATA = """
import os, sys
from mpedu.distributed import cli
import mpedu.lm.data
load = mpedu.lm.data.load_corpus
def reversed_on_rank_1(*args, **kwargs):         # the same words, sentences in another order: another corpus
    corpus = load(*args, **kwargs)
    if os.environ["RANK"] == "1":
        corpus.train = corpus.train[::-1]
    return corpus
mpedu.lm.data.load_corpus = reversed_on_rank_1
sys.exit(cli.main(["train", "--limit-batches", "1", "--epochs", "1", "--no-progress", "--out", sys.argv[1]]))
"""


@torchrun_job
def test_ranks_with_the_same_words_in_another_order_are_refused(tmp_path):
    """The data's digest covered its words and sizes only: a corpus with the same words in another order passed,
    and rank 1 scored rank 0's inputs against other targets. Every token id counts now."""
    script = tmp_path / "data.py"
    script.write_text(DIFFERENT_DATA)
    proc, _ = torchrun(str(tmp_path / "out"), script=script)
    assert proc.returncode != 0, proc.stderr
    assert "the ranks were started with different data (rank 0: 3,289 words, sha256" in proc.stderr, proc.stderr

