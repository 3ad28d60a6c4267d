"""Exactly the single-device numbers on every schedule: frozen layers, stream mode, and positional dropout."""
import copy
import json
import math

import pytest
import torch

from conftest import VOCAB, make_batch, tiny_model, train_both
from mpedu.lm import Batch, LMConfig, LSTMLM, StreamIterator
from mpedu.core import Pipeline, Placement, SingleDevice
from mpedu.training import evaluate
from test_distributed import torchrun, torchrun_job

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

# embed alone on stage 0 (token ids in); lstm0-1 on stage 1 (floats in); devices revisited
FOUR = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"
THREE = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2,decode:vgpu2"          # zb1: one stage per device
V = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu1 | lstm2,decode:vgpu0"  # a V: stages 1 and 2 share vgpu1, 0 and 3 vgpu0
# schedule, placement, micro-batches, time chunks: every schedule, with m > 1 (and chunks) somewhere
SCHEDULES = [("naive", FOUR, 2, 1), ("gpipe", FOUR, 4, 1), ("1f1b", FOUR, 4, 1), ("interleaved", FOUR, 4, 1),
             ("looped_bfs", FOUR, 4, 1), ("zb1", THREE, 4, 1), ("wavefront", FOUR, 2, 3), ("gpipe", V, 4, 1),
             ("zbv", V, 4, 1), ("dualpipev", V, 4, 1), ("zb_cap2", THREE, 4, 1), ("zb_cap1", V, 2, 1)]
SCHEDULES += [("v_half", V, 4, 1), ("v_min", V, 4, 1)]               # the V-shapes that hold less
IDS = [s[0] + ("-v" if s[1] == V and s[0] not in ("zbv", "dualpipev") else "") for s in SCHEDULES]
P = 0.4          # dropout probability of the tests that use dropout


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def one_device(model, batches, seed=0):
    """Loss and gradients of each batch on SingleDevice (the reference), gradients zeroed between."""
    runner, out = SingleDevice(model), []
    runner.dropout_seed = seed
    for batch in batches:
        model.zero_grad(set_to_none=True)
        out.append((runner.train_step(batch).loss, grads(model)))
    return out


def pipelined(model, schedule, placement, m, chunks, batches, seed=0, **options):
    out = []
    with Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks, **options) as pipe:
        pipe.dropout_seed = seed
        for batch in batches:
            model.zero_grad(set_to_none=True)
            out.append((pipe.train_step(batch).loss, grads(model)))
    return out


def assert_same(got, expected, exact=False):
    """Equal losses and gradients: bit for bit when `exact`, else to float rounding, the standard of
    the transparency tests in test_pipeline.py (micro-batches sum in another order than one batch)."""
    assert len(got) == len(expected)
    for k, ((loss, g), (ref_loss, ref)) in enumerate(zip(got, expected)):
        assert set(g) == set(ref)
        if exact:
            assert loss == ref_loss, f"batch {k}"
        else:
            assert loss == pytest.approx(ref_loss, rel=1e-6), f"batch {k}"
        for name in ref:
            if ref[name] is None or g[name] is None:
                assert g[name] is None and ref[name] is None, f"batch {k}: {name} has a gradient on one side only"
            elif exact:
                assert torch.equal(g[name], ref[name]), f"batch {k}: {name}"
            else:
                torch.testing.assert_close(g[name], ref[name], rtol=1e-5, atol=1e-7, msg=f"batch {k}: {name}")


# The new schedules on 4 virtual devices (two workers a core here), a 6-LSTM model: the V-shapes and zero bubble
# capped at 3 go down the devices and back ("v": Placement.v_shape), looped BFS round them twice, zero bubble
# capped at 2 one stage a device
LOOPED_FOUR = ("embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu2 | lstm2:vgpu3 | "
               "lstm3:vgpu0 | lstm4:vgpu1 | lstm5:vgpu2 | decode:vgpu3")
ONE_EACH_FOUR = "embed,lstm0:vgpu0 | lstm1-2:vgpu1 | lstm3-4:vgpu2 | lstm5,decode:vgpu3"
FOUR_DEVICES = [("zbv", "v"), ("dualpipev", "v"), ("v_half", "v"), ("v_min", "v"), ("zb_cap3", "v"),
                ("looped_bfs", LOOPED_FOUR), ("zb_cap2", ONE_EACH_FOUR)]


