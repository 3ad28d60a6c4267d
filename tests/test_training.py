"""The training loop: learning, perplexity, lr decay, the one step, divergence, settings refused before training."""
import copy
import importlib
import math
import os
import re
import threading

import pytest
import torch

from conftest import first_batch, lm, quiet
from mpedu.lm import Corpus, nll_sum
from mpedu.training import History, evaluate, next_lr, step, train
from mpedu.core import Pipeline, SingleDevice, fit_width


training = importlib.import_module("mpedu.training.loop")  # the module: `mpedu.train` is the function


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

TWO = "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"          # the tiny config has lstm0, lstm1

RUN = dict(batch_size=16, lr=5.0, seed=3, checkpoint_every=3)


# ---------------------------------------------------------------- the runner


# ---------------------------------------------------------------- perplexity and learning

def test_evaluate_is_exp_of_nll_over_all_real_tokens(corpus):
    """Whole sentences, each from a fresh state: the default buckets stop at the 99th percentile and cut the
    longest sentences into pieces that each started afresh (PTB test: 431.94 against 431.82)."""
    from mpedu.lm import BucketIterator
    model = lm(corpus).eval()
    with torch.no_grad():              # larger recurrent weights: a piece's fresh state changes its loss
        for name, p in model.named_parameters():
            if "lstm" in name:
                p.mul_(8)
    sentences = corpus.valid[:300]
    assert BucketIterator(sentences, 8).split_sentences > 0         # the training batches would cut some
    total = 0.0
    with torch.no_grad():  # one sentence at a time: no padding, no batching
        for s in sentences:
            inputs = torch.cat([torch.tensor([2]), s[:-1]]).unsqueeze(1)   # (T, 1): <eos> w1 .. wn
            total += nll_sum(model(inputs)[0], s.unsqueeze(1)).item()
    tokens = sum(len(s) for s in sentences)
    assert evaluate(model, sentences, batch_size=8) == pytest.approx(math.exp(total / tokens), rel=1e-6)


def test_tiny_model_halves_the_unigram_perplexity(corpus):
    # Half an epoch in batches of 8 (600 updates) gets test perplexity near 140 against a
    # unigram 382; small batches learn fastest per token here. About 10 s on 2 cores.
    model = lm(corpus)
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

    model = lm(corpus)
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
    history = train(lm(little), little, epochs=4, lr=8.0, batch_size=16, limit_batches=1, **quiet())
    assert [e["lr"] for e in history.epochs] == [8.0, 8.0, 8.0, 4.0]


def test_progress_bars_go_to_stderr(little, capsys):
    train(lm(little), little, epochs=1, batch_size=16, progress=True, log=lambda line: None)
    assert "epoch 1/1" in capsys.readouterr().err


def test_a_pipeline_runner_trains_like_one_device(little):
    pipeline = pytest.importorskip("mpedu.core.pipeline", reason="mpedu.core.pipeline not importable yet")
    runs = []
    for make_runner in (SingleDevice, lambda m: pipeline.Pipeline(m, 2, "gpipe", micro_batches=4)):
        model = lm(little)
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
    pipeline = pytest.importorskip("mpedu.core.pipeline", reason="mpedu.core.pipeline not importable yet")
    batch = first_batch(little.train, batch_size=width)
    model = lm(little)
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

    model = lm(little)
    with pytest.raises(FloatingPointError, match=r"loss nan at epoch 1, batch 0; lower the learning rate \(now 20\)"):
        train(model, little, runner=Diverges(model), epochs=1, batch_size=16, lr=20.0, **quiet())


# ---------------------------------------------------------------- bad settings, refused before training

@pytest.mark.parametrize("buckets, words", [([], "empty"), ([0, 10], "positive"), ([5, 5], "twice")])
def test_train_refuses_bad_buckets_before_training(little, buckets, words):
    with pytest.raises(ValueError, match=words):
        train(lm(little), little, epochs=1, buckets=buckets, **quiet(**RUN))


