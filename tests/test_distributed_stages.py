"""mpedu.distributed.stages: a stage takes and returns tensors, and hands gloo contiguous gradients."""
import pytest
import torch

from conftest import tiny_model
from mpedu.distributed import FAIL_ENV, ContiguousGrad, StageModule


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
    first.fail = True
    with pytest.raises(RuntimeError, match=FAIL_ENV):
        first(tokens)
