"""A stage's forward/backward on one micro-batch, its B/W split and its time chunks equal plain autograd."""
import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.runtime import get_device
from mpedu.core import Stage, is_recurrent


def two_stages(model):
    dev = get_device("vgpu:0")
    names = model.layer_names
    first, rest = names[:2], names[2:]
    return (Stage(0, first, [model.layers[n] for n in first], dev, is_last=False),
            Stage(1, rest, [model.layers[n] for n in rest], dev, is_last=True))


def test_a_recomputing_stage_keeps_its_input_and_not_its_output():
    """Until R, a recomputing stage holds only its input: the output it sent on (on a GPU the next stage's
    copy lives on another device) is not kept alive by the stage, then R rebuilds it for the backward."""
    import gc
    import weakref
    model, batch = tiny_model(num_layers=2), make_batch()
    s0, _ = two_stages(model)
    out = s0.forward(0, 0, batch.inputs, recompute=True)
    sent = weakref.ref(out)
    del out
    gc.collect()
    assert sent() is None
    s0.recompute_forward(0, 0)
    assert s0.backward(0, 0, torch.ones(9, 8, 64)) is None and model.layers["lstm0"].lstm.weight_hh_l0.grad is not None


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
        # B: the LSTM's weights (its backward kernel computes them anyway); W: the decoder's, after
        lstm = [p for layer in s1.layers if is_recurrent(layer) for p in layer.parameters()]
        decoder = [p for layer in s1.layers if not is_recurrent(layer) for p in layer.parameters()]
        assert lstm and all(p.grad is not None for p in lstm), "B gives the recurrent layer's weights"
        assert decoder and all(p.grad is None for p in decoder), "B leaves the decoder's weights to W"
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


def test_a_split_backward_leaves_w_nothing_to_do_on_a_stage_of_lstm_layers():
    """zero bubble on recurrent layers: B computes their weight gradients (the kernel does anyway); W adds nothing,
    and the gradients are those of the fused backward."""
    model, batch = tiny_model(num_layers=2), make_batch()
    dev = get_device("vgpu:0")
    lstms = [model.layers["lstm0"], model.layers["lstm1"]]
    x = model.layers["embed"](batch.inputs)[0].detach()
    results = []
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        stage = Stage(1, ["lstm0", "lstm1"], lstms, dev, is_last=False)
        out = stage.forward(0, 0, x)
        grad_in = stage.backward(0, 0, torch.ones_like(out), weights=not split)
        after_b = [p.grad.clone() for p in stage.params]
        if split:
            # the input gradient went upstream: the input kept for W does not hold on to it as well
            assert stage.saved[0, 0].x.grad is None and grad_in is not None
            stage.backward_weight(0, 0)
            assert all(torch.equal(p.grad, g) for p, g in zip(stage.params, after_b)), "W changed a weight gradient"
            assert not stage.saved
        results.append((grad_in, after_b))
    (fused_in, fused_w), (split_in, split_w) = results
    assert torch.equal(fused_in, split_in) and all(torch.equal(a, b) for a, b in zip(fused_w, split_w))
