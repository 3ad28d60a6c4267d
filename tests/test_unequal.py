"""Micro-batches of unequal size, Pipeline(..., micro_batches=[1, 3, 2, 2]): one device's numbers on every schedule,
the memory model and the simulator at each micro-batch's own width, and the refusals in words."""
import dataclasses
import math

import pytest
import torch

from conftest import fake_costs, lm, make_batch, tiny_model, train_both
from mpedu.core import Pipeline, Placement, SingleDevice, Timeline, fit_width, fitted, one_f_one_b
from mpedu.lm import check_sizes
from mpedu.predict import CostCurve, device_footprints, memory_estimate, predict_epoch, profile, simulate
from mpedu.training import evaluate
from test_exact import assert_same, one_device, pipelined, stream

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

TWO = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
THREE = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2,decode:vgpu2"
LOOPED_TWO = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"                 # interleaved: 2 stages each
LOOPED_THREE = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu2 | lstm2:vgpu0 | lstm3:vgpu1 | decode:vgpu2"   # 4 LSTMs
V = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0"       # zbv, dualpipev: down and back up
# schedule, devices, placement, LSTM layers, sizes of a batch of 8, time chunks; interleaved: m a multiple of p
CASES = [
    ("gpipe", 2, TWO, 3, [1, 3, 2, 2], 1), ("gpipe", 3, THREE, 3, [3, 5], 1),
    ("1f1b", 2, TWO, 3, [3, 5], 1), ("1f1b", 3, THREE, 3, [1, 3, 2, 2], 1),
    ("interleaved", 2, LOOPED_TWO, 3, [1, 3, 2, 2], 1), ("interleaved", 3, LOOPED_THREE, 4, [1, 5, 2], 1),
    ("zb1", 2, TWO, 3, [1, 3, 2, 2], 1), ("zb1", 3, THREE, 3, [3, 5], 1),
    ("wavefront", 2, TWO, 3, [3, 5], 3), ("wavefront", 3, THREE, 3, [1, 3, 2, 2], 2),
    ("naive", 2, TWO, 3, [3, 5], 1), ("looped_bfs", 2, LOOPED_TWO, 3, [1, 3, 2, 2], 1),
    ("zbv", 2, V, 3, [3, 5], 1), ("dualpipev", 2, V, 3, [1, 3, 2, 2], 1),
]
IDS = [f"{c[0]}-{c[1]}dev-{c[4]}" for c in CASES]


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("schedule,devices,placement,layers,sizes,chunks", CASES, ids=IDS)
def test_unequal_micro_batches_give_the_single_device_loss_and_gradients(schedule, devices, placement, layers,
                                                                         sizes, chunks, p):
    """The loss adds nll_sum / batch tokens per micro-batch, and dropout draws at each micro-batch's first
    column (the sizes before it): the step is one device's, to float rounding, whatever the widths."""
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]       # two steps: two sets of dropout masks
    reference = one_device(tiny_model(layers, dropout=p), batches, seed=3)
    got = pipelined(tiny_model(layers, dropout=p), schedule, placement, sizes, chunks, batches, seed=3)
    assert_same(got, reference)


@pytest.mark.parametrize("schedule,placement,sizes,chunks", [("gpipe", THREE, [1, 3, 2, 2], 1),
                                                             ("wavefront", TWO, [3, 5], 3)])
def test_each_unequal_micro_batch_draws_its_slice_of_the_single_device_masks(drawn_masks, schedule, placement, sizes,
                                                                              chunks):
    drawn = drawn_masks
    batch = make_batch(T=9, B=8)
    one_device(tiny_model(dropout=0.3), [batch], seed=3)
    expected = {layer: mask for layer, _, mask in drawn}
    drawn.clear()
    pipelined(tiny_model(dropout=0.3), schedule, placement, sizes, chunks, [batch], seed=3)
    assert sorted({(w.sequence, part.shape[1]) for _, w, part in drawn}) == [
        (sum(sizes[:i]), b) for i, b in enumerate(sizes)]              # each micro-batch at its cumulative offset
    for layer, mask in expected.items():
        together = torch.zeros_like(mask)
        for _, where, part in (d for d in drawn if d[0] == layer):
            t, b, _ = part.shape
            together[where.time:where.time + t, where.sequence:where.sequence + b] = part
        assert torch.equal(together, mask), f"layer {layer}"