def test_wavefront_chunks_longer_than_a_bucket_fail_before_training(little):
    model = lm(little)
    with Pipeline(model, TWO, "wavefront", micro_batches=1, chunks=6) as pipe:
        with pytest.raises(ValueError, match="chunks=6, but some train batches have only 5 time steps"):
            train(model, little, runner=pipe, epochs=1, buckets=[5, 20, 60], **quiet(**RUN))


@pytest.mark.parametrize("setting, value", [("epochs", -1), ("batch_size", 0), ("lr", math.inf), ("lr", 0), ("lr", 1e39),
                                            ("clip", -1.0), ("seed", -5), ("bptt", 0), ("limit_batches", 0),
                                            ("checkpoint_every", 2.5), ("epochs", True)])
def test_train_names_a_bad_setting(little, setting, value):
    with pytest.raises(ValueError, match=re.escape(f"{setting}={value!r}")):
        train(lm(little), little, **quiet(**{**RUN, setting: value}))


# ---------------------------------------------------------------- the decay rule of the recipes

def test_the_decay_rule_divides_after_the_named_epoch():
    from mpedu.training import scheduled_lr
    lrs = [20.0]
    for epoch in range(1, 7):
        lrs.append(scheduled_lr(lrs[-1], epoch, 4, 2.0))
    assert lrs == [20, 20, 20, 20, 10, 5, 2.5]      # epochs 1-4 at 20, then halved every epoch (Zaremba)


# ---------------------------------------------------------------- the one step (train(), the command line, the explorer)

def test_the_step_clips_and_updates_like_sgd_by_hand(corpus):
    batch = first_batch(corpus.train[:40])
    model, twin = lm(corpus, dropout=0.0), lm(corpus, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    result, stepped = step(SingleDevice(model), optimizer, batch, clip=0.1)
    assert stepped and result.tokens == batch.tokens
    reference = SingleDevice(twin).train_step(batch)
    params = list(twin.parameters())
    torch.nn.utils.clip_grad_norm_(params, 0.1)
    with torch.no_grad():
        for p in params:
            p -= 2.0 * p.grad
    assert result.loss == reference.loss
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p, q)


