"""Training: the single-device runner, learning, perplexity, lr decay, checkpoints and exact resume."""
import copy
import importlib
import io
import json
import math

import pytest
import torch

from mpedu.bucketing import BucketIterator, StreamIterator
from mpedu.data import Corpus, Vocabulary, load_corpus
from mpedu.model import LSTMLM
from mpedu.train import (CheckpointError, History, SingleDevice, evaluate, fit_width, load_checkpoint,
                         load_model, next_lr, save_checkpoint, train)

training = importlib.import_module("mpedu.train")  # the module: `mpedu.train` is also the function


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def little(corpus):
    """A slice of the embedded corpus: 16 batches of (at most) 16 an epoch, so a run takes about a second."""
    return Corpus(corpus.vocab, corpus.train[:200], corpus.valid[:40], corpus.test[:40], name="little")


def tiny(corpus, seed=0, **overrides):
    torch.manual_seed(seed)
    return LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab), **overrides)


def quiet(**kw):
    return dict(progress=False, log=lambda line: None, **kw)


def first_batch(sentences, batch_size=6):
    return next(iter(BucketIterator(sentences, batch_size, shuffle=False)))


# ---------------------------------------------------------------- the runner

def test_train_step_gradient_equals_a_manual_computation(corpus):
    model = tiny(corpus, dropout=0.0)
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
    model = tiny(corpus)
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
    model = tiny(corpus)
    runner = SingleDevice(model)
    a, b = list(StreamIterator(corpus.train[:50], batch_size=4, bptt=8))[:2]
    assert a.carry_state and b.carry_state
    split = runner.eval_step(a).nll_sum + runner.eval_step(b).nll_sum
    with torch.no_grad():
        logits, _ = model(torch.cat([a.inputs, b.inputs]))                        # one 16-step pass
        whole = training.nll_sum(logits, torch.cat([a.targets, b.targets])).item()
    assert split == pytest.approx(whole, rel=1e-5)

    fresh = runner.eval_step(first_batch(corpus.train[:50], 3))  # width 3: state must not leak across
    runner.reset_state()
    assert fresh.nll_sum == pytest.approx(runner.eval_step(first_batch(corpus.train[:50], 3)).nll_sum)
    runner.reset_state()
    assert runner.eval_step(b).nll_sum != pytest.approx(runner.eval_step(b).nll_sum)  # 2nd call starts from b's state