@pytest.mark.parametrize("schedule,placement,chunks", [("gpipe", THREE, 1), ("1f1b", TWO, 1), ("zb1", THREE, 1),
                                                      ("interleaved", LOOPED_TWO, 1), ("wavefront", TWO, 2)])
def test_an_equal_list_is_bit_for_bit_the_count(schedule, placement, chunks):
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]
    counted = pipelined(tiny_model(dropout=0.3), schedule, placement, 4, chunks, batches, seed=5)
    assert_same(pipelined(tiny_model(dropout=0.3), schedule, placement, [2, 2, 2, 2], chunks, batches, seed=5),
                counted, exact=True)


def test_the_pipeline_says_its_sizes_and_its_timeline_knows_them():
    with Pipeline(tiny_model(), TWO, "1f1b", micro_batches=[1, 3, 2, 2]) as pipe:
        assert (pipe.micro_batches, pipe.micro_batch_sizes) == (4, (1, 3, 2, 2))
        assert "micro_batches=[1, 3, 2, 2]" in repr(pipe)
        timeline = pipe.train_step(make_batch(T=9, B=8)).timeline
        assert str(pipe.bucket_plan(make_batch(T=9, B=8))).startswith("bucket T=9, B=8: micro-batches of 1, 3, 2, 2,")
    assert timeline.micro_batch_sizes == (1, 3, 2, 2)
    assert "micro-batches of 1, 3, 2, 2 sentences" in timeline.summary().splitlines()[0]
    again = Timeline.from_dict(timeline.to_dict())
    assert again.micro_batch_sizes == (1, 3, 2, 2) and again.summary() == timeline.summary()
    with Pipeline(tiny_model(), TWO, "1f1b", micro_batches=4) as pipe:
        timeline = pipe.train_step(make_batch(T=9, B=8)).timeline
    assert timeline.micro_batch_sizes == (2, 2, 2, 2) and "micro-batches of" not in timeline.summary()
    with pytest.raises(ValueError, match="micro_batch_sizes must be a list of sentence counts"):
        Timeline.from_dict({**timeline.to_dict(), "micro_batch_sizes": [2, 0]})


# ---------------------------------------------------------------- stream mode

@pytest.mark.parametrize("schedule,placement,sizes,chunks", [("gpipe", THREE, [1, 3, 2, 2], 1),
                                                             ("1f1b", TWO, [3, 5], 1), ("zb1", THREE, [3, 5], 1),
                                                             ("wavefront", TWO, [5, 3], 3)])
def test_stream_mode_carries_each_unequal_micro_batchs_state_like_one_device(schedule, placement, sizes, chunks):
    sentences, batches = stream()
    assert_same(pipelined(tiny_model(dropout=0.3), schedule, placement, sizes, chunks, batches, seed=6),
                one_device(tiny_model(dropout=0.3), batches, seed=6))
    model = tiny_model()
    expected = evaluate(SingleDevice(model), sentences, 8, bptt=5)
    with Pipeline(model, placement, schedule, micro_batches=sizes, chunks=chunks) as pipe:
        assert evaluate(pipe, sentences, 8, bptt=5) == pytest.approx(expected, rel=1e-6)


def test_a_carried_state_loads_into_unequal_micro_batches_and_one_too_wide_is_refused():
    """State from one device, carried on by a pipeline of unequal micro-batches; a narrower state is widened by
    empty columns to the sizes' sum (as fit_width widens the batch), a wider one is refused in words."""
    _, batches = stream()
    model, single = tiny_model(), None
    single = SingleDevice(model)
    for b in batches[:2]:
        single.eval_step(b)
    state, expected = single.carried_state(), single.eval_step(batches[2]).loss
    with Pipeline(model, TWO, "1f1b", micro_batches=[3, 5]) as pipe:
        pipe.load_carried_state(state)
        assert pipe.eval_step(batches[2]).loss == pytest.approx(expected, rel=1e-6)
        assert torch.equal(pipe.carried_state()["lstm0"][0], single.carried_state()["lstm0"][0])
        narrow = {name: tuple(t[:, :6] for t in ts) for name, ts in state.items()}
        pipe.load_carried_state(narrow)
        assert pipe.carried_state()["lstm0"][0].shape[1] == 8
    with Pipeline(model, TWO, "1f1b", micro_batches=[3, 3]) as pipe:
        with pytest.raises(ValueError, match=r"the carried state is 8 sequences wide, more than the micro-batches "
                                             r"of sizes \[3, 3\] hold together \(6\)"):
            pipe.load_carried_state(state)