def test_a_non_finite_loss_leaves_the_weights_and_says_so(corpus):
    model = lm(corpus)
    before = [p.detach().clone() for p in model.parameters()]
    runner = SingleDevice(model)
    real = runner.train_step

    def poisoned(batch):
        result = real(batch)
        return training.StepResult(math.nan, math.nan, result.tokens)
    runner.train_step = poisoned
    result, stepped = step(runner, torch.optim.SGD(model.parameters(), lr=1.0), first_batch(corpus.train[:40]))
    assert not stepped and math.isnan(result.loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _in_another_thread(fn):
    """fn() on another thread: what it returned, or the exception it raised."""
    result = []

    def run():
        try:
            result.append(fn())
        except Exception as e:          # noqa: BLE001 - handed back to the test's thread
            result.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_a_runner_holding_part_of_the_model_writes_no_checkpoint(little, tmp_path):
    # a torchrun rank (DistributedPipeline) holds only its layers: with out= every rank saved a checkpoint whose
    # other layers were still at their first weights, and --resume then trained on from it
    from mpedu.core import SingleDevice
    model = lm(little)
    rank = SingleDevice(model)
    rank.owned = ["embed", "lstm0"]
    with pytest.raises(ValueError, match="trains only embed, lstm0: the other layers' weights here are their first"):
        train(model, little, runner=rank, epochs=1, batch_size=16, limit_batches=1, out=tmp_path / "run", **quiet())
    assert not (tmp_path / "run").exists()
    rank.owned, rank.world = list(model.layer_names), 2     # every layer, on each of 2 ranks (data parallel)
    with pytest.raises(ValueError, match="each of the 2 torchrun ranks write the same checkpoint"):
        train(model, little, runner=rank, epochs=1, batch_size=16, limit_batches=1, out=tmp_path / "run", **quiet())
    rank.world = 1                                           # a one-rank group: the whole model, one writer
    train(model, little, runner=rank, epochs=1, batch_size=16, limit_batches=1, out=tmp_path / "run", **quiet())
    assert (tmp_path / "run" / "checkpoint.pt").exists()


def test_train_locks_its_out_folder_against_another_run(little, tmp_path, monkeypatch):
    """Library train(out=...) creates the folder and holds its lock, as the command line does: another run
    on the same checkpoint.pt (here on another thread of this process) is refused, naming the holder."""
    from mpedu.runtime import LOCK_NAME, OutFolderError, OutLock
    out = tmp_path / "new" / "run"
    tried = []

    def lock_attempt():
        with OutLock(out):
            return "taken"
    # evaluate() runs inside train(), while it holds the lock: try the lock from another thread then
    monkeypatch.setattr(training, "evaluate", lambda *a, **k: tried.append(_in_another_thread(lock_attempt)) or 100.0)
    train(lm(little), little, epochs=1, batch_size=16, limit_batches=1, out=out, **quiet())
    assert tried and all(isinstance(e, OutFolderError) and "in use by another mpedu run" in str(e) for e in tried)
    assert (out / "checkpoint.pt").exists() and (out / LOCK_NAME).read_text() == ""    # released at the end
    with OutLock(out):               # someone else holds it: train() refuses before training
        refused = _in_another_thread(
            lambda: train(lm(little), little, epochs=1, batch_size=16, limit_batches=1, out=out, **quiet()))
    assert isinstance(refused, OutFolderError) and f"(pid {os.getpid()}" in str(refused)


def test_limit_batches_says_when_valid_and_test_cover_only_their_first_batches(little):
    """The first batches of a split in order are its shortest sentences: a limited run's valid and test
    perplexities are not the splits' (PTB test: 658 for the first 10 batches, 967 whole), and said so nowhere."""
    lines = []
    history = train(lm(little), little, epochs=1, batch_size=16, limit_batches=2, **quiet(lines))
    note = next(line for line in lines if line.startswith("note: limit_batches=2"))
    assert "valid 2 of 9" in note and "test 2 of 10" in note and "shortest sentences first" in note, note
    assert lines[-1] == f"test ppl {history.test_ppl:.2f} (its first 2 of 10 batches)"
    assert history.test_ppl != pytest.approx(evaluate(SingleDevice(lm(little)), little.test, 16), rel=1e-3)
    lines = []                  # a limit the splits do not reach: whole splits, nothing to say
    train(lm(little), little, epochs=1, batch_size=16, limit_batches=10, **quiet(lines))
    assert not any(line.startswith("note: limit_batches") for line in lines), lines
    assert lines[-1].startswith("test ppl") and "first" not in lines[-1]


def test_callbacks_see_every_batch_and_epoch_as_training_goes(little):
    seen = []
    history = train(lm(little), little, epochs=2, limit_batches=3, **RUN, **quiet(), callbacks={
        "on_batch_end": lambda epoch, i, result: seen.append(("batch", epoch, i, round(result.loss, 6))),
        "on_epoch_end": lambda record: seen.append(("epoch", record["epoch"], record["valid_ppl"]))})
    assert [s[:3] for s in seen] == [("batch", 0, 0), ("batch", 0, 1), ("batch", 0, 2), ("epoch", 1, history.valid_ppls[0]),
                                     ("batch", 1, 0), ("batch", 1, 1), ("batch", 1, 2), ("epoch", 2, history.valid_ppls[1])]
    assert all(math.isfinite(s[3]) for s in seen if s[0] == "batch")
    with pytest.raises(ValueError, match="on_batch_end, on_epoch_end"):
        train(lm(little), little, epochs=1, **RUN, **quiet(), callbacks={"on_step": print})


def test_train_installs_a_memory_cap_on_its_pipeline(little):
    from mpedu.predict import MemoryCapError
    model = lm(little)
    with Pipeline(model, TWO, "gpipe", micro_batches=2) as pipe:
        with pytest.raises(MemoryCapError, match="more than its memory_cap"):
            train(model, little, runner=pipe, epochs=1, limit_batches=1, memory_cap="1kB", **RUN, **quiet())
    with pytest.raises(ValueError, match="memory_cap applies to a Pipeline"):
        train(lm(little), little, epochs=1, memory_cap="1kB", **RUN, **quiet())
