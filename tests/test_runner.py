"""The runner contract: step results, batch checks, padding a batch to the micro-batches."""
import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import VOCAB, first_batch, lm, make_batch, tiny_model
from mpedu.core import BaseRunner, Pipeline, Runner, SingleDevice, StepResult, check_batch, fit_width, fitted


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


# ---------------------------------------------------------------- padding to the micro-batches

def test_fit_width_pads_columns_without_changing_the_step(corpus):
    batch = first_batch(corpus.train[:40], batch_size=7)
    wide = fit_width(batch, 4)
    assert wide.inputs.shape[1] == 8 and wide.tokens == batch.tokens
    assert fit_width(wide, 4) is wide
    model = lm(corpus)
    twin = copy.deepcopy(model)
    r1, r2 = SingleDevice(model).train_step(batch), SingleDevice(twin).train_step(wide)
    assert r1.nll_sum == pytest.approx(r2.nll_sum, rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- batch checks

@given(st.integers(0, 9), st.sampled_from(["T", "ids", "dtype", "shape", "empty"]))
@settings(max_examples=25, deadline=None)
def test_a_malformed_batch_is_refused_before_any_stage_runs(seed, fault):
    batch = make_batch(seed=seed)
    if fault == "T":
        batch.inputs = batch.inputs[:, :5]
    elif fault == "ids":
        batch.inputs[0, seed % 8] = VOCAB + seed
    elif fault == "dtype":
        batch.inputs = batch.inputs.float()
    elif fault == "shape":
        batch.mask = batch.mask[:-1]
    else:
        batch.mask[:] = False
    model = tiny_model()
    for runner in (SingleDevice(copy.deepcopy(model)), Pipeline(model, 2, "gpipe", micro_batches=2)):
        try:
            with pytest.raises(ValueError, match="batch"):
                runner.train_step(batch)
        finally:
            runner.close()


# ---------------------------------------------------------------- the contract itself

def test_every_runner_meets_the_contract_and_reports_a_step_result():
    model = tiny_model(num_layers=2)
    batch = make_batch()
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=2) as pipe:
        assert isinstance(pipe, Runner)
        piped = pipe.eval_step(batch)
    single = SingleDevice(model)
    assert isinstance(single, Runner) and not isinstance(model, Runner)
    result = single.eval_step(batch)
    assert isinstance(result, StepResult) and result.tokens == int(batch.mask.sum())
    assert result.loss == pytest.approx(result.nll_sum / result.tokens) and result.timeline is None
    assert piped.nll_sum == pytest.approx(result.nll_sum, rel=1e-5) and piped.timeline is not None


def test_check_batch_names_what_is_wrong():
    batch = make_batch()
    check_batch(batch, VOCAB)                                   # a good batch passes
    with pytest.raises(TypeError, match="expected a Batch"):
        check_batch(batch.inputs, VOCAB)
    with pytest.raises(ValueError, match=f"ids 0..{VOCAB - 2}"):
        check_batch(batch, VOCAB - 1)                           # token VOCAB - 1 may occur: vocabulary too small
    with pytest.raises(ValueError, match="inputs must be token ids of dtype torch.int64 or torch.int32, got "
                                         "torch.float32"):
        check_batch(dataclasses.replace(batch, inputs=batch.inputs.float()), VOCAB)
    with pytest.raises(ValueError, match="targets must be token ids of dtype torch.int64, got torch.int32; "
                                         r"convert with \.long\(\)"):
        check_batch(dataclasses.replace(batch, targets=batch.targets.int()), VOCAB)
    check_batch(dataclasses.replace(batch, inputs=batch.inputs.int()), VOCAB)      # int32 ids embed alike
    real = int((batch.targets != 0).sum())
    for mask in (torch.ones_like(batch.mask), batch.mask.clone().fill_(False), (batch.targets != 0).long()):
        with pytest.raises(ValueError, match=f"mask must be a bool tensor True exactly where a target is a real "
                                             f"token .* against {real} real targets"):
            check_batch(dataclasses.replace(batch, mask=mask), VOCAB)
    empty = dataclasses.replace(batch, targets=torch.zeros_like(batch.targets), mask=torch.zeros_like(batch.mask))
    with pytest.raises(ValueError, match="no real"):
        check_batch(empty, VOCAB)


def test_fitted_pads_only_for_a_runner_with_micro_batches():
    batch = make_batch(B=6)

    class Split(BaseRunner):
        micro_batches = 4
    assert fitted(BaseRunner(), batch) is batch and fitted(Split(), batch).inputs.shape[1] == 8


def test_every_runner_declares_the_whole_contract_and_one_that_does_not_is_refused(corpus):
    from mpedu.training import train
    model = tiny_model()
    # what the training loop and the fault search use: declared (annotated or defined) by the protocol...
    used = {"owned", "world", "clip", "clip_grad_norm", "agree_on_fault", "bad_before_clip", "device",
            "carried_state", "load_carried_state", "carries_state", "placement", "micro_batches", "micro_batch_sizes",
            "chunks", "model"}
    assert all(m in Runner.__annotations__ or callable(getattr(Runner, m, None)) for m in used)
    # ...and given by every runner (BaseRunner's defaults)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1") as pipe:
        assert all(hasattr(r, m) for r in (SingleDevice(model), pipe) for m in used)

    class Partial:                    # the six members of an older contract: a rename would take a default
        dropout_seed = dropout_step = 0
        model = None

        def train_step(self, batch): ...
        def eval_step(self, batch): ...
        def reset_state(self): ...
        def close(self): ...
    with pytest.raises(TypeError, match="is not a runner"):
        train(model, corpus, runner=Partial())