def on_four(model, placement):
    if placement != "v":
        return placement
    v = Placement.v_shape(model, 4)
    assert v.stage_devices == [0, 1, 2, 3, 3, 2, 1, 0]
    return v


@pytest.mark.parametrize("dropout", [0.0, P], ids=["dropout0", "dropout"])
@pytest.mark.parametrize("schedule,placement", FOUR_DEVICES, ids=[s for s, _ in FOUR_DEVICES])
def test_the_new_schedules_on_four_devices_give_the_single_device_loss_and_gradients(schedule, placement, dropout):
    """m = 8 (DualPipeV needs 2p), two batches."""
    batches = [make_batch(T=7, B=8, seed=1), make_batch(T=9, B=8, seed=2)]
    expected = one_device(tiny_model(num_layers=6, dropout=dropout), batches, seed=3)
    model = tiny_model(num_layers=6, dropout=dropout)
    assert_same(pipelined(model, schedule, on_four(model, placement), 8, 1, batches, seed=3), expected)


@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_every_schedule_applies_exactly_the_single_device_masks(drawn_masks, schedule, placement, m, chunks):
    """Each (micro-batch, chunk) draws its slice; put together, the slices are the one-device masks, bit for bit."""
    drawn = drawn_masks          # (layer, position, mask), appended from every device's thread
    batch = make_batch(T=9, B=8)
    one_device(tiny_model(dropout=P), [batch], seed=3)
    expected = {layer: mask for layer, _, mask in drawn}
    assert len(expected) == 4                       # embed, lstm0-2
    drawn.clear()
    pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, [batch], seed=3)
    assert len(drawn) == 4 * m * chunks
    for layer, mask in expected.items():
        together = torch.zeros_like(mask)
        for _, where, part in (d for d in drawn if d[0] == layer):
            t, b, _ = part.shape
            together[where.time:where.time + t, where.sequence:where.sequence + b] = part
        assert torch.equal(together, mask), f"layer {layer}"


# ---------------------------------------------------------------- loss and gradients with dropout

@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_dropout_gives_the_single_device_loss_and_gradients(schedule, placement, m, chunks):
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]      # two steps: two sets of masks
    reference = one_device(tiny_model(dropout=P), batches, seed=3)
    assert_same(pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, batches, seed=3), reference)
    # the masks matter: another seed, or no dropout, is far from the reference
    for other in (pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, batches[:1], seed=4),
                  one_device(tiny_model(dropout=0.0), batches[:1])):
        assert abs(other[0][0] - reference[0][0]) > 1e-3


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b", "zb1", "wavefront"])   # (interleaved needs m >= 2)
@pytest.mark.parametrize("placement", [THREE, "embed,lstm0-2,decode:vgpu0"])
def test_one_micro_batch_one_chunk_is_bit_for_bit_the_single_device_step(schedule, placement):
    """With the same arithmetic (m = 1, no time chunks) a placement and schedule gives the
    single-device loss and gradients bit for bit, dropout included."""
    batch = make_batch(T=9, B=8)
    reference = one_device(tiny_model(dropout=P), [batch], seed=2)
    assert_same(pipelined(tiny_model(dropout=P), schedule, placement, 1, 1, [batch], seed=2), reference, exact=True)


@pytest.mark.parametrize("recompute", [{1: "all"}, "all", "all-but-last"], ids=str)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
def test_recomputation_with_one_micro_batch_is_bit_for_bit_the_single_device_step(schedule, recompute):
    """A recomputing stage's first forward ran without autograd, where an LSTM's kernels round differently:
    the activation sent on was not the one R differentiates (gradients off by ~2e-7 relative)."""
    batch = make_batch(T=9, B=8)
    reference = one_device(tiny_model(dropout=P), [batch], seed=2)
    assert_same(pipelined(tiny_model(dropout=P), schedule, THREE, 1, 1, [batch], seed=2, recompute=recompute),
                reference, exact=True)


