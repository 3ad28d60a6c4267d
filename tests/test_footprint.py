"""One memory model: what it predicts from per-layer measurements against what a step really holds, and who uses it."""
import dataclasses

import pytest
import torch

from conftest import make_batch, tiny_model
from test_exact import FOUR_DEVICES, on_four
from mpedu.core import Action, Pipeline, Placement, schedules
from mpedu.predict import (cap_memory, memory_estimate, StageCost, balance_by_time, device_footprints, memory_report, param_sizes,
    peak_held, profile, simulate, stage_footprint, unit_bytes)

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

FOUR = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"
THREE = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2,decode:vgpu2"
V = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu1 | lstm2,decode:vgpu0"      # stages 0 and 3 on vgpu0, 1 and 2 on vgpu1
SCHEDULES = [("naive", FOUR, 2, 1), ("gpipe", FOUR, 4, 1), ("1f1b", FOUR, 4, 1), ("interleaved", FOUR, 4, 1),
             ("zb1", THREE, 4, 1), ("wavefront", FOUR, 2, 3), ("zbv", V, 4, 1), ("dualpipev", V, 4, 1),
             ("zb_cap2", THREE, 4, 1), ("zb_cap1", V, 4, 1), ("v_half", V, 4, 1), ("v_min", V, 4, 1)]


