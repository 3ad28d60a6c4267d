"""Numeric faults: a NaN or inf is named (step, layer, stage, device), skipped on request, never saved."""
import json
import math

import pytest
import torch

import mpedu.cli.commands as cli
from conftest import lm, quiet
from mpedu.training import NumericFault, load_checkpoint, train
from mpedu.core import Pipeline, SingleDevice


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

TIMING = {"seconds", "tokens_per_s", "train_seconds", "bubble_fraction"}   # measured, not computed


def computed(history: dict) -> dict:
    return {"epochs": [{k: v for k, v in e.items() if k not in TIMING} for e in history["epochs"]],
            "test_ppl": history["test_ppl"]}


TWO = "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"          # the tiny config has lstm0, lstm1
RUN = dict(batch_size=16, lr=5.0, seed=3, checkpoint_every=3)


# ---------------------------------------------------------------- numeric faults

class Poison:
    """Makes one layer's output inf while `on`; a runner turns it on for one chosen step and
    leaves it on until the next step starts (so the trainer's diagnosis sees it too)."""

    def __init__(self, layer):
        self.on = False
        original = layer.forward

        def forward(x, state=None):
            y, new_state = original(x, state)
            return (y * math.inf if self.on else y), new_state

        layer.forward = forward


def poisoned_runner(runner, poison, bad_steps):
    calls = [0]
    original = runner.train_step

    def train_step(batch):
        calls[0] += 1
        poison.on = calls[0] in bad_steps
        return original(batch)

    runner.train_step = train_step
    return runner


def test_an_inf_output_in_a_pipeline_names_step_stage_device_and_layer(little, tmp_path):
    model = lm(little)
    poison = Poison(model.layers["lstm1"])
    with Pipeline(model, TWO, "1f1b", micro_batches=4) as pipe:
        poisoned_runner(pipe, poison, bad_steps={5})
        with pytest.raises(NumericFault) as err:
            train(model, little, runner=pipe, epochs=1, out=tmp_path, **quiet(**RUN))
    message = str(err.value)
    assert "at step 5" in message and "epoch 1, batch 4" in message
    assert "layer lstm1 (stage 1 on vgpu:1): its output holds" in message
    assert "(epoch 1, batch 3), is kept" in message
    assert (err.value.step, err.value.layer, err.value.stage, err.value.device) == (5, "lstm1", 1, "vgpu:1")
    kept = load_checkpoint(tmp_path / "checkpoint.pt")
    assert (kept["position"]["epoch"], kept["position"]["batch"]) == (0, 3)
    assert all(torch.isfinite(t).all() for t in kept["model"].values())


def test_a_nan_weight_is_named_and_cannot_be_skipped(little):
    model = lm(little)
    with torch.no_grad():
        model.layers["lstm0"].lstm.weight_hh_l0[3, 5] = math.nan
    with pytest.raises(NumericFault, match="skipping batches cannot help") as err:
        train(model, little, epochs=1, skip_bad_batches=True, **quiet(**RUN))
    assert "layer lstm0 (on cpu): its weight lstm.weight_hh_l0 holds 1 nan of 16,384 values" in str(err.value)


def test_skip_bad_batches_drops_them_counts_them_and_carries_on(little, tmp_path):
    model = lm(little)
    poison = Poison(model.layers["embed"])
    lines = []
    with Pipeline(model, TWO, "gpipe", micro_batches=4) as pipe:
        poisoned_runner(pipe, poison, bad_steps={2, 7})
        history = train(model, little, runner=pipe, epochs=2, out=tmp_path, skip_bad_batches=True,
                        limit_batches=5, **quiet(lines, **RUN))
    assert [e["skipped_batches"] for e in history.epochs] == [1, 1]
    assert [e["steps"] for e in history.epochs] == [4, 4]
    assert history.summary()["skipped_batches"] == 2
    assert sum("skipped batch" in line and "layer embed (stage 0 on vgpu:0)" in line for line in lines) == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(history.test_ppl)


def test_weights_that_overflow_never_replace_the_last_good_checkpoint(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, limit_batches=2, **quiet(**RUN))
    good = load_checkpoint(tmp_path / "checkpoint.pt")
    model = lm(little)
    runner = SingleDevice(model)
    step = runner.train_step

    def huge_gradient(batch):   # finite, so the step is taken, but lr x 3e38 overflows the weight to -inf
        result = step(batch)
        model.layers["decode"].linear.bias.grad.fill_(3e38)
        return result

    runner.train_step = huge_gradient
    with pytest.raises(NumericFault, match="weights became non-finite before the checkpoint at epoch 1, batch 1: "
                                           r"layer decode \(on cpu\): its weight linear.bias holds"):
        train(model, little, runner=runner, epochs=1, out=tmp_path, limit_batches=2, clip=None, checkpoint_every=1,
              **quiet(batch_size=16, lr=10.0))
    assert computed(load_checkpoint(tmp_path / "checkpoint.pt")["history"]) == computed(good["history"])


def test_cli_numeric_fault_exits_1_and_skip_reports_in_the_summary(capsys, tmp_path, monkeypatch):
    real = Pipeline.train_step
    calls = [0]

    def flaky(self, batch):     # the second step's loss is inf (a non-finite loss, finite gradients)
        calls[0] += 1
        result = real(self, batch)
        return result if calls[0] != 2 else type(result)(math.inf, math.inf, result.tokens, result.timeline)

    monkeypatch.setattr(Pipeline, "train_step", flaky)
    quick = ["train", "--config", "tiny", "--epochs", "1", "--limit-batches", "3", "--batch-size", "16",
             "--no-progress", "--no-baselines", "--out", str(tmp_path)]
    assert cli.main(quick) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpedu: error: training diverged at step 2: loss inf at epoch 1, batch 1")
    calls[0] = 0
    assert cli.main([*quick, "--skip-bad-batches", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["skipped_batches"] == 1 and summary["steps"] == 2
