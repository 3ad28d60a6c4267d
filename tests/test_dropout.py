"""Positional dropout: masks are a function of (seed, step, layer, sequence, time step), alike on any placement."""
import pytest
import torch

from mpedu.lm import Position, PositionalDropout, dropout, keep_mask


def test_a_slice_of_the_batch_gets_exactly_that_slice_of_the_batch_mask():
    where = Position(seed=5, step=11)
    whole = keep_mask(0.3, 2, (9, 8, 16), where)                      # (T, B, H)
    for t0, t1, b0, b1 in [(0, 9, 0, 8), (3, 7, 2, 6), (8, 9, 7, 8), (0, 4, 4, 8)]:
        part = keep_mask(0.3, 2, (t1 - t0, b1 - b0, 16), where.at(sequence=b0, time=t0))
        assert torch.equal(part, whole[t0:t1, b0:b1])


def test_masks_keep_1_minus_p_and_differ_by_seed_step_and_layer():
    where = Position(seed=0, step=0)
    base = keep_mask(0.4, 1, (35, 64, 200), where)
    assert base.float().mean().item() == pytest.approx(0.6, abs=0.005)
    others = [keep_mask(0.4, 1, (35, 64, 200), Position(1, 0)), keep_mask(0.4, 1, (35, 64, 200), Position(0, 1)),
              keep_mask(0.4, 2, (35, 64, 200), where)]
    for other in others:
        # independent masks agree where both keep or both drop: 0.6^2 + 0.4^2 = 0.52 of the elements
        assert (base == other).float().mean().item() == pytest.approx(0.52, abs=0.01)
    # neighbours in time, sequence and feature are independent too
    for a, b in [(base[1:], base[:-1]), (base[:, 1:], base[:, :-1]), (base[..., 1:], base[..., :-1])]:
        assert (a == b).float().mean().item() == pytest.approx(0.52, abs=0.01)


def test_eval_mode_and_p_0_are_the_identity_and_gradients_flow_through_the_mask():
    layer, x = PositionalDropout(0.5, layer=0), torch.randn(4, 3, 5, requires_grad=True)
    with dropout.at(Position(0, 0)):
        assert torch.equal(layer.eval()(x), x)
        assert torch.equal(PositionalDropout(0.0, layer=0)(x), x)
        y = layer.train()(x)
    keep = keep_mask(0.5, 0, (4, 3, 5), Position(0, 0))
    assert torch.equal(y, x * keep * 2.0)
    y.sum().backward()
    assert torch.equal(x.grad, keep * 2.0)


def test_each_thread_sees_only_its_own_position():
    import threading
    seen = {}

    def run(k):
        with dropout.at(Position(k, k)):
            threading.Event().wait(0.01)          # let the other threads set theirs meanwhile
            seen[k] = dropout.current()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {k: Position(k, k) for k in range(4)}
    assert dropout.current() is None