@pytest.mark.parametrize("recompute", [None, "all", "all-but-last"])
@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_the_model_agrees_with_what_a_step_holds(schedule, placement, m, chunks, recompute):
    """Predicted from profiled per-layer bytes, the activation peak of every device is within 5% of
    what the step's saved-tensor hooks counted (the timeline's memory), dropout included; the
    pipeline's own estimate (a dry run of its stages) too."""
    batch = make_batch(T=12, B=8)
    model = tiny_model(dropout=0.3)
    costs = profile(model, batch, micro_batches=m, warmup=0, repeats=1)
    chunk_costs = (profile(model, batch.steps(0, 12 // chunks), micro_batches=m, warmup=0, repeats=1)
                   if chunks > 1 else None)
    with Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks, recompute=recompute) as pipe:
        estimate = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
        predicted = device_footprints(costs, pipe.placement, pipe.schedule, recompute, chunk_costs=chunk_costs)
    weights, grads = param_sizes(model)
    for f, e in zip(predicted, estimate, strict=True):
        held = timeline.peak_memory(f.device)
        assert held > 0
        assert f.activations == pytest.approx(held, rel=0.05), (f.device, f)
        assert e.activations == pytest.approx(held, rel=0.05), (f.device, e)
        assert (f.weights, f.gradients) == (e.weights, e.gradients)
    assert sum(f.weights for f in predicted) == sum(weights) and sum(f.gradients for f in predicted) == sum(grads)


@pytest.mark.parametrize("schedule,placement", FOUR_DEVICES, ids=[s for s, _ in FOUR_DEVICES])
def test_the_model_agrees_with_what_a_step_holds_on_four_devices(schedule, placement):
    """The new schedules on 4 virtual devices (m = 8; test_exact.FOUR_DEVICES), dropout on: each device's
    predicted peak is what the step's saved-tensor hooks counted, within 5%, as on two."""
    batch = make_batch(T=12, B=8)
    model = tiny_model(num_layers=6, dropout=0.3)
    costs = profile(model, batch, micro_batches=8, warmup=0, repeats=1)
    with Pipeline(model, on_four(model, placement), schedule, micro_batches=8) as pipe:
        timeline = pipe.train_step(batch).timeline
        predicted = device_footprints(costs, pipe.placement, pipe.schedule, None)
    assert len(predicted) == 4
    for f in predicted:
        held = timeline.peak_memory(f.device)
        assert held > 0 and f.activations == pytest.approx(held, rel=0.05), (schedule, f.device, f)


@pytest.mark.parametrize("recompute", [None, "all", "all-but-last"])
@pytest.mark.parametrize("T,chunks", [(10, 3), (5, 4), (7, 4)])
def test_time_chunks_of_unequal_lengths_are_each_sized_by_their_own_length(T, chunks, recompute):
    """T not a multiple of the chunk count: the estimate sizes each chunk by its own length (it took the
    longest chunk for all, up to +44%, and the cap refused steps that fit); a cap at what the step
    holds lets it run."""
    batch, placement = make_batch(T=T, B=8), "embed:vgpu0 | lstm0-2,decode:vgpu1"
    with Pipeline(tiny_model(), placement, "wavefront", micro_batches=2, chunks=chunks, recompute=recompute) as pipe:
        assert len({hi - lo for lo, hi in pipe.bucket_plan(batch).chunk_bounds}) == 2
        estimate = memory_estimate(pipe, batch)
        held = pipe.train_step(batch).timeline.peak_memory("vgpu:1")
    assert estimate[1].activations == pytest.approx(held, rel=0.01)
    cap = {"vgpu:1": estimate[1].total, "vgpu:0": estimate[0].total}
    with cap_memory(Pipeline(tiny_model(), placement, "wavefront", micro_batches=2, chunks=chunks, recompute=recompute), cap) as pipe:
        assert pipe.train_step(batch).loss > 0


@pytest.mark.parametrize("T,chunks", [(12, 4), (10, 3)])
def test_the_explorer_shows_what_a_wavefront_step_holds(tmp_path, T, chunks):
    """The explorer's memory figures are the step's: it took each time chunk as 1/chunks of the sequence,
    12-50% too little (a chunk's state comes in and is saved again; unequal lengths when T is not a multiple)."""
    pytest.importorskip("anywidget")
    from mpedu.course import PipelineExplorer
    model, batch = tiny_model(), make_batch(T=T, B=8)
    costs = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    explorer = PipelineExplorer(model, batch, devices=2, schedule="wavefront", micro_batches=2, chunks=chunks,
                                costs=costs, state_file=tmp_path / "state.json")
    shown = explorer.figures["memory_bytes"]
    with Pipeline(model, explorer.placement, "wavefront", micro_batches=2, chunks=chunks) as pipe:
        held = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
    for f in held:
        assert f.activations == pytest.approx(timeline.peak_memory(f.device), rel=0.05)
        assert shown[f.device] == pytest.approx(f.total, rel=0.05), (f.device, shown, f)


@pytest.mark.parametrize("schedule,placement,m", [
    ("gpipe", "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1", 4), ("1f1b", "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", 4),
    ("zb1", "embed:vgpu0 | lstm0-2,decode:vgpu1", 2), ("gpipe", "embed:vgpu0 | lstm0-2,decode:vgpu1", 2)])
def test_a_frozen_lead_counts_as_nothing_in_the_first_stage_and_in_full_after_a_cut(schedule, placement, m):
    # frozen embed and lstm0: in the first stage no gradient reaches them and they keep nothing; as the first layer
    # of a later stage (its input wants a gradient at the boundary) lstm0 keeps its all. The per-layer profile
    # weighs each layer as a stage's first, so the model counted it in the first stage too (a planner refused
    # caps its plans fit), and a refusal measured it in the first stage and named it free after a cut
    batch, model = make_batch(T=10, B=8), tiny_model(dropout=0.2)
    for name in ("embed", "lstm0"):
        model.layers[name].requires_grad_(False)
    costs = profile(model, batch, micro_batches=m, warmup=0, repeats=1)
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        estimate = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
        predicted = device_footprints(costs, pipe.placement, pipe.schedule)
    for f, e in zip(predicted, estimate, strict=True):
        assert f.activations == e.activations == timeline.peak_memory(f.device), (f, e)
    first, names = costs.stages(pipe.placement)[0], pipe.placement.stages[0][1]
    assert (first.activation_bytes == 0) == (set(names) <= {"embed", "lstm0"}), names


@pytest.mark.parametrize("recompute", [None, "all"])
def test_a_frozen_first_stage_under_the_wavefront_holds_nothing_and_is_predicted_so(recompute):
    """Frozen layers on token ids keep no graph, in any time chunk: the recurrent state handed from chunk to
    chunk wants no gradient there (it used to, and the stage kept ~0.4 MB the estimate never saw). The
    profile of such layers works too (its backward was an error), so the model and the planner see them."""
    batch, model = make_batch(T=12, B=8), tiny_model()
    for name in ("embed", "lstm0"):
        model.layers[name].requires_grad_(False)
    costs = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    # nothing to differentiate: no B and no W timed, and the frozen lead of stage 0 costs its stage no backward
    # (the fused backward's time is that of an empty call: compared with a real one it is a timing, never asserted)
    assert costs.backward_input[0] == costs.backward_weight[0] == 0.0
    assert costs.stages([["embed", "lstm0"]])[0].backward == 0.0 < costs.stages([["lstm1"]])[0].backward
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", "wavefront", micro_batches=2, chunks=3,
                  recompute=recompute) as pipe:
        estimate = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
    assert timeline.peak_memory("vgpu:0") == estimate[0].activations == 0
    assert estimate[1].activations == pytest.approx(timeline.peak_memory("vgpu:1"), rel=0.05)
    assert timeline.peak_memory("vgpu:1") > 0