# ---------------------------------------------------------------- refusals and the width

@pytest.mark.parametrize("sizes,words", [([3, 0], r"sizes \[3, 0\] holds 0"), ([], r"sizes \[\] is empty"),
                                         ([2.5, 5.5], r"holds 2.5"), ([True, 7], r"holds True"),
                                         ("3,5", r"micro_batches must be a count such as 4 \(equal micro-batches\) "
                                                 "or a list of sizes")])
def test_sizes_that_are_not_whole_numbers_are_refused_in_words(sizes, words):
    with pytest.raises(ValueError, match=words):
        Pipeline(tiny_model(), TWO, "gpipe", micro_batches=sizes)


def test_a_batch_of_another_width_is_refused_naming_the_sizes_and_the_width_and_fit_width_pads_to_the_sum():
    with Pipeline(tiny_model(), TWO, "gpipe", micro_batches=[3, 5]) as pipe:
        narrow = make_batch(T=9, B=6)
        with pytest.raises(ValueError, match=r"micro-batch sizes \[3, 5\] add up to 8 sentences, but the batch is "
                                             r"6 wide; give sizes that add up to the batch width 6"):
            pipe.train_step(narrow)
        # the training loop widens a bucket's narrower last batch to the sizes' sum (empty columns: same numbers)
        widened = fitted(pipe, narrow)
        assert widened.inputs.shape == (9, 8) and widened.tokens == narrow.tokens
        model = pipe.model
        model.zero_grad(set_to_none=True)
        loss = pipe.train_step(widened).loss
    assert loss == pytest.approx(one_device(tiny_model(), [narrow])[0][0], rel=1e-6)
    assert fit_width(make_batch(B=8), [3, 5]).inputs.shape[1] == 8
    with pytest.raises(ValueError, match=r"a batch of 10 sentences does not fit micro-batches of sizes \[3, 5\], "
                                         "which add up to 8"):
        fit_width(make_batch(B=10), [3, 5])
    assert check_sizes([3, 5], 8) == (3, 5)


def test_a_schedule_of_another_count_and_interleaved_of_a_count_not_a_multiple_are_refused():
    with pytest.raises(ValueError, match=r"micro_batches=2, but the schedule '1f1b' was built for 4"):
        Pipeline(tiny_model(), TWO, one_f_one_b([0, 1], 4), micro_batches=[3, 5])
    with Pipeline(tiny_model(), TWO, one_f_one_b([0, 1], 2), micro_batches=[3, 5]) as pipe:
        assert pipe.micro_batch_sizes == (3, 5)
    with pytest.raises(ValueError, match="interleaved needs micro_batches to be a multiple of the 3 devices, got 2"):
        Pipeline(tiny_model(4), LOOPED_THREE, "interleaved", micro_batches=[3, 5])


def test_torchruns_pipeline_refuses_unequal_micro_batches_in_words():
    """torch.distributed.pipelining allocates each stage's receive buffers once, for one shape: refused before any
    process group is asked for."""
    from mpedu.distributed import DistributedPipeline
    with pytest.raises(ValueError, match=r"micro_batches=\[3, 5\]: torchrun's pipeline runs on torch.distributed."
                                         r"pipelining.*one static shape.*Unequal micro-batches run on virtual devices"):
        DistributedPipeline(tiny_model(), TWO, "gpipe", [3, 5])


# ---------------------------------------------------------------- the memory model

MEMORY = [("gpipe", LOOPED_TWO, [1, 3, 2, 2], 1, None), ("1f1b", THREE, [3, 5], 1, "all-but-last"),
          ("zb1", THREE, [1, 3, 2, 2], 1, None), ("interleaved", LOOPED_TWO, [3, 5], 1, "all"),
          ("wavefront", LOOPED_TWO, [3, 5], 3, None)]


