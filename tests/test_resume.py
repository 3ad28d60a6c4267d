"""Resuming: exactly after an epoch or mid-epoch, after kill -9 at any moment, on another placement."""
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mpedu.cli.commands as cli
from conftest import lm, quiet
from mpedu.lm import BucketIterator
from mpedu.training import load_checkpoint, load_model, train
from mpedu.core import Pipeline, SingleDevice


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


ROOT = Path(__file__).resolve().parents[1]


TWO = "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"          # the tiny config has lstm0, lstm1


OTHER_TWO = "embed:vgpu0 | lstm0,lstm1,decode:vgpu1"


RUN = dict(batch_size=16, lr=5.0, seed=3, checkpoint_every=3)


TIMING = {"seconds", "tokens_per_s", "train_seconds", "bubble_fraction"}   # measured, not computed


def computed(history: dict) -> dict:
    return {"epochs": [{k: v for k, v in e.items() if k not in TIMING} for e in history["epochs"]],
            "test_ppl": history["test_ppl"]}


# ---------------------------------------------------------------- resume in process

def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_run(a, b, model_a, model_b):
    for key in ("train_ppl", "valid_ppl", "lr", "tokens", "steps"):
        assert [e[key] for e in a.epochs] == [e[key] for e in b.epochs], key
    assert a.test_ppl == b.test_ppl
    pa, pb = params(model_a), params(model_b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


EXACT_RUN = dict(batch_size=16, lr=5.0, seed=7, checkpoint_every=4)


def test_resume_after_an_epoch_equals_an_uninterrupted_run(little, tmp_path):
    straight = lm(little, dropout=0.3)  # dropout: the restored RNG state matters
    h_straight = train(straight, little, epochs=3, out=tmp_path / "a", **quiet(**EXACT_RUN))

    train(lm(little, dropout=0.3), little, epochs=1, out=tmp_path / "b", **quiet(**EXACT_RUN))
    resumed = lm(little, seed=99, dropout=0.3)  # another init: the checkpoint must overwrite it
    h_resumed = train(resumed, little, epochs=3, out=tmp_path / "b", resume=True, **quiet(**EXACT_RUN))
    assert_same_run(h_straight, h_resumed, straight, resumed)


def test_resume_mid_epoch_equals_an_uninterrupted_run(little, tmp_path):
    straight = lm(little, dropout=0.3)
    h_straight = train(straight, little, epochs=2, out=tmp_path / "a", **quiet(**EXACT_RUN))

    per_epoch = len(BucketIterator(little.train, EXACT_RUN["batch_size"]))

    class Crash(SingleDevice):
        steps = 0

        def train_step(self, batch):
            Crash.steps += 1
            if Crash.steps == per_epoch + 7:  # epoch 2, batch 7: the last checkpoint is at batch 4
                raise RuntimeError("simulated crash")
            return super().train_step(batch)

    model = lm(little, dropout=0.3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, little, runner=Crash(model), epochs=2, out=tmp_path / "b", **quiet(**EXACT_RUN))
    position = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["position"]
    assert (position["epoch"], position["batch"]) == (1, 4)

    resumed = lm(little, seed=99, dropout=0.3)
    h_resumed = train(resumed, little, epochs=2, out=tmp_path / "b", resume=True, **quiet(**EXACT_RUN))
    assert_same_run(h_straight, h_resumed, straight, resumed)


STREAM_RUN = dict(batch_size=8, lr=5.0, seed=7, checkpoint_every=3, bptt=6, limit_batches=8)


@pytest.mark.parametrize("first,then", [("one device", "one device"), ("pipeline", "pipeline"),
                                        ("pipeline", "one device"), ("pipeline m=3", "pipeline m=3"),
                                        ("pipeline m=3", "one device"), ("one device", "pipeline m=3")])
def test_a_stream_mode_resume_mid_epoch_equals_an_uninterrupted_run(little, tmp_path, first, then):
    """Stream mode (--bptt) carries the LSTM state from batch to batch: a mid-epoch checkpoint keeps the state the
    next batch starts from, per layer over the whole batch width, so the resume goes on bit for bit (it started
    the state afresh: weights off by up to 0.1), and on another runner too (to float rounding). 3 micro-batches
    do not divide the 8 columns: the pipeline's batches are 9 wide (an empty column), its state was saved 9 wide,
    and one device then started afresh without a word (weights off by 0.07); one device's 8 were refused."""
    def runner(kind, model):
        return SingleDevice(model) if kind == "one device" else Pipeline(
            model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "1f1b", micro_batches=3 if "m=3" in kind else 2)

    straight = lm(little, dropout=0.3)
    with runner(first, straight) if first != "one device" else contextlib.nullcontext(runner(first, straight)) as r:
        h_straight = train(straight, little, runner=r, epochs=2, out=tmp_path / "a", **quiet(**STREAM_RUN))

    class Stop(Exception):
        pass
    model, steps = lm(little, dropout=0.3), []
    base = runner(first, model)
    real_step = base.train_step

    def stopping(batch):
        steps.append(1)
        if len(steps) == 8 + 5:                    # epoch 2, batch 5: the last checkpoint is at batch 3
            raise Stop
        return real_step(batch)
    base.train_step = stopping
    with pytest.raises(Stop):
        train(model, little, runner=base, epochs=2, out=tmp_path / "b", **quiet(**STREAM_RUN))
    base.close()
    saved = load_checkpoint(tmp_path / "b" / "checkpoint.pt")
    assert (saved["position"]["epoch"], saved["position"]["batch"]) == (1, 3)
    assert set(saved["carried"]) == {"lstm0", "lstm1"} and saved["carried"]["lstm0"][0].shape[1] == 8

    resumed = lm(little, seed=99, dropout=0.3)
    with runner(then, resumed) if then != "one device" else contextlib.nullcontext(runner(then, resumed)) as r:
        h_resumed = train(resumed, little, runner=r, epochs=2, out=tmp_path / "b", resume=True, **quiet(**STREAM_RUN))
    if first == then:
        assert_same_run(h_straight, h_resumed, straight, resumed)
    else:
        pa, pb = params(straight), params(resumed)
        assert all(torch.allclose(pa[k], pb[k], rtol=1e-5, atol=1e-6) for k in pa)
        assert h_resumed.test_ppl == pytest.approx(h_straight.test_ppl, rel=1e-5)


def test_a_widened_pipelines_state_goes_on_in_its_first_columns(little):
    """3 micro-batches run a batch of 8 as 9 columns, and carried_state() is 9 wide (a checkpoint written before
    the cut holds that too): its first 8 columns, loaded anywhere, are the stream's state."""
    from mpedu.lm import StreamIterator
    from mpedu.core import fitted
    from mpedu.training import stream_columns
    windows = list(StreamIterator(little.train, 8, 6))[:3]
    model = lm(little)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "1f1b", micro_batches=3) as pipe:
        for batch in windows[:2]:
            pipe.eval_step(fitted(pipe, batch))
        wide = pipe.carried_state()
        expected = pipe.eval_step(fitted(pipe, windows[2])).loss
    assert wide["lstm0"][0].shape[1] == 9
    for runner in (SingleDevice(model), Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", 4)):
        with contextlib.closing(runner) if hasattr(runner, "close") else contextlib.nullcontext():
            runner.load_carried_state(stream_columns(wide, 8))
            assert runner.eval_step(fitted(runner, windows[2])).loss == pytest.approx(expected, rel=1e-6)
            runner.reset_state()                                  # from zero state: another number
            assert abs(runner.eval_step(fitted(runner, windows[2])).loss - expected) > 1e-5


# ---------------------------------------------------------------- kill -9 and resume

ARGS = ["train", "--config", "tiny", "--epochs", "3", "--limit-batches", "6", "--batch-size", "16", "--lr", "5",
        "--checkpoint-every", "2", "--no-progress", "--no-baselines"]


def _start(out: Path, *extra, slow: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    # slow: every checkpoint write waits that long before its rename (tests/slow_checkpoints.py)
    command = ["-m", "mpedu"] if slow is None else [str(ROOT / "tests" / "slow_checkpoints.py"), slow]
    return subprocess.Popen([sys.executable, *command, *ARGS, "--out", str(out), *extra], cwd=out.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def _temp_files(out: Path):
    return sorted(out.glob(".*.tmp"))


def _kill(proc) -> str:
    proc.send_signal(signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=60)
    return stdout


def test_kill_9_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL a real `python -m mpedu train` (2 virtual devices, GPipe) several times, once while a
    checkpoint is being written, resume each time: the end is bit for bit the uninterrupted run."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    reference = _start(straight)
    # Each write sleeps 0.2 s between the temp file and the rename: a wide window to land a kill in.
    slow = "0.2"
    rng = random.Random(20240607)
    ckpt = killed / "checkpoint.pt"
    outputs, positions = [], []

    def stamp():
        return ckpt.stat().st_mtime_ns if ckpt.exists() else None

    def position():
        pos = load_checkpoint(ckpt)["position"]          # whatever is on disk loads: never a half-written file
        return pos["epoch"], pos["batch"]

    for attempt in range(4):
        before, seen = stamp(), position() if ckpt.exists() else None
        stale = _temp_files(killed)          # the previous kill may have landed inside a write too
        proc = _start(killed, *(["--resume"] if attempt else []), slow=slow)
        if attempt == 1:
            # kill inside the write that would replace the checkpoint: its temp file is there, never renamed
            # (a new one: temp names are random, and a stale one would have the kill land before the resume)
            assert _wait_for(lambda: set(_temp_files(killed)) - set(stale), proc), "no checkpoint write seen"
            outputs.append(_kill(proc))
            assert _temp_files(killed), "the kill should leave the half-written temp file behind"
            assert position() == seen, "the interrupted write must not have touched checkpoint.pt"
        else:
            # once this run has written a checkpoint of its own (so every kill makes progress),
            # a random moment later: inside a step, an evaluation or another write
            assert _wait_for(lambda: stamp() != before, proc), "the run wrote no checkpoint"
            _wait_for(lambda: False, proc, seconds=rng.uniform(0.0, 0.6))
            outputs.append(_kill(proc) if proc.poll() is None else proc.communicate()[0])
        positions.append(position())
    final = _start(killed, "--resume", "--json", slow=slow)
    stdout, stderr = final.communicate(timeout=120)
    assert final.returncode == 0, stderr
    outputs.append(stdout)
    ref_out, ref_err = reference.communicate(timeout=120)
    assert reference.returncode == 0, ref_err

    assert sum("resumed from" in o for o in outputs) == 4, outputs
    assert "never read" in "".join(outputs), "a resume after the mid-write kill removes the temp file"
    assert not _temp_files(killed)
    assert positions == sorted(positions) and positions[0] < positions[-1] < (3, 0), positions
    a, b = load_checkpoint(straight / "checkpoint.pt"), load_checkpoint(ckpt)
    assert computed(a["history"]) == computed(b["history"])
    ma, _ = load_model(straight / "model.pt")
    mb, _ = load_model(killed / "model.pt")
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


# A run with dropout on 2 virtual devices: masks are positional (mpedu.lm.dropout), a function of the seed and
# the global step, so a resumed run draws the masks the uninterrupted one drew.
_DROPOUT_RUN = """
import sys, torch
from mpedu.lm import Corpus, load_corpus
from mpedu.lm import LSTMLM
from mpedu.core import Pipeline
from mpedu.training import train
corpus = load_corpus()
little = Corpus(corpus.vocab, corpus.train[:200], corpus.valid[:40], corpus.test[:40], name="little")
torch.manual_seed(int(sys.argv[2]))                       # the resumed run starts from other weights
model = LSTMLM.from_config("tiny", vocab_size=len(little.vocab), dropout=0.3)
with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "1f1b", micro_batches=4) as pipe:
    train(model, little, runner=pipe, epochs=3, batch_size=16, lr=5.0, seed=3, checkpoint_every=2,
          limit_batches=6, out=sys.argv[1], resume=sys.argv[2] != "0", progress=False)
"""


def test_kill_9_and_resume_with_dropout_on_two_devices_equals_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start(out, seed):
        return subprocess.Popen([sys.executable, "-c", _DROPOUT_RUN, str(out), str(seed)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    straight, killed = start(tmp_path / "straight", 0), start(tmp_path / "killed", 0)
    ckpt = tmp_path / "killed" / "checkpoint.pt"
    assert _wait_for(ckpt.exists, killed), "the run wrote no checkpoint"
    assert killed.poll() is None, "the run ended before it could be killed"
    _kill(killed)
    position = load_checkpoint(ckpt)["position"]
    assert (position["epoch"], position["batch"]) < (3, 0)
    resumed = start(tmp_path / "killed", 1)
    for proc in (straight, resumed):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert "resumed from" in out
    a, b = load_checkpoint(tmp_path / "straight" / "checkpoint.pt"), load_checkpoint(ckpt)
    assert computed(a["history"]) == computed(b["history"])
    ma, _ = load_model(tmp_path / "straight" / "model.pt")
    mb, _ = load_model(tmp_path / "killed" / "model.pt")
    assert ma.config.dropout == 0.3
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------- resume on another placement

def _pipeline_run(corpus, tmp, placement, epochs, resume=False, m=4):
    model = lm(corpus, seed=1 if resume else 0)        # a resume must overwrite a different init
    runner = SingleDevice(model) if placement is None else Pipeline(model, placement, "gpipe", micro_batches=m)
    try:
        history = train(model, corpus, runner=runner, epochs=epochs, out=tmp, resume=resume, limit_batches=5,
                        **quiet(**RUN))
    finally:
        runner.close()
    return history, model


def test_resume_on_another_placement_with_the_same_micro_batches_is_exact(little, tmp_path):
    h_straight, m_straight = _pipeline_run(little, tmp_path / "a", TWO, epochs=2)
    _pipeline_run(little, tmp_path / "b", TWO, epochs=1)
    h_moved, m_moved = _pipeline_run(little, tmp_path / "b", OTHER_TWO, epochs=2, resume=True)
    assert computed(h_straight.to_dict()) == computed(h_moved.to_dict())
    for (name, p), q in zip(m_straight.state_dict().items(), m_moved.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("placement", [None, "embed,lstm0,lstm1,decode:vgpu0",
                                       "embed:vgpu0 | lstm0:vgpu1 | lstm1,decode:vgpu2"])
def test_resume_on_another_device_count_is_close(little, tmp_path, placement):
    # Other micro-batching (none on one device) rounds floats differently: close, not equal.
    h_straight, m_straight = _pipeline_run(little, tmp_path / "a", TWO, epochs=2)
    _pipeline_run(little, tmp_path / "b", TWO, epochs=1)
    h_moved, m_moved = _pipeline_run(little, tmp_path / "b", placement, epochs=2, resume=True,
                                     m=2 if placement else 4)
    for a, b in zip(h_straight.epochs, h_moved.epochs):
        for key in ("train_ppl", "valid_ppl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
        assert (a["tokens"], a["steps"]) == (b["tokens"], b["steps"])
    for (name, p), q in zip(m_straight.state_dict().items(), m_moved.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)


def test_cli_resumes_a_two_device_run_on_one_device(capsys, tmp_path):
    quick = ["--config", "tiny", "--limit-batches", "3", "--batch-size", "16", "--no-progress", "--no-baselines",
             "--out", str(tmp_path)]
    assert cli.main(["train", "--devices", "2", "--epochs", "1", *quick]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--devices", "1", "--epochs", "2", "--resume", "--json", *quick]) == 0
    out = capsys.readouterr().out
    assert "was written on embed,lstm0:vgpu0 | lstm1,decode:vgpu1; this run uses one device" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["epochs"] == 2 and summary["runner"] == "single" and math.isfinite(summary["valid_ppl"])