def test_recomputation_keeps_the_inputs_and_peaks_at_one_rebuilt_micro_batch():
    """GPipe on one device, 4 micro-batches of a stage that keeps 10 bytes of input and saves 100
    (its input among them): 400 held without recomputation; with it 4 x 10 kept, and one micro-batch
    rebuilt while its backward runs: 30 + 100. "all-but-last" keeps the last one's 100 as well: mpedu's
    GPipe runs the backwards in forward order (B0 first), so B0's rebuild happens beside it: 20 + 100 + 100."""
    row = schedules.gpipe([0], 4).actions[0]
    stage = StageCost(1.0, activation_bytes=100, input_bytes=10, input_saved_bytes=10)
    assert peak_held(row, unit_bytes([stage], [None], 4)) == (400, 4)
    assert peak_held(row, unit_bytes([stage], ["all"], 4)) == (130, 4)
    assert [str(a) for a in row[4:]] == ["0B0", "0B1", "0B2", "0B3"]
    assert peak_held(row, unit_bytes([stage], ["all-but-last"], 4)) == (20 + 100 + 100, 4)
    # an input the layers do not save is held beside what they rebuild
    apart = StageCost(1.0, activation_bytes=100, input_bytes=10, input_saved_bytes=0)
    assert peak_held(row, unit_bytes([apart], ["all"], 4)) == (140, 4)


def test_zero_bubble_holds_a_micro_batch_until_its_w():
    row = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("F", 0, 2), Action("W", 0, 0)]
    ones = lambda s, mb, chunk: (1, 1)      # noqa: E731
    assert peak_held(row, ones, split={0}) == (3, 3)
    assert peak_held(row, ones) == (2, 2)           # fused backward: B frees it
    # and from its B to its W, the gradient of its output too (W starts from it again)
    assert peak_held(row, ones, split={0}, grad_bytes=lambda stage, mb: 0.5) == (3.5, 3)


def test_a_zero_bubble_step_holds_each_outputs_gradient_from_b_to_w():
    # the B of a split stage keeps the gradient it received for W: 2-6% of a stage's peak that neither the
    # model nor the step's count held; its input's gradient, handed upstream, it no longer keeps at all
    batch = make_batch(T=12, B=16)
    with Pipeline(tiny_model(), THREE, "zb1", micro_batches=8) as pipe:
        timeline = pipe.train_step(batch).timeline
    config = pipe.model.config
    for e in timeline.compute():
        if e.kind == "B" and e.stage < 2:            # the gradient of this stage's (T, b, width) output
            width = config.embed_size if e.stage == 0 else config.hidden_size     # embed | lstm0-1
            assert e.memory == 12 * 2 * width * 4, e


def test_tied_weights_count_once_everywhere():
    model = tiny_model(embed_size=64, hidden_size=64, tie_weights=True)
    per_tensor = sum(p.numel() * p.element_size() for p in model.parameters())   # parameters() dedups by object
    weights, _ = param_sizes(model)
    assert sum(weights) == per_tensor and weights[-1] < per_tensor // 10       # decode's shared matrix: in embed
    batch = make_batch(B=8)
    costs = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    assert costs.param_bytes == weights
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu0", "gpipe", micro_batches=2) as pipe:
        estimate = memory_estimate(pipe, batch)
        report = memory_report(pipe, pipe.train_step(batch).timeline,
                               torch.optim.Adam(model.parameters()))
    assert estimate[0].weights == report["vgpu:0"].params == per_tensor
    assert report["vgpu:0"].optimizer == 2 * per_tensor            # Adam: two moments per weight, once