@pytest.mark.parametrize("schedule,placement,sizes,chunks,recompute", MEMORY, ids=[c[0] for c in MEMORY])
def test_the_memory_model_holds_each_micro_batch_by_its_own_width(schedule, placement, sizes, chunks, recompute):
    """The pipeline's estimate (a dry run per width) is what the step's saved-tensor hooks counted, byte for byte;
    from per-layer profiles of each micro-batch (micro_batch_costs) too. Taking every micro-batch at the mean
    width would not be."""
    batch, model = make_batch(T=12, B=8), tiny_model(dropout=0.3)
    micro = batch.split(sizes)
    with Pipeline(model, placement, schedule, micro_batches=sizes, chunks=chunks, recompute=recompute) as pipe:
        estimate = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
        if chunks == 1:
            costs = [profile(model, mb, warmup=0, repeats=1) for mb in micro]
            predicted = device_footprints(costs[0], pipe.placement, pipe.schedule, recompute, micro_batch_costs=costs)
            even = profile(model, batch, micro_batches=len(sizes), warmup=0, repeats=1)     # the mean width
            alike = device_footprints(even, pipe.placement, pipe.schedule, recompute)
    for k, e in enumerate(estimate):
        held = timeline.peak_memory(e.device)
        assert e.activations == held > 0, e
        if chunks == 1:
            assert predicted[k].activations == held, predicted[k]
    if chunks == 1:
        assert any(a.activations != e.activations for a, e in zip(alike, estimate))


def test_a_memory_cap_checks_the_unequal_step():
    from mpedu.predict import MemoryCapError, cap_memory
    batch = make_batch(T=12, B=8)
    with Pipeline(tiny_model(), TWO, "gpipe", micro_batches=[1, 7]) as pipe:
        need = memory_estimate(pipe, batch)
    cap = {f.device: f.total for f in need}
    with cap_memory(Pipeline(tiny_model(), TWO, "gpipe", micro_batches=[1, 7]), cap) as pipe:
        assert pipe.train_step(batch).loss > 0
    with cap_memory(Pipeline(tiny_model(), TWO, "gpipe", micro_batches=[1, 7]), {"vgpu:1": cap["vgpu:1"] - 1}) as pipe:
        with pytest.raises(MemoryCapError, match="vgpu:1 needs"):
            pipe.train_step(batch)


# ---------------------------------------------------------------- the simulator

def test_the_simulator_reads_each_micro_batch_at_its_own_width():
    model = tiny_model()
    placement = Placement.parse(TWO, model)
    costs = fake_costs(model.layer_names, 9, 2)
    equal = simulate("1f1b", costs, placement, micro_batches=4)
    assert [dataclasses.astuple(e) for e in simulate("1f1b", costs, placement, micro_batches=[2, 2, 2, 2]).events] == [
        dataclasses.astuple(e) for e in equal.events]
    unequal = simulate("1f1b", costs, placement, micro_batches=[1, 3, 2, 2])
    assert unequal.micro_batch_sizes == (1, 3, 2, 2) and equal.micro_batch_sizes is None
    forward = {e.mb: e.duration for e in unequal.compute("vgpu:0") if e.kind == "F"}
    # one profile is scaled per sequence: each box is its width's share of the profiled one
    two = costs.stages(placement)[0].forward
    assert [forward[i] for i in range(4)] == pytest.approx([two / 2, 3 * two / 2, two, two])
    # a CostCurve is read at each width, as a list of Costs one per micro-batch is taken
    curve = CostCurve([fake_costs(model.layer_names, 9, b) for b in (1, 2, 4)], [])
    by_curve = simulate("zb1", curve, placement, micro_batches=[1, 3, 2, 2])
    by_list = simulate("zb1", [curve.at(9, b) for b in (1, 3, 2, 2)], placement, micro_batches=[1, 3, 2, 2])
    assert by_curve.makespan == pytest.approx(by_list.makespan) and by_curve.makespan != pytest.approx(
        simulate("zb1", curve.at(9, 2), placement, micro_batches=4).makespan)
    # per-stage numbers are a micro-batch of the mean width
    plain = simulate("gpipe", [1.0, 1.0], micro_batches=[1, 3])
    assert sorted(e.duration for e in plain.compute("gpu:0") if e.kind == "F") == pytest.approx([0.5, 1.5])
    with pytest.raises(ValueError, match="a CostCurve holds costs at several widths: give the micro-batches' sizes"):
        simulate("gpipe", curve, placement, micro_batches=4)
    with pytest.raises(ValueError, match="3 per-layer Costs for 4 micro-batches"):
        simulate("gpipe", [curve.at(9, b) for b in (1, 3, 4)], placement, micro_batches=[1, 3, 2, 2])


