"""Activation recomputation: exact gradients on every schedule, dropout included; its cost and saving."""
import json

import pytest
import torch

from conftest import make_batch, tiny_model
from mpedu.lm import dropout, keep_mask
from mpedu.core import parse_recompute, recompute_modes, recomputes
from mpedu.predict import cap_memory, memory_estimate, simulate
from mpedu.core import Pipeline
from test_exact import IDS, SCHEDULES, assert_same, grads, one_device  # the transparency suite's schedules, checks

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

P = 0.4          # dropout probability


def recomputed(model, schedule, placement, m, chunks, batches, recompute, seed=0):
    out, timelines = [], []
    with Pipeline(model, placement, schedule, micro_batches=m, chunks=chunks, recompute=recompute) as pipe:
        pipe.dropout_seed = seed
        for batch in batches:
            model.zero_grad(set_to_none=True)
            result = pipe.train_step(batch)
            out.append((result.loss, grads(model)))
            timelines.append(result.timeline)
    return out, timelines


@pytest.mark.parametrize("mode", ["all", "all-but-last"])
@pytest.mark.parametrize("schedule,placement,m,chunks", SCHEDULES, ids=IDS)
def test_recomputation_gives_the_single_device_loss_and_gradients_with_dropout(schedule, placement, m, chunks, mode):
    batches = [make_batch(T=9, B=8, seed=k) for k in range(2)]        # two steps: two sets of masks
    reference = one_device(tiny_model(dropout=P), batches, seed=3)
    got, timelines = recomputed(tiny_model(dropout=P), schedule, placement, m, chunks, batches, mode, seed=3)
    assert_same(got, reference)
    # the forwards really ran again: one R per recomputed (stage, micro-batch, chunk), just before its B
    stages = len(placement.split("|"))
    again = sum(recomputes(mode, mb, m) for mb in range(m)) * stages * chunks
    for timeline in timelines:
        rs = [e for e in timeline.events if e.kind == "R"]
        assert len(rs) == again
        for r in rs:
            b = next(e for e in timeline.events
                     if e.kind == "B" and (e.stage, e.mb, e.chunk) == (r.stage, r.mb, r.chunk))
            assert r.device == b.device and r.end <= b.start + 1e-9


def test_the_recomputed_forward_draws_the_masks_of_the_first_one(monkeypatch):
    """Re-entering a (micro-batch, chunk)'s Position re-draws its dropout masks: each position is drawn
    exactly twice (forward and recomputation), with equal masks both times."""
    drawn = {}

    def recording(p, layer, shape, where, device="cpu"):
        mask = keep_mask(p, layer, shape, where, device)
        drawn.setdefault((layer, where), []).append(mask)
        return mask

    monkeypatch.setattr(dropout, "keep_mask", recording)
    recomputed(tiny_model(dropout=P), "1f1b", SCHEDULES[2][1], 4, 1, [make_batch(T=9, B=8)], "all", seed=5)
    assert len(drawn) == 4 * 4                      # embed, lstm0-2 for each of 4 micro-batches
    for masks in drawn.values():
        assert len(masks) == 2 and torch.equal(masks[0], masks[1])
        assert not masks[0].all()                   # dropout does drop something here


def test_per_stage_choice_recomputes_only_those_stages():
    placement = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
    _, (timeline,) = recomputed(tiny_model(), "gpipe", placement, 4, 1, [make_batch(B=8)], {1: "all-but-last"})
    rs = [e for e in timeline.events if e.kind == "R"]
    assert {(e.stage, e.mb) for e in rs} == {(1, 0), (1, 1), (1, 2)}     # the last micro-batch keeps its own


def test_recomputation_holds_less_and_the_simulator_charges_the_forward_again():
    placement = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
    batch = make_batch(B=16)
    peaks, recomputes_seen = {}, {}
    for mode in (None, "all"):
        with Pipeline(tiny_model(), placement, "gpipe", micro_batches=8, recompute=mode) as pipe:
            timeline = pipe.train_step(batch).timeline
            peaks[mode] = timeline.peak_memory("vgpu:1")
            predicted = simulate(pipe, [1.0, 1.0])
        recomputes_seen[mode] = [e for e in predicted.events if e.kind == "R"]
    assert peaks["all"] < 0.5 * peaks[None]
    assert recomputes_seen[None] == [] and len(recomputes_seen["all"]) == 16
    # unit stages (F = 1, B = 2): each recomputed B grows by F's time; the R part is that forward
    plain = simulate("gpipe", [1.0, 1.0], micro_batches=8)
    again = simulate("gpipe", [1.0, 1.0], micro_batches=8, recompute="all")
    assert again.busy("gpu:0") == pytest.approx(plain.busy("gpu:0") + 8 * 1.0)
    assert all(e.duration == pytest.approx(1.0) for e in again.events if e.kind == "R")
    assert again.makespan > plain.makespan