def test_optimizer_state_is_a_multiple_of_the_trainable_weights():
    model, batch = tiny_model(), make_batch(B=8)
    costs = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    placement = Placement.parse("embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", model)
    plan = schedules.make("1f1b", placement.stage_devices, 2)
    plain, adam = (device_footprints(costs, placement, plan, optimizer_bytes_per_param=k) for k in (0, 2))
    for a, b in zip(plain, adam):
        assert b.optimizer_state == 2 * a.gradients and b.total == a.total + 2 * a.gradients


def test_balance_by_time_keeps_each_stage_under_the_cap_by_the_same_model():
    model, batch = tiny_model(), make_batch(B=8)
    measured = profile(model, batch, micro_batches=4, warmup=0, repeats=1)
    # times fixed (a slow decoder): the fastest split puts every layer but decode on vgpu:0, the fuller device
    slow = [1.0, 1.0, 1.0, 1.0, 10.0]
    costs = dataclasses.replace(measured, forward=slow, backward=[2 * t for t in slow])
    devices = ["vgpu:0", "vgpu:1"]
    free = balance_by_time(model, batch, devices, micro_batches=4, costs=costs)
    plan = schedules.make("gpipe", [0, 1], 4)
    need = {f.device: f.total for f in device_footprints(costs, free, plan)}
    cap = max(need.values()) - 1                    # the fastest split no longer fits
    capped = balance_by_time(model, batch, devices, micro_batches=4, costs=costs, memory_cap=cap)
    assert str(free) == "embed,lstm0-2:vgpu0 | decode:vgpu1" and str(capped) != str(free)
    assert all(f.total <= cap for f in device_footprints(costs, capped, plan))
    # below the smallest cap any plain split meets, recomputation still fits
    smallest = {mode: _smallest_cap(costs, plan, mode) for mode in (None, "all")}
    assert smallest["all"] < smallest[None]
    with pytest.raises(ValueError, match="the smallest cap that fits is"):
        balance_by_time(model, batch, devices, micro_batches=4, costs=costs, memory_cap=smallest[None] - 1)
    fits = balance_by_time(model, batch, devices, micro_batches=4, costs=costs, memory_cap=smallest[None] - 1,
                           recompute="all")
    assert all(f.total < smallest[None] for f in device_footprints(costs, fits, plan, "all"))
    # a cap as text, as Pipeline and plan take it; already recomputing, the message does not suggest it again
    as_text = balance_by_time(model, batch, devices, micro_batches=4, costs=costs, memory_cap=f"{cap}B")
    assert str(as_text) == str(capped)
    with pytest.raises(ValueError, match=r"raise the cap or use more devices$"):
        balance_by_time(model, batch, devices, micro_batches=4, costs=costs, memory_cap=smallest["all"] - 1,
                        recompute="all")
    # costs of another micro-batch shape would size the activations wrongly: refused, not used
    with pytest.raises(ValueError, match=r"profiled on micro-batches of \(T, b\) = \(9, 2\), but 2 micro-batches "
                                         r"of this batch are \(9, 4\): profile with micro_batches=2"):
        balance_by_time(model, batch, devices, micro_batches=2, costs=costs, memory_cap=cap)


def _smallest_cap(costs, plan, mode) -> int:
    """Brute force over the two-stage splits: the least memory the fuller device can get by with."""
    names = costs.names
    return min(max(stage_footprint(costs.stages([part])[0], plan.actions[s], s, mode, 4).total
                   for s, part in enumerate((names[:k], names[k:]))) for k in range(1, len(names)))


@pytest.mark.parametrize("recompute", [None, "all", "all-but-last"])
@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_the_simulators_timeline_holds_what_the_model_says(schedule, placement, m, chunks, recompute):
    """The predicted timeline's events carry the bytes they add and free: its peaks are the footprint's."""
    model = tiny_model()
    costs = profile(model, make_batch(T=12, B=8), micro_batches=m, warmup=0, repeats=1)
    placement = Placement.parse(placement, model)
    plan = schedules.make(schedule, placement.stage_devices, m, chunks)
    predicted = simulate(plan, costs, placement, recompute=recompute)
    for f in device_footprints(costs, placement, plan, recompute):
        assert predicted.peak_memory(f.device) == pytest.approx(f.activations, abs=len(plan.actions[0]))
        assert predicted.memory_over_time(f.device)[-1][1] == 0       # everything freed by the end
