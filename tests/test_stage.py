"""A stage's forward/backward on one micro-batch, its B/W split and its time chunks equal plain autograd."""
import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.devices import get_device
from mpedu.stage import Stage


def two_stages(model):
    dev = get_device("vgpu:0")
    names = model.layer_names
    first, rest = names[:2], names[2:]
    return (Stage(0, first, [model.layers[n] for n in first], dev, is_last=False),
            Stage(1, rest, [model.layers[n] for n in rest], dev, is_last=True))


@pytest.mark.parametrize("split", [False, True])
def test_forward_backward_through_two_stages_equals_autograd(split):
    model, batch = tiny_model(num_layers=2), make_batch()
    ref_loss, ref = reference(model, batch)
    s0, s1 = two_stages(model)
    act = s0.forward(0, 0, batch.inputs)
    assert act.shape == (9, 8, 64) and act.grad_fn is not None
    loss = s1.forward(0, 0, act, batch.targets, scale=1 / batch.tokens)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    grad = s1.backward(0, 0, None, weights=not split)
    assert grad.shape == act.shape
    if split:
        assert all(p.grad is None for p in s1.params), "B must not touch weight gradients"
        s1.backward_weight(0, 0)
    assert s0.backward(0, 0, grad) is None            # stage 0's input is token ids
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-7)
    assert not s0.saved and not s1.saved, "backward must free what forward kept"


@pytest.mark.parametrize("chunks", [2, 3])
def test_time_chunks_pass_state_forward_and_its_gradient_backward(chunks):
    """Chunk c runs after chunk c-1 (state); backward runs c = last..0 (BPTT)."""
    model, batch = tiny_model(num_layers=2), make_batch(T=9)
    ref_loss, ref = reference(model, batch)
    s0, s1 = two_stages(model)
    bounds = torch.linspace(0, 9, chunks + 1).round().long().tolist()
    total = 0.0
    for c in range(chunks):
        lo, hi = bounds[c], bounds[c + 1]
        act = s0.forward(0, c, batch.inputs[lo:hi])
        total += s1.forward(0, c, act, batch.targets[lo:hi], scale=1 / batch.tokens).item()
    assert total == pytest.approx(ref_loss, rel=1e-6)
    for c in reversed(range(chunks)):
        s0.backward(0, c, s1.backward(0, c, None))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-7)


def test_what_a_forward_keeps_is_counted_once_per_kind_and_anew_when_a_layer_freezes(monkeypatch):
    """The saved-tensor hooks run on the first forward of each kind (shapes, state, trainable weights) only:
    their Python calls cost small stages' backwards dearly. A later forward of that kind holds the same bytes."""
    model, batch = tiny_model(num_layers=2), make_batch()
    s0, s1 = two_stages(model)
    hooked = []
    real = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", lambda *a: hooked.append(1) or real(*a))

    def step():
        s0.reset(), s1.reset()                              # a new step: no state carried in
        s1.forward(0, 0, s0.forward(0, 0, batch.inputs).detach(), batch.targets)
        held = s0.saved_bytes(0), s1.saved_bytes(0)
        s1.backward(0, 0, None)
        s0.saved.clear()
        return held

    first = step()
    assert len(hooked) == 2 and min(first) > 0
    assert step() == first and len(hooked) == 2            # counted already: no hooks
    model.layers["decode"].requires_grad_(False)            # another kind of forward: counted anew
    frozen = step()
    assert len(hooked) == 3 and frozen[0] == first[0] and frozen[1] <= first[1]
    assert step() == frozen and len(hooked) == 3
