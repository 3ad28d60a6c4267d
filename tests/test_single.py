"""SingleDevice, the reference runner: gradients, accumulation, carried state, dropout steps."""
import copy

import pytest
import torch

from conftest import first_batch, lm
from mpedu.lm import StreamIterator, nll_sum
from mpedu.core import SingleDevice


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


# ---------------------------------------------------------------- the reference runner

def test_train_step_gradient_equals_a_manual_computation(corpus):
    model = lm(corpus, dropout=0.0)
    reference = copy.deepcopy(model)
    batch = first_batch(corpus.train[:40])
    assert not batch.mask.all()  # the batch has padding, so masking is exercised

    result = SingleDevice(model).train_step(batch)

    logits, _ = reference(batch.inputs)                                          # (T, B, V)
    logp = logits.log_softmax(-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (T, B)
    manual_nll = -(logp * batch.mask).sum()
    (manual_nll / int(batch.mask.sum())).backward()
    assert result.tokens == int(batch.mask.sum())
    assert result.nll_sum == pytest.approx(manual_nll.item(), rel=1e-6)
    assert result.loss == pytest.approx(manual_nll.item() / result.tokens, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_train_step_accumulates_and_eval_step_leaves_no_gradient(corpus):
    model = lm(corpus)
    runner, batch = SingleDevice(model), first_batch(corpus.train[:40])
    runner.train_step(batch)
    once = [p.grad.clone() for p in model.parameters()]
    runner.train_step(batch)
    for g1, p in zip(once, model.parameters()):
        torch.testing.assert_close(p.grad, 2 * g1)
    model.zero_grad(set_to_none=True)
    result = runner.eval_step(batch)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert result.timeline is None and result.tokens == batch.tokens


def test_stream_batches_carry_state_and_a_new_width_resets_it(corpus):
    model = lm(corpus)
    runner = SingleDevice(model)
    a, b = list(StreamIterator(corpus.train[:50], batch_size=4, bptt=8))[:2]
    assert a.carry_state and b.carry_state
    split = runner.eval_step(a).nll_sum + runner.eval_step(b).nll_sum
    with torch.no_grad():
        logits, _ = model(torch.cat([a.inputs, b.inputs]))                        # one 16-step pass
        whole = nll_sum(logits, torch.cat([a.targets, b.targets])).item()
    assert split == pytest.approx(whole, rel=1e-5)

    fresh = runner.eval_step(first_batch(corpus.train[:50], 3))  # width 3: state must not leak across
    runner.reset_state()
    assert fresh.nll_sum == pytest.approx(runner.eval_step(first_batch(corpus.train[:50], 3)).nll_sum)
    runner.reset_state()
    assert runner.eval_step(b).nll_sum != pytest.approx(runner.eval_step(b).nll_sum)  # 2nd call starts from b's state