@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_three_seeded_repeats_are_bit_for_bit_equal(schedule, placement, m, chunks):
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]
    first = pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, batches, seed=9)
    for _ in range(2):
        assert_same(pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, batches, seed=9), first,
                    exact=True)


# ---------------------------------------------------------------- frozen layers

FROZEN = {
    "embed alone on its stage": ["embed"],                       # stage 0: token ids in, nothing to train
    "lstm0 sharing a stage with lstm1": ["lstm0"],
    "a whole stage of floats, nothing trainable upstream": ["embed", "lstm0", "lstm1"],
}


@pytest.mark.parametrize("frozen", list(FROZEN.values()), ids=list(FROZEN))
@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_frozen_layers_train_like_one_device(schedule, placement, m, chunks, frozen):
    def build():
        model = tiny_model(dropout=P)
        for name in frozen:
            model.layers[name].requires_grad_(False)
        return model
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]
    reference = one_device(build(), batches, seed=1)
    got = pipelined(build(), schedule, placement, m, chunks, batches, seed=1)
    assert_same(got, reference)
    assert all(g is None for name, g in got[0][1].items() if name.split(".")[1] in frozen)


@pytest.mark.parametrize("schedule,m,chunks", [("gpipe", 4, 1), ("zb1", 4, 1), ("wavefront", 1, 2),
                                              ("wavefront", 2, 3)])
def test_a_frozen_lstm_on_token_ids_beside_a_training_one_on_stage_0(schedule, m, chunks):
    """embed and lstm0 frozen, lstm1 training on the same first stage: with time chunks only lstm1's state
    wants a gradient from the next chunk, and it went to lstm0's state, paired by position (a crash in
    backward: "element 1 of tensors does not require grad")."""
    def build():
        model = tiny_model(dropout=P)
        model.layers["embed"].requires_grad_(False)
        model.layers["lstm0"].requires_grad_(False)
        return model
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]
    got = pipelined(build(), schedule, "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1", m, chunks, batches, seed=1)
    assert_same(got, one_device(build(), batches, seed=1))
    assert got[0][1]["layers.lstm1.lstm.weight_hh_l0"] is not None


def test_a_layer_frozen_after_the_pipeline_was_built_gets_no_gradient():
    model = tiny_model()
    with Pipeline(model, THREE, "zb1", micro_batches=2) as pipe:
        model.layers["embed"].requires_grad_(False)
        pipe.train_step(make_batch())
        assert model.layers["embed"].embedding.weight.grad is None
        assert model.layers["lstm0"].lstm.weight_ih_l0.grad is not None


def test_a_weight_replaced_after_the_pipeline_was_built_trains_and_a_replaced_layer_is_refused():
    """A weight assigned after the Pipeline was built (a pretrained embedding) is the one forward uses; backward
    asked for the old one's gradient, so the new one got none (the single device's gradient norm: 0.04)."""
    batch = make_batch(T=9, B=8)
    reference = tiny_model()
    torch.manual_seed(5)
    new_weight = torch.randn_like(reference.layers["decode"].linear.weight) * 0.1
    reference.layers["decode"].linear.weight = torch.nn.Parameter(new_weight.clone())
    expected = one_device(reference, [batch])
    model = tiny_model()
    with Pipeline(model, THREE, "zb1", micro_batches=2) as pipe:
        model.layers["decode"].linear.weight = torch.nn.Parameter(new_weight.clone())
        model.zero_grad(set_to_none=True)
        got = [(pipe.train_step(batch).loss, grads(model))]
        assert_same(got, expected)
        model.layers["lstm0"] = copy.deepcopy(model.layers["lstm0"])     # a whole layer swapped: refused, named
        with pytest.raises(RuntimeError, match="layer 'lstm0' was replaced after this Pipeline was built"):
            pipe.train_step(batch)


# ---------------------------------------------------------------- stream mode

def stream(T=5, B=8, seed=0):
    """Windows of one stream cut into T-step windows, the last one shorter (but >= 3 steps, for 3 chunks)."""
    g = torch.Generator().manual_seed(seed)
    sentences = [torch.randint(3, VOCAB, (int(k),), generator=g) for k in torch.randint(3, 9, (40,), generator=g)]
    windows = StreamIterator(sentences, B, T)
    batches = list(windows)
    assert len(batches) >= 3 and 3 <= batches[-1].inputs.shape[0] < T, "the test needs a shorter last window"
    return sentences, batches