def test_fit_width_pads_columns_without_changing_the_step(corpus):
    batch = first_batch(corpus.train[:40], batch_size=7)
    wide = fit_width(batch, 4)
    assert wide.inputs.shape[1] == 8 and wide.tokens == batch.tokens
    assert fit_width(wide, 4) is wide
    model = tiny(corpus)
    twin = copy.deepcopy(model)
    r1, r2 = SingleDevice(model).train_step(batch), SingleDevice(twin).train_step(wide)
    assert r1.nll_sum == pytest.approx(r2.nll_sum, rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- perplexity and learning

def test_evaluate_is_exp_of_nll_over_all_real_tokens(corpus):
    model = tiny(corpus).eval()
    sentences = corpus.valid[:30]
    total = 0.0
    with torch.no_grad():  # one sentence at a time: no padding, no batching
        for s in sentences:
            inputs = torch.cat([torch.tensor([2]), s[:-1]]).unsqueeze(1)   # (T, 1): <eos> w1 .. wn
            total += training.nll_sum(model(inputs)[0], s.unsqueeze(1)).item()
    tokens = sum(len(s) for s in sentences)
    assert evaluate(model, sentences, batch_size=8) == pytest.approx(math.exp(total / tokens), rel=1e-5)


def test_tiny_model_halves_the_unigram_perplexity(corpus):
    # Half an epoch in batches of 8 (600 updates) gets test perplexity near 140 against a
    # unigram 382; small batches learn fastest per token here. About 10 s on 2 cores.
    model = tiny(corpus)
    history = train(model, corpus, epochs=1, batch_size=8, lr=20.0, seed=0, limit_batches=600, **quiet())
    unigram = corpus.unigram_perplexity("test")
    test_ppl = evaluate(model, corpus.test, batch_size=64)  # the whole test split
    assert test_ppl < unigram / 2, (history.to_dict(), test_ppl, unigram)
    assert history.epochs[0]["train_ppl"] < unigram


def test_stream_mode_trains(corpus):
    part = Corpus(corpus.vocab, corpus.train[:1500], corpus.valid[:100], corpus.test[:100], name="part")
    seen = []

    class Spy(SingleDevice):
        def train_step(self, batch):
            seen.append(batch.carry_state)
            return super().train_step(batch)

    model = tiny(corpus)
    history = train(model, part, runner=Spy(model), epochs=2, batch_size=16, bptt=20, lr=20.0, seed=0, **quiet())
    assert seen and all(seen)
    valid = history.valid_ppls
    # after two epochs (measured over seeds 0-2: about 200-230) well under the unigram 390
    assert valid[1] < valid[0] and valid[1] < 0.8 * part.unigram_perplexity("valid")


def test_lr_halves_when_validation_gains_less_than_one():
    fake = History([{"valid_ppl": v} for v in (300.0, 200.0, 199.5, 250.0, 240.0)])
    lrs, lr = [], 20.0
    for n in range(1, len(fake.epochs) + 1):
        lr = next_lr(lr, fake.valid_ppls[:n])
        lrs.append(lr)
    assert lrs == [20.0, 20.0, 10.0, 5.0, 5.0]
    assert next_lr(1.0, [100.0, 99.0]) == 1.0   # a gain of exactly 1.0 is enough
    assert next_lr(1.0, [100.0, 99.01]) == 0.5


def test_training_applies_the_lr_rule(little, monkeypatch):
    valid = iter([300.0, 200.0, 199.5, 250.0])
    monkeypatch.setattr(training, "evaluate", lambda *a, **k: next(valid, 100.0))
    history = train(tiny(little), little, epochs=4, lr=8.0, batch_size=16, limit_batches=1, **quiet())
    assert [e["lr"] for e in history.epochs] == [8.0, 8.0, 8.0, 4.0]


def test_history_is_json_and_complete(little):
    history = train(tiny(little), little, epochs=2, batch_size=16, **quiet())
    back = History.from_dict(json.loads(history.to_json()))
    assert back == history
    assert set(history.epochs[0]) >= {"epoch", "lr", "train_ppl", "valid_ppl", "tokens_per_s", "seconds"}
    assert history.epochs[1]["epoch"] == 2 and history.test_ppl > 1
    assert history.epochs[0]["tokens"] == little.tokens("train")  # every token once an epoch
    assert history.summary()["bubble_fraction"] is None           # no timelines on one device


def test_progress_bars_go_to_stderr(little, capsys):
    train(tiny(little), little, epochs=1, batch_size=16, progress=True, log=lambda line: None)
    assert "epoch 1/1" in capsys.readouterr().err


def test_a_pipeline_runner_trains_like_one_device(little):
    pipeline = pytest.importorskip("mpedu.pipeline", reason="mpedu.pipeline not importable yet")
    runs = []
    for make_runner in (SingleDevice, lambda m: pipeline.Pipeline(m, 2, "gpipe", micro_batches=4)):
        model = tiny(little)
        runner = make_runner(model)
        try:  # batches of 16 and narrower bucket tails: fit_width pads those to a multiple of 4
            runs.append(train(model, little, runner=runner, epochs=1, batch_size=16, lr=5.0, **quiet()))
        finally:
            runner.close()
    one, piped = runs
    assert piped.epochs[0]["tokens"] == one.epochs[0]["tokens"] == little.tokens("train")
    # Equal up to float rounding (measured 4e-7), which SGD steps amplify: at lr 20 one device
    # with 1 vs 2 threads ends its epoch 5e-4 apart, so compare at a gentle lr.
    for key in ("train_ppl", "valid_ppl"):
        assert piped.epochs[0][key] == pytest.approx(one.epochs[0][key], rel=1e-5), key
    assert piped.test_ppl == pytest.approx(one.test_ppl, rel=1e-5)
    assert 0 < piped.summary()["bubble_fraction"] < 1


@pytest.mark.parametrize("width", [1, 3, 6])
def test_a_pipeline_step_on_a_narrow_batch_equals_one_device(little, width):
    # width 1 with 4 micro-batches: three of them are all padding (no tokens at all)
    pipeline = pytest.importorskip("mpedu.pipeline", reason="mpedu.pipeline not importable yet")
    batch = first_batch(little.train, batch_size=width)
    model = tiny(little)
    twin = copy.deepcopy(model)
    expected = SingleDevice(model).train_step(batch)
    with pipeline.Pipeline(twin, 2, "gpipe", micro_batches=4) as pipe:
        got = pipe.train_step(fit_width(batch, 4))
    assert (got.tokens, got.nll_sum) == (expected.tokens, pytest.approx(expected.nll_sum, rel=1e-6))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_divergence_stops_training_with_advice(little):
    class Diverges(SingleDevice):
        def train_step(self, batch):
            result = super().train_step(batch)
            return training.StepResult(math.nan, math.nan, result.tokens)

    model = tiny(little)
    with pytest.raises(FloatingPointError, match=r"loss nan at epoch 1, batch 0; lower the learning rate \(now 20\)"):
        train(model, little, runner=Diverges(model), epochs=1, batch_size=16, lr=20.0, **quiet())


# ---------------------------------------------------------------- checkpoints and resume

def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_run(a, b, model_a, model_b):
    for key in ("train_ppl", "valid_ppl", "lr", "tokens", "steps"):
        assert [e[key] for e in a.epochs] == [e[key] for e in b.epochs], key
    assert a.test_ppl == b.test_ppl
    pa, pb = params(model_a), params(model_b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


RUN = dict(batch_size=16, lr=5.0, seed=7, checkpoint_every=4)


def test_resume_after_an_epoch_equals_an_uninterrupted_run(little, tmp_path):
    straight = tiny(little, dropout=0.3)  # dropout: the restored RNG state matters
    h_straight = train(straight, little, epochs=3, out=tmp_path / "a", **quiet(**RUN))

    train(tiny(little, dropout=0.3), little, epochs=1, out=tmp_path / "b", **quiet(**RUN))
    resumed = tiny(little, seed=99, dropout=0.3)  # another init: the checkpoint must overwrite it
    h_resumed = train(resumed, little, epochs=3, out=tmp_path / "b", resume=True, **quiet(**RUN))
    assert_same_run(h_straight, h_resumed, straight, resumed)


def test_resume_mid_epoch_equals_an_uninterrupted_run(little, tmp_path):
    straight = tiny(little, dropout=0.3)
    h_straight = train(straight, little, epochs=2, out=tmp_path / "a", **quiet(**RUN))

    per_epoch = len(BucketIterator(little.train, RUN["batch_size"]))

    class Crash(SingleDevice):
        steps = 0

        def train_step(self, batch):
            Crash.steps += 1
            if Crash.steps == per_epoch + 7:  # epoch 2, batch 7: the last checkpoint is at batch 4
                raise RuntimeError("simulated crash")
            return super().train_step(batch)

    model = tiny(little, dropout=0.3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, little, runner=Crash(model), epochs=2, out=tmp_path / "b", **quiet(**RUN))
    position = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["position"]
    assert (position["epoch"], position["batch"]) == (1, 4)

    resumed = tiny(little, seed=99, dropout=0.3)
    h_resumed = train(resumed, little, epochs=2, out=tmp_path / "b", resume=True, **quiet(**RUN))
    assert_same_run(h_straight, h_resumed, straight, resumed)


def small_checkpoint(path, corpus, marker):
    model = tiny(corpus)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    save_checkpoint(path, model=model, optimizer=optimizer, vocab=corpus.vocab,
                    history=History([{"marker": marker}]), epoch=marker)
    return model


def test_a_crash_while_writing_keeps_the_old_checkpoint(little, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    real_save = torch.save

    def dies_halfway(obj, f):  # the disk fills up (or the process dies) half-way through the write
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="simulated"):
        small_checkpoint(path, little, marker=2)
    monkeypatch.undo()
    assert load_checkpoint(path)["history"]["epochs"] == [{"marker": 1}]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left behind


def test_a_truncated_checkpoint_names_the_file(little, tmp_path):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="damaged") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    with pytest.raises(CheckpointError, match="checkpoint.pt"):
        train(tiny(little), little, epochs=1, out=tmp_path, resume=True, **quiet())
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_a_checkpoint_of_another_model_is_refused(little, tmp_path):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    other = LSTMLM.from_config("small", vocab_size=len(little.vocab))
    with pytest.raises(CheckpointError) as err:
        train(other, little, epochs=1, out=tmp_path, resume=True, **quiet())
    assert "'tiny' model" in str(err.value) and "'small' model" in str(err.value)

    words = list(little.vocab.itos)
    words[10], words[11] = words[11], words[10]
    swapped = Corpus(Vocabulary(words), little.train, little.valid, little.test, name="swapped")
    with pytest.raises(CheckpointError, match="another vocabulary.*differ at id 10"):
        train(tiny(little), swapped, epochs=1, out=tmp_path, resume=True, **quiet())


def test_final_model_and_vocabulary_load_back(little, tmp_path):
    model = tiny(little)
    train(model, little, epochs=1, batch_size=16, out=tmp_path, **quiet())
    loaded, vocab = load_model(tmp_path / "model.pt")
    assert vocab.itos == little.vocab.itos and loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(CheckpointError, match="not an mpedu model file"):
        load_model(tmp_path / "checkpoint.pt")