def test_recompute_choices_are_checked_with_a_message():
    assert recompute_modes(None, 3) == [None] * 3
    assert recompute_modes({2: "all"}, 3) == [None, None, "all"]
    assert parse_recompute("0=all,1=none") == {0: "all", 1: None}
    assert parse_recompute("none") is None and parse_recompute("all-but-last") == "all-but-last"
    with pytest.raises(ValueError, match="'some' is not a recomputation mode"):
        recompute_modes("some", 2)
    with pytest.raises(ValueError, match="stage 5, but the pipeline has stages 0..1"):
        recompute_modes({5: "all"}, 2)
    with pytest.raises(ValueError, match="recomputation mode"):
        Pipeline(tiny_model(), 2, recompute="everything")


def test_the_explorer_offers_recomputation_and_its_memory_is_the_footprint(tmp_path):
    pytest.importorskip("anywidget")
    from mpedu.core import schedules
    from mpedu.predict import device_footprints
    from mpedu.predict import profile
    from mpedu.course import PipelineExplorer
    model, batch = tiny_model(), make_batch(B=8)
    costs = profile(model, batch, micro_batches=4, warmup=0, repeats=1)
    explorer = PipelineExplorer(model, batch, devices=2, micro_batches=4, costs=costs, steps=1,
                                state_file=tmp_path / "state.json")
    seen = {}
    for key in ("none", "all"):
        explorer.recompute_menu.value = key
        placement, mode = explorer.placement, explorer.recompute
        plan = schedules.make("gpipe", placement.stage_devices, 4)
        expected = {f.device: f.total for f in device_footprints(costs, placement, plan, mode)}
        assert explorer.figures["memory_bytes"] == expected
        seen[key] = explorer.predicted
    assert max(explorer.figures["memory_bytes"].values()) < max(
        f.total for f in device_footprints(costs, explorer.placement, plan, None))
    assert not [e for e in seen["none"].events if e.kind == "R"] and [e for e in seen["all"].events if e.kind == "R"]
    assert seen["all"].makespan > seen["none"].makespan
    assert any(m["label"].startswith("R forward again") for m in explorer.timeline.legend["marks"])
    explorer.run(1)
    explorer.wait(60)
    assert [e for e in explorer.measured.events if e.kind == "R"], explorer.run_status.value
    assert json.loads((tmp_path / "state.json").read_text())["recompute"] == "all"


def test_the_plot_keys_the_recomputation_boxes():
    from matplotlib.patches import Rectangle

    from mpedu.pictures import KIND_NAMES, plot_timeline
    _, (timeline,) = recomputed(tiny_model(), "1f1b", "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", 4, 1,
                                [make_batch(B=8)], "all")
    ax = plot_timeline(timeline)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert KIND_NAMES["R"] in labels
    boxes = [r.get_gid().split(" ")[-1] for r in ax.findobj(Rectangle) if r.get_gid()]
    assert sorted(b for b in boxes if "R" in b) == ["0R0", "0R1", "0R2", "0R3", "1R0", "1R1", "1R2", "1R3"]


def test_the_command_line_recomputes_and_trains_to_the_same_perplexity(capsys, tmp_path):
    from mpedu.cli import main
    quick = ["--config", "tiny", "--epochs", "1", "--limit-batches", "3", "--batch-size", "16", "--no-progress",
             "--no-baselines", "--devices", "2", "--schedule", "1f1b", "--json"]
    summaries = {}
    for mode in ("none", "all-but-last", "0=all"):
        assert main(["train", *quick, "--recompute", mode, "--out", str(tmp_path / mode)]) == 0
        summaries[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for mode in ("all-but-last", "0=all"):
        for key in ("train_ppl", "valid_ppl"):
            assert summaries[mode][key] == pytest.approx(summaries["none"][key], rel=1e-4), (mode, key)
    with pytest.raises(SystemExit) as exit_:
        main(["train", *quick, "--recompute", "half"])
    assert exit_.value.code == 2 and "'half' is not a recomputation mode" in capsys.readouterr().err
    assert main(["train", *quick[:-3], "--devices", "1", "--recompute", "all"]) == 2
    assert "--recompute applies to pipeline stages" in capsys.readouterr().err


def test_a_cap_that_refuses_the_step_lets_it_run_with_recomputation():
    from mpedu.predict import MemoryCapError
    placement, batch = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", make_batch(B=16)
    with Pipeline(tiny_model(), placement, "gpipe", micro_batches=8) as pipe:
        kept = {f.device: f for f in memory_estimate(pipe, batch)}
    with Pipeline(tiny_model(), placement, "gpipe", micro_batches=8, recompute="all") as pipe:
        rebuilt = {f.device: f for f in memory_estimate(pipe, batch)}
    cap = (kept["vgpu:1"].total + rebuilt["vgpu:1"].total) // 2       # between the two
    with cap_memory(Pipeline(tiny_model(), placement, "gpipe", micro_batches=8), {"vgpu:1": cap}) as pipe:
        with pytest.raises(MemoryCapError, match=r"Or recompute activations \(recompute='all'"):
            pipe.train_step(batch)
    with cap_memory(Pipeline(tiny_model(), placement, "gpipe", micro_batches=8, recompute="all"), {"vgpu:1": cap}) as pipe:
        timeline = pipe.train_step(batch).timeline
    assert timeline.peak_memory("vgpu:1") == rebuilt["vgpu:1"].activations