@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_stream_mode_carries_state_into_a_shorter_last_window_like_one_device(schedule, placement, m, chunks):
    sentences, batches = stream()
    assert_same(pipelined(tiny_model(dropout=P), schedule, placement, m, chunks, batches, seed=6),
                one_device(tiny_model(dropout=P), batches, seed=6))
    model = tiny_model()
    expected = evaluate(SingleDevice(model), sentences, 8, bptt=5)
    with Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks) as pipe:
        assert evaluate(pipe, sentences, 8, bptt=5) == pytest.approx(expected, rel=1e-6)
        # the state matters: each window from zero state gives another number
        fresh = 0.0
        for b in batches:
            pipe.reset_state()
            fresh += pipe.eval_step(b).nll_sum
    tokens = sum(b.tokens for b in batches)
    assert abs(math.exp(fresh / tokens) - expected) > 1e-3


# ---------------------------------------------------------------- torchrun: one process per device

@torchrun_job
def test_torchrun_check_with_dropout_equals_one_process(tmp_path):
    proc, _ = torchrun("check", "--schedule", "naive,gpipe,1f1b,zb1", "--micro-batches", "4", "--batch-size", "16",
                       "--dropout", "0.5", "--seed", "2", "--placement", "embed:vgpu0 | lstm0,lstm1,decode:vgpu1",
                       "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the reference, computed here: the single-device runner on the ranks' weights, batch and seed
    init, saved = torch.load(tmp_path / "check-init.pt"), torch.load(tmp_path / "check-batch.pt")
    config = LMConfig(**init["config"])
    assert config.dropout == 0.5
    batch = Batch(saved["inputs"], saved["targets"], saved["targets"] != 0, saved["inputs"].shape[0], False)
    results = {}
    for p in (0.5, 0.0):
        model = LSTMLM(init["vocab_size"], LMConfig(**{**init["config"], "dropout": p}))
        model.load_state_dict(init["state"])
        results[p] = one_device(model, [batch], seed=init["seed"])[0]
    loss, ref = results[0.5]
    assert abs(loss - results[0.0][0]) > 1e-3, "the check must run with dropout on"
    report = json.loads((tmp_path / "check.json").read_text())["schedules"]
    for schedule in ("naive", "gpipe", "1f1b", "zb1"):
        assert report[schedule]["equal"]
        assert report[schedule]["loss"] == pytest.approx(loss, rel=1e-6)
        got = {k: v for rank in (0, 1) for k, v in torch.load(tmp_path / f"grads-{schedule}-rank{rank}.pt").items()}
        assert set(got) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")


@pytest.mark.parametrize("schedule,m,chunks", [("gpipe", 4, 1), ("wavefront", 2, 2)])
def test_train_and_evaluate_in_stream_mode_through_a_pipeline_equal_one_device(schedule, m, chunks):
    from mpedu.lm import Corpus, load_corpus
    corpus = load_corpus()
    little = Corpus(corpus.vocab, corpus.train[:150], corpus.valid[:30], corpus.test[:30], name="little")
    windows = StreamIterator(little.train, 16, 35)
    assert windows.steps % 35, "the test needs a shorter last window"
    def fresh():
        torch.manual_seed(0)
        return LSTMLM.from_config("tiny", vocab_size=len(little.vocab), dropout=0.3)
    pipeline = dict(placement="embed,lstm0:vgpu0 | lstm1,decode:vgpu1", schedule=schedule, micro_batches=m,
                    chunks=chunks)
    (h_one, m_one), (h_pipe, m_pipe) = train_both(fresh, little, pipeline, batch_size=16, lr=5.0, seed=4, bptt=35)
    for key in ("train_ppl", "valid_ppl"):
        assert h_pipe.epochs[0][key] == pytest.approx(h_one.epochs[0][key], rel=1e-5), key
    assert h_pipe.test_ppl == pytest.approx(h_one.test_ppl, rel=1e-5)
    for (name, a), b in zip(m_one.state_dict().items(), m_pipe.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
