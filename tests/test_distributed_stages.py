"""mpedu.distributed.stages: a stage takes and returns tensors, hands gloo contiguous gradients, and a later
stage with an LSTM runs its backward once under zero bubble."""
import pytest
import torch
import torch.distributed as dist

from conftest import tiny_model
from mpedu.distributed import ContiguousGrad, Recorder, StageModule, TimedStage, whole_backward_in_b


def test_the_incoming_gradient_is_made_contiguous():
    # gloo sends contiguous tensors only; a stage's input gradient may come out strided.
    x = torch.randn(3, 4, requires_grad=True)
    (plain,) = torch.autograd.grad(x.t(), x, torch.ones(4, 3))
    assert not plain.is_contiguous()
    (fixed,) = torch.autograd.grad(ContiguousGrad.apply(x).t(), x, torch.ones(4, 3))
    assert fixed.is_contiguous() and torch.equal(fixed, plain)


def test_stage_module_takes_batch_first_tokens_and_returns_a_tensor():
    model = tiny_model()
    first = StageModule(["embed", "lstm0"], [model.layers["embed"], model.layers["lstm0"]])
    tokens = torch.randint(3, 61, (2, 5))                       # (b, T), as torch's step() splits dim 0
    out = first(tokens)
    assert out.shape == (5, 2, 64) and out.is_contiguous()      # (T, b, H) time-major


def _stage(model, names):
    return StageModule(names, [model.layers[n] for n in names])


def test_a_later_stage_with_an_lstm_runs_its_whole_backward_in_b():
    # PyTorch's split would run the LSTM's backward kernel in B and again in W; the first stage sends no
    # gradient (PyTorch runs its whole backward in W), and a stage of plain layers splits cleanly
    model = tiny_model()
    assert whole_backward_in_b(1, _stage(model, ["lstm1", "lstm2", "decode"]))
    assert whole_backward_in_b(2, _stage(model, ["lstm2"]))
    assert not whole_backward_in_b(0, _stage(model, ["embed", "lstm0"]))
    assert not whole_backward_in_b(1, _stage(model, ["decode"]))


def test_such_a_stage_gets_a_w_that_does_nothing(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, cpu = tiny_model(), torch.device("cpu")
        x = torch.empty((5, 2, 64), requires_grad=True)            # (T, b, H) received from stage 0

        def stage(names):
            return TimedStage(_stage(model, names), 1, 2, cpu, input_args=x, group=dist.group.WORLD,
                              recorder=Recorder(cpu, 0.0))
        recurrent, plain = stage(["lstm2", "decode"]), stage(["decode"])
        assert recurrent.dw_builder is not None and recurrent.dw_builder()() is None
        assert plain.dw_builder is None                             # PyTorch's own split
    finally:
        dist.destroy_process_group()