def test_a_sized_pipelines_prediction_holds_what_its_memory_model_holds():
    """simulate(pipe, costs) plays the pipeline's own sizes; its predicted timeline's memory is the memory
    model's for the same per-micro-batch costs."""
    batch, model = make_batch(T=12, B=8), tiny_model()
    sizes = [1, 3, 2, 2]
    costs = [profile(model, mb, warmup=0, repeats=1) for mb in batch.split(sizes)]
    with Pipeline(model, THREE, "zb1", micro_batches=sizes) as pipe:
        predicted = simulate(pipe, costs)
        model_says = device_footprints(costs[0], pipe.placement, pipe.schedule, micro_batch_costs=costs)
        timeline = pipe.train_step(batch).timeline
    assert predicted.micro_batch_sizes == (1, 3, 2, 2)
    for f in model_says:
        assert predicted.peak_memory(f.device) == pytest.approx(f.activations, abs=len(pipe.schedule.actions[0]))
        assert f.activations == timeline.peak_memory(f.device)


def test_an_epoch_of_a_sized_pipeline_is_predicted_at_each_width():
    model = tiny_model()
    curve = CostCurve([fake_costs(model.layer_names, 9, b) for b in (1, 2, 4)], [])
    with Pipeline(model, TWO, "1f1b", micro_batches=[1, 3, 2, 2]) as pipe:
        epoch = predict_epoch([(9, 8)] * 3, curve, pipe)
        with pytest.raises(ValueError, match=r"sizes \[1, 3, 2, 2\], which add up to 8"):
            predict_epoch([(9, 6)], curve, pipe)
    count, step, how = epoch.per_shape[9, 8]
    assert count == 3 and how == "1f1b m=[1, 3, 2, 2]"
    assert step == pytest.approx(simulate("1f1b", [curve.at(9, b) for b in (1, 3, 2, 2)], pipe.placement,
                                          micro_batches=[1, 3, 2, 2]).makespan)
    assert not math.isclose(step, simulate("1f1b", curve.at(9, 2), pipe.placement, micro_batches=4).makespan)


# ---------------------------------------------------------------- training

@pytest.mark.parametrize("bptt", [None, 35])
def test_training_through_unequal_micro_batches_equals_one_device(bptt, little):
    """train() widens a bucket's narrower last batch to the sizes' sum (fitted); in stream mode the state of each
    micro-batch's columns goes on."""
    pipeline = dict(placement="embed,lstm0:vgpu0 | lstm1,decode:vgpu1", schedule="1f1b", micro_batches=[3, 8, 5])
    (h_one, m_one), (h_pipe, m_pipe) = train_both(lambda: lm(little, dropout=0.3), little, pipeline,
                                                  batch_size=16, lr=5.0, seed=4, bptt=bptt)
    for key in ("train_ppl", "valid_ppl"):
        assert h_pipe.epochs[0][key] == pytest.approx(h_one.epochs[0][key], rel=1e-5), key
    for (name, a), b in zip(m_one.state_dict().items(), m_pipe.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


def test_a_resumed_run_names_the_sizes_its_checkpoint_was_trained_with(tmp_path, little):
    from mpedu.training import train
    lines = []
    for sizes in ([3, 8, 5], 2):
        model = lm(little, num_layers=3)
        with Pipeline(model, TWO, "gpipe", micro_batches=sizes) as pipe:
            train(model, little, runner=pipe, epochs=1, batch_size=16, lr=5.0, seed=4, out=tmp_path,
                  resume=sizes == 2, progress=False, log=lines.append, limit_batches=2)
    assert any("the checkpoint's run used micro_batches=[3, 8, 5]; this run uses micro_batches=2" in line
               for line in lines), lines
