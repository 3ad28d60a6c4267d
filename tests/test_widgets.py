"""PipelineExplorer without a browser: trait changes redraw, refused choices become messages in the learner's words
and leave nothing stale behind, every control offers only values it accepts, Run trains and Stop stops."""
import json
import random
import re
import time

import pytest
import torch

pytest.importorskip("anywidget")

import mpedu.course.explorer_run as explorer_run  # noqa: E402
from conftest import make_batch, tiny_model  # noqa: E402
from mpedu.course import PipelineExplorer, Refusal, SCHEDULES, dealt, far_from_prediction  # noqa: E402
from mpedu.runtime import LINKS  # noqa: E402
from mpedu.core import Placement, Timeline  # noqa: E402
from mpedu.predict import Costs  # noqa: E402

B, T, M = 8, 9, 4


def fixed_costs(model, sequences=B // M, per_sequence=1.0):
    """Made-up costs for micro-batches of `sequences` columns: the decoder is the heavy layer, as in a real LM."""
    n = len(model.layer_names)
    forward = [x * sequences * per_sequence / 2 for x in [1e-4] + [1e-3] * (n - 2) + [4e-3]]
    return Costs(model.layer_names, forward, [2 * f for f in forward], [f for f in forward], [f for f in forward],
                 activation_bytes=[1000] * n, output_bytes=[100] * (n - 1) + [0], param_bytes=[5000] * n,
                 shared_bytes=[0] * n, micro_batch=(T, sequences))


@pytest.fixture
def explorer(tmp_path):
    model = tiny_model(num_layers=3)                    # embed, lstm0-2, decode: 5 layers
    return PipelineExplorer(model, make_batch(T=T, B=B), devices=2, micro_batches=M, costs=fixed_costs(model),
                            steps=3, state_file=tmp_path / "state.json")


def moved(explorer, layer, device):
    """What a drop in the browser does: send back the assignment with one layer changed."""
    explorer.board.assignment = {**explorer.board.assignment, layer: device}


def shown(explorer) -> bool:
    return explorer.timeline.layout.display != "none" and bool(explorer.timeline.panels)


def text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_starts_with_an_even_split_and_its_prediction(explorer):
    assert explorer.placement == Placement.even(explorer.model, 2)
    assert explorer.board.devices == ["vgpu:0", "vgpu:1"]
    assert explorer.board.layers == explorer.model.layer_names
    assert isinstance(explorer.predicted, Timeline) and explorer.predicted.source == "predicted"
    [panel] = explorer.timeline.panels
    assert panel["devices"] == ["vgpu:0", "vgpu:1"] and len(panel["boxes"]) == len(explorer.predicted.compute())
    assert len(panel["transfers"]) == 2 * M
    assert str(explorer.placement) in explorer.message.value
    assert set(explorer.figures) >= {"makespan_s", "bubble", "speedup", "transfers", "memory_bytes"}
    assert explorer.figures["transfers"] == 2 * M        # one cut, both directions, every micro-batch
    assert set(explorer.board.device_notes) == {"vgpu:0", "vgpu:1"}
    assert explorer.progress.layout.display == "none" and explorer.run_status.value == ""
    assert repr(explorer) == ("PipelineExplorer(embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1, schedule=gpipe, "
                              "micro_batches=4)")


def test_a_dropped_layer_changes_the_placement_and_redraws_quickly(explorer):
    before, panels, revision = explorer.predicted.makespan, explorer.timeline.panels, explorer.timeline.revision
    start = time.perf_counter()
    moved(explorer, "lstm2", "vgpu:0")                  # the observer redraws before this returns
    seconds = time.perf_counter() - start
    print(f"redraw after a drop: {seconds * 1e3:.1f} ms of Python")
    assert str(explorer.placement) == "embed,lstm0-2:vgpu0 | decode:vgpu1"
    assert explorer.predicted.makespan != before
    assert explorer.timeline.panels != panels and explorer.timeline.revision == revision + 1
    assert seconds < 1.0


def test_a_layer_away_from_its_neighbours_makes_extra_stages(explorer):
    moved(explorer, "lstm0", "vgpu:1")
    assert str(explorer.placement) == "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu0 | lstm2,decode:vgpu1"
    assert explorer.figures["stages"] == 4
    assert explorer.figures["transfers"] == 3 * 2 * M


def test_schedule_micro_batches_and_chunks_redraw(explorer):
    seen = {explorer.predicted.makespan}
    explorer.schedule_menu.value = "1f1b"
    assert [e.kind for e in explorer.predicted.compute("vgpu:1")][:4] == ["F", "B", "F", "B"]
    explorer.micro_batches.value = 2                    # a new micro-batch shape: estimated now, measured after
    assert len(explorer.predicted.compute()) == 2 * 2 * 2
    explorer.wait(timeout=60)
    seen.add(explorer.predicted.makespan)
    assert explorer.chunks.disabled and "wavefront" in explorer.chunks.description
    explorer.schedule_menu.value = "wavefront"
    assert not explorer.chunks.disabled
    explorer.chunks.value = 3
    assert {e.chunk for e in explorer.predicted.compute()} == {0, 1, 2}
    assert len(seen) == 2


def test_a_new_micro_batch_size_is_drawn_at_once_then_measured(explorer):
    explorer.micro_batches.value = 8                    # 1 sequence each: no costs for it yet
    assert explorer.figures["estimated"] and shown(explorer)
    assert "estimated step" in explorer.figure_line.value and "measuring" in explorer.note.value
    revision = explorer.timeline.revision
    explorer.wait(timeout=60)                           # the background measurement redraws by itself
    assert explorer._costs[T, 1].micro_batch == (T, 1)
    assert not explorer.figures["estimated"] and explorer.timeline.revision > revision
    assert "predicted step" in explorer.figure_line.value and "measuring" not in explorer.note.value


def test_small_micro_batches_that_cost_more_per_sequence_are_explained(tmp_path):
    model = tiny_model(num_layers=3)
    costs = [fixed_costs(model, B // M), fixed_costs(model, 1, per_sequence=2.0)]   # 1-sequence ones: 2x dearer
    ex = PipelineExplorer(model, make_batch(T=T, B=B), micro_batches=M, costs=costs)
    assert ex.note.value == ""
    ex.micro_batches.value = B
    assert "2.0× the time per sequence" in ex.note.value and "Micro-batches of 1 sequence cost" in ex.note.value
    assert "the same 8 micro-batches" in ex.figure_line.value   # what "the speed of one device" compares with


def test_only_divisors_of_the_batch_are_offered(explorer):
    assert explorer.micro_batches.options == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="micro_batches=3 does not divide the batch size 8"):
        PipelineExplorer(explorer.model, explorer.batch, micro_batches=3, costs=fixed_costs(explorer.model))


def test_every_device_count_and_micro_batch_count_the_sliders_offer_is_accepted(explorer):
    layers = len(explorer.model.layer_names)
    assert (explorer.device_count.min, explorer.device_count.max) == (1, layers)   # no count that is always refused
    for p in range(1, layers + 1):
        explorer.device_count.value = p
        assert explorer.predicted is not None, text(explorer.message.value)
    for m in explorer.micro_batches.options:
        explorer.micro_batches.value = m
        assert explorer.predicted is not None, text(explorer.message.value)
    explorer.schedule_menu.value = "wavefront"
    for c in range(explorer.chunks.min, explorer.chunks.max + 1):
        explorer.chunks.value = c
        assert explorer.predicted is not None, text(explorer.message.value)
    explorer.wait(timeout=120)


def test_every_schedule_in_the_menu_accepts_some_placement(explorer):
    menu = [key for _, key in explorer.schedule_menu.options]
    assert set(SCHEDULES) < set(menu) and {"zbv", "dualpipev"} <= set(menu)    # the V shapes too
    for key in menu:
        explorer.schedule_menu.value = key
        if explorer.predicted is None:                  # interleaved: the refusal offers the placement it needs
            explorer.fix_button.click()
        assert explorer.predicted is not None, (key, text(explorer.message.value))


REFUSALS = [
    (lambda ex: setattr(ex.board, "assignment", dict.fromkeys(ex.model.layer_names, "vgpu:0")),
     "vgpu:1 holds no layer: drag a layer onto it, or use fewer devices"),
    (lambda ex: (moved(ex, "lstm0", "vgpu:1"), setattr(ex.schedule_menu, "value", "zb1")),
     "zero bubble (ZB-H1) needs each device to hold one stage"),
    (lambda ex: (moved(ex, "decode", "vgpu:0"), setattr(ex.schedule_menu, "value", "1f1b")),
     "1F1B needs each device to hold one stage"),
    (lambda ex: setattr(ex.schedule_menu, "value", "interleaved"),
     "interleaved 1F1B needs the layers dealt to the devices in turn"),
    (lambda ex: (setattr(ex.device_count, "value", 3), setattr(ex.schedule_menu, "value", "interleaved")),
     "at least 6 layers for 3 devices; this model has 5. Use 2 devices, or pick 1F1B"),
    # a drop on a column drawn before the devices changed; a layer the browser lost
    (lambda ex: moved(ex, "decode", "vgpu:2"), "decode sits on vgpu:2, which is not on the board: drag it onto "
                                               "vgpu:0 or vgpu:1"),
    (lambda ex: setattr(ex.board, "assignment", {k: v for k, v in ex.board.assignment.items() if k != "lstm2"}),
     "lstm2 is on no device: drag it onto one"),
]


@pytest.mark.parametrize("change, words", REFUSALS)
def test_a_refused_choice_is_said_in_the_words_on_screen(explorer, change, words):
    change(explorer)
    message = text(explorer.message.value)
    assert words in message
    assert "Traceback" not in message
    # the names a learner sees (menu labels, "devices", "micro-batches"), never the library's argument names
    for programmer in ("schedule=", "stage devices", "stage_devices", "micro_batches", "v >=", "p devices",
                       "round-robin", "s % p"):
        assert programmer not in message
    assert re.search(r"\b(Drag|drag|Use|Pick|pick|press)\b", message), "a refusal says what to do"
    assert explorer.predicted is None and explorer.figures == {}
    assert explorer.run_button.disabled


def test_random_boards_are_accepted_or_refused_in_the_widgets_words(explorer):
    """Any board a learner can make, with any schedule and micro-batch count: a prediction, or a message of the
    widget's own (never the library's, which names arguments such as micro_batches=)."""
    rng, layers = random.Random(0), explorer.model.layer_names
    for _ in range(150):
        p = rng.randint(1, len(layers))
        explorer.device_count.value = p
        explorer.board.assignment = {name: f"vgpu:{rng.randrange(p)}" for name in layers}
        explorer.schedule_menu.value = rng.choice([key for _, key in explorer.schedule_menu.options])
        explorer.micro_batches.value = rng.choice(explorer.micro_batches.options)
        try:
            explorer._check()
        except Refusal:
            pass
        message = text(explorer.message.value)
        assert explorer.predicted is not None or "⚠" in message
        assert "_" not in message.replace("schedule menu", ""), message   # no argument names
    explorer.wait(timeout=120)


def test_a_refused_choice_leaves_no_stale_figure_status_or_space(explorer):
    explorer.run()
    explorer.wait(timeout=60)
    assert len(explorer.timeline.panels) == 2 and "step 3/3" in explorer.run_status.value
    assert explorer.progress.layout.display != "none"
    explorer.schedule_menu.value = "interleaved"        # refused for this placement
    assert "⚠" in explorer.message.value
    assert explorer.timeline.layout.display == "none" and explorer.timeline.panels == []   # no blank space
    assert explorer.figure_line.value == "" and explorer.note.value == ""
    assert explorer.run_status.value == "" and explorer.progress.layout.display == "none"
    assert explorer.board.device_notes == {} and explorer.board.layer_notes == {} and explorer.measured is None
    explorer.schedule_menu.value = "gpipe"
    assert shown(explorer) and len(explorer.timeline.panels) == 1 and explorer.run_status.value == ""


def test_after_a_run_every_predicted_figure_is_the_same_one(explorer):
    explorer.run()
    explorer.wait(timeout=60)
    predicted, measured = explorer.timeline.panels
    assert predicted["title"].startswith("predicted step") and measured["title"].startswith("measured step 3")
    ms = f"{explorer.predicted.makespan * 1e3:.1f} ms"
    assert ms in predicted["title"] and ms in explorer.figure_line.value
    everything = " ".join([explorer.figure_line.value, explorer.run_status.value, explorer.note.value,
                           *(p["title"] for p in explorer.timeline.panels)])
    assert everything.count("predicted") == 1 + ("predicted" in explorer.figure_line.value)


def test_the_fix_buttons_do_what_the_refusal_says(explorer):
    explorer.schedule_menu.value = "interleaved"
    assert explorer.fix_button.layout.display != "none" and explorer.fix_button.description
    explorer.fix_button.click()
    assert str(explorer.placement) == dealt(explorer.model.layer_names, ["vgpu:0", "vgpu:1"]).replace(
        "lstm0,lstm1", "lstm0-1")
    assert explorer.predicted is not None and explorer.fix_button.layout.display == "none"
    explorer.micro_batches.value = 1                    # interleaved needs a multiple of the 2 devices
    assert "Pick 2 micro-batches" in text(explorer.message.value)
    explorer.fix_button.click()
    assert explorer.micro_batches.value == 2 and explorer.predicted is not None


def test_no_fix_leads_to_a_layout_whose_micro_batches_cannot_run():
    """3 devices and a batch of 8 (1, 2, 4 or 8 micro-batches, none a multiple of 3): interleaved offered to deal
    the layers in turn, and then refused the micro-batches; 1F1B on the dealt layers said "pick 1F1B"."""
    model = tiny_model(num_layers=4)                    # 6 layers: enough for 3 devices twice round
    ex = PipelineExplorer(model, make_batch(T=T, B=B), devices=3, micro_batches=M, costs=fixed_costs(model))
    ex.schedule_menu.value = "interleaved"
    assert "none a multiple of 3. Use 2 devices, or pick 1F1B." in text(ex.message.value)
    assert ex.fix_button.description == "use 1F1B"      # not "deal the layers in turn", a dead end
    ex.placement = dealt(model.layer_names, ["vgpu:0", "vgpu:1", "vgpu:2"])
    ex.schedule_menu.value = "1f1b"                     # dealt in turn: 1F1B would interleave
    message = text(ex.message.value)
    assert "layers together (then 1F1B runs one stage per device)" in message and "pick GPipe" in message and "pick 1F1B" not in message
    ex.fix_button.click()
    assert ex.schedule_menu.value == "gpipe" and ex.predicted is not None
    ex.wait(timeout=60)


def test_a_change_from_python_during_a_run_is_drawn_when_it_ends(explorer):
    """A later notebook cell sets explorer.placement while a run trains (the kernel is free): the board showed the
    new plan, the timeline the old run's, and nothing said so."""
    explorer.run(steps=200)
    deadline = time.monotonic() + 60
    while explorer.progress.value < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    explorer.placement = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2,decode:vgpu2"
    assert "drawn when it ends" in explorer.note.value and explorer.running
    assert explorer.progress.layout.display != "none"   # the run's progress stays
    explorer.stop()
    explorer.wait(timeout=60)
    assert str(explorer.placement) == "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2,decode:vgpu2"
    assert explorer.measured is None and [p["title"][:14] for p in explorer.timeline.panels] == ["predicted step"]
    assert explorer.predicted.devices == ["vgpu:0", "vgpu:1", "vgpu:2"] and "drawn when" not in explorer.note.value


def test_a_run_on_an_estimate_says_so_then_predicts_from_the_costs_measured_meanwhile(explorer):
    explorer.micro_batches.value = 8                    # no costs for 1-sequence micro-batches yet: an estimate
    explorer.run(steps=2)
    explorer.wait(timeout=60)
    assert explorer._costs[T, 1] is not None and explorer.measured is not None
    predicted, measured = explorer.timeline.panels     # the run's step stays, beside a prediction from them
    assert predicted["title"].startswith("predicted step") and measured["title"].startswith("measured step 2")
    assert "predicted step" in explorer.figure_line.value and "measuring" not in explorer.note.value
    assert not explorer.figures["estimated"]


def test_the_legend_names_every_mark_and_label(explorer):
    legend = lambda: " ".join(m["label"] for m in explorer.timeline.legend["marks"])   # noqa: E731
    assert {"F forward", "B backward", "transfer", "waits"} <= set(re.findall(r"F forward|B backward|transfer|waits",
                                                                            legend()))
    explorer.schedule_menu.value = "zb1"
    assert "W weight gradient" in legend()
    explorer.schedule_menu.value = "interleaved"
    explorer.fix_button.click()
    assert any(m["hatch"] for m in explorer.timeline.legend["marks"]) and "2nd stage" in legend()
    assert any(b[6] == "1F0" for b in explorer.timeline.panels[0]["boxes"])
    assert "1F3" in explorer.timeline.legend["labels"] and "stage" in explorer.timeline.legend["labels"]
    explorer.placement = Placement.even(explorer.model, 2)
    explorer.schedule_menu.value = "wavefront"
    assert any(b[6] == "F0.1" for b in explorer.timeline.panels[0]["boxes"])
    assert "time chunk" in explorer.timeline.legend["labels"]


def test_device_count_adds_and_removes_columns(explorer):
    explorer.device_count.value = 3
    assert explorer.board.devices == ["vgpu:0", "vgpu:1", "vgpu:2"]
    assert explorer.placement == Placement.even(explorer.model, 3)
    assert explorer.predicted.devices == ["vgpu:0", "vgpu:1", "vgpu:2"]
    explorer.device_count.value = 1
    assert str(explorer.placement) == "embed,lstm0-2,decode:vgpu0"
    assert explorer.figures["transfers"] == 0


def test_setting_a_placement_moves_the_chips(explorer):
    explorer.placement = "embed:vgpu0 | lstm0-2:vgpu1 | decode:vgpu2"
    assert explorer.board.devices == ["vgpu:0", "vgpu:1", "vgpu:2"]
    assert explorer.device_count.value == 3
    assert explorer.board.assignment["decode"] == "vgpu:2"
    assert explorer.predicted.devices == ["vgpu:0", "vgpu:1", "vgpu:2"]
    assert "embed:vgpu0 | lstm0-2:vgpu1 | decode:vgpu2" in explorer.message.value   # the widget shows it too


def test_the_link_menu_changes_the_prediction(explorer):
    fast = explorer.predicted.makespan
    assert explorer.slowdown.disabled                   # shared memory has no delay to slow down
    slow = next(k for k, link in LINKS.items() if link.emulated and link.bandwidth_Bps < 50e9)
    explorer.link_menu.value = slow
    assert not explorer.slowdown.disabled and explorer.link == LINKS[slow]
    explorer.slowdown.value = 100
    assert explorer.link == LINKS[slow].slowed(100)
    assert explorer.predicted.makespan > fast
    assert json.loads(explorer.state_file.read_text())["link"] == slow


def test_the_state_file_holds_what_python_sees(explorer):
    moved(explorer, "lstm2", "vgpu:0")
    state = json.loads(explorer.state_file.read_text())
    assert state["placement"] == "embed,lstm0-2:vgpu0 | decode:vgpu1"
    assert state["assignment"]["lstm2"] == "vgpu:0"
    assert state["figures"]["transfers"] == 2 * M
    assert state["revision"] == explorer.timeline.revision


def test_run_trains_steps_and_updates_progress(explorer):
    weights = [p.detach().clone() for p in explorer.model.parameters()]
    explorer.run()
    assert explorer.board.locked and explorer.schedule_menu.disabled and not explorer.stop_button.disabled
    explorer.wait(timeout=60)
    assert not explorer.running
    assert explorer.progress.value == explorer.progress.max == 3
    assert len(explorer.losses) == 3 and "step 3/3" in explorer.run_status.value
    assert isinstance(explorer.measured, Timeline) and explorer.measured.source == "measured"
    assert any(not torch.equal(a, b) for a, b in zip(weights, explorer.model.parameters()))   # it trained
    assert not explorer.board.locked and not explorer.run_button.disabled and explorer.stop_button.disabled
    assert json.loads(explorer.state_file.read_text())["progress"] == 3


def test_stop_stops_between_steps(explorer):
    explorer.run(steps=500)
    deadline = time.monotonic() + 60
    while explorer.progress.value < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    explorer.stop()
    explorer.wait(timeout=60)
    assert not explorer.running
    assert 1 <= explorer.progress.value < 500
    assert f"stopped after {explorer.progress.value} of 500 steps" in explorer.run_status.value


def test_a_failing_run_reports_in_the_widget(explorer, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("the device fell over")
    monkeypatch.setattr(explorer_run, "step", fails)           # the training step the Run button calls
    explorer.run()
    explorer.wait(timeout=60)
    assert "the device fell over" in explorer.run_status.value and "Traceback" not in explorer.run_status.value
    assert not explorer.running and not explorer.board.locked and explorer.losses == []


def test_the_constructor_reads_a_slowed_link_and_refuses_what_its_controls_cannot_show():
    model = tiny_model(num_layers=3)
    ex = PipelineExplorer(model, make_batch(T=T, B=B), devices=1, micro_batches=M, costs=fixed_costs(model),
                          link="10gbe/100")                     # Link.parse's text, as notebook 05 wrote it
    assert (ex.link_menu.value, ex.slowdown.value) == ("10gbe", 100)
    assert "1 stage on 1 device" in text(ex.figure_line.value)   # not "1 stages on 1 devices"
    ex.wait(timeout=60)             # its best-plans search: no thread in torch when the process ends
    for bad, words in ((dict(slowdown=50), "slowdown=50; choose one of 1, 10, 100"),
                       (dict(chunks=20), "chunks=20; the slider offers 1 to 8"),
                       (dict(link="fast"), "unknown link 'fast'; choose one of"),
                       (dict(link="10gbe/abc"), "link='10gbe/abc': the explorer offers a preset slowed 1, 10, 100"),
                       (dict(link="10gbe/10", slowdown=100), "(not both)")):
        with pytest.raises(ValueError, match=re.escape(words)):
            PipelineExplorer(model, make_batch(T=T, B=B), micro_batches=M, costs=fixed_costs(model), **bad)


def test_a_run_far_from_its_prediction_says_why_it_may_be():
    model = tiny_model(num_layers=3)
    words = {}
    for name, per_sequence in (("slower", 1e-4), ("faster", 1e3)):   # costs 10,000x too small, then too large
        ex = PipelineExplorer(model, make_batch(T=T, B=B), devices=2, micro_batches=M, steps=3,
                              costs=fixed_costs(model, per_sequence=per_sequence))
        ex.run()
        ex.wait(timeout=120)
        words[name] = text(ex.run_status.value)
        assert "step 3/3" in words[name]
    assert "× the prediction" in words["slower"] and "free_cores()" in words["slower"], words["slower"]
    assert "× the prediction" in words["faster"] and "busier than now" in words["faster"], words["faster"]


def test_far_from_prediction_compares_the_typical_step():
    assert far_from_prediction([0.5, 0.11, 0.10, 0.12], 0.1, virtual=True) == ""     # the warm-up step left out
    slow = far_from_prediction([0.2, 0.2, 0.3], 0.1, virtual=True)
    assert "2.50× the prediction (250.0 ms against 100.0)" in slow and "CPU cores" in slow
    assert "these devices" in far_from_prediction([0.2, 0.2], 0.1, virtual=False)
    assert "0.50× the prediction" in far_from_prediction([0.05, 0.05], 0.1, virtual=True)
    assert "1.52× the prediction" in far_from_prediction([0.152, 0.152], 0.1, virtual=True)   # not "1.5×": far
    assert far_from_prediction([], 0.1, virtual=True) == ""                        # stopped before a step


def test_1f1b_on_stages_dealt_in_turn_is_said_to_run_interleaved(explorer):
    explorer.schedule_menu.value = "1f1b"
    assert "interleaved" not in explorer.note.value
    explorer.placement = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"     # 4 stages, in turn
    assert explorer.schedule_menu.value == "1f1b" and {e.stage for e in explorer.predicted.compute()} == {0, 1, 2, 3}
    assert "1F1B on stages dealt to the devices in turn runs as interleaved 1F1B" in text(explorer.note.value)


def test_unequal_micro_batch_sizes_are_predicted_drawn_and_run(explorer):
    equal = explorer.predicted.makespan
    explorer.sizes.value = "1,3,3,1"                    # small first and last: a shorter fill and drain
    assert explorer.predicted.micro_batch_sizes == (1, 3, 3, 1) and explorer.predicted.makespan != equal
    first = {e.mb: e.duration for e in explorer.predicted.compute("vgpu:0") if e.kind == "F"}
    assert first[1] > 2 * first[0]                      # 3 sequences' forward takes longer than 1 sequence's
    assert "the same 4 micro-batches (of 1, 3, 3, 1 sequences)" in text(explorer.figure_line.value)
    assert "micro-batch 0 holds 1 sequence, 1 holds 3" in explorer.timeline.legend["labels"]
    assert "1 sequence" in explorer.timeline.panels[0]["boxes"][0][7]                # the box's words on hover
    assert json.loads(explorer.state_file.read_text())["figures"]["micro_batch_sizes"] == [1, 3, 3, 1]
    explorer.wait(timeout=60)                           # widths 1 and 3 measured in the background
    assert {(T, 1), (T, 3)} <= set(explorer._costs) and not explorer.figures["estimated"]
    explorer.run(steps=2)
    explorer.wait(timeout=60)
    assert "step 2/2" in explorer.run_status.value and explorer.measured.micro_batch_sizes == (1, 3, 3, 1)
    explorer.sizes.value = "2,6"                        # 2 sizes: the slider follows where it can
    assert explorer.micro_batches.value == 2 and explorer.predicted.micro_batch_sizes == (2, 6)
    explorer.sizes.value = "2,3,3"                      # 3 micro-batches: no slider position, the box rules
    assert explorer.micro_batches.value == 2 and len({e.mb for e in explorer.predicted.compute()}) == 3
    explorer.micro_batches.value = 4                    # the slider means equal micro-batches: the box empties
    assert explorer.sizes.value == "" and explorer.predicted.micro_batch_sizes is None
    explorer.wait(timeout=60)


@pytest.mark.parametrize("sizes, words", [
    ("1,3,3", "sizes 1, 3, 3 add up to 7 sequences, but the batch holds 8: make them add up to 8"),
    ("1,x,3,3", "sizes: “x” is not a number of sequences"),
    ("0,4,4", "every micro-batch needs at least 1 sequence"),
])
def test_sizes_that_cannot_split_the_batch_are_refused_with_a_way_back_to_equal(explorer, sizes, words):
    explorer.sizes.value = sizes
    assert words in text(explorer.message.value) and explorer.predicted is None and explorer.run_button.disabled
    assert explorer.fix_button.description == "use equal micro-batches"
    explorer.fix_button.click()
    assert explorer.sizes.value == "" and explorer.predicted is not None


def test_a_plan_with_unequal_sizes_and_the_constructor_fill_the_sizes_box():
    from mpedu.predict import Candidate
    model = tiny_model(num_layers=3)
    ex = PipelineExplorer(model, make_batch(T=T, B=B), micro_batches=[2, 4, 2], costs=fixed_costs(model))
    assert ex.sizes.value == "2,4,2" and ex.predicted.micro_batch_sizes == (2, 4, 2)
    assert repr(ex).endswith("micro_batches=[2,4,2])")
    ex.apply(Candidate(Placement.even(model, 2), "1f1b", 4, 1, None, 0.01, (1, 1), True, (1, 3, 3, 1)))
    assert ex.sizes.value == "1,3,3,1" and ex.micro_batches.value == 4 and ex.schedule_menu.value == "1f1b"
    assert ex.predicted.micro_batch_sizes == (1, 3, 3, 1)
    ex.wait(timeout=60)
    with pytest.raises(ValueError, match="add up to 10 sequences, but the batch holds 8"):
        PipelineExplorer(model, make_batch(T=T, B=B), micro_batches=[4, 6], costs=fixed_costs(model))


def test_the_memory_shown_for_unequal_micro_batches_is_what_a_v_step_holds(tmp_path):
    """Each micro-batch holds its own width's activations: the board's memory figures, from the widths the explorer
    measured, are the step's, on a V of ZB-V (2 stages a device) as on any."""
    from mpedu.core import Pipeline
    from mpedu.predict import memory_estimate, profile
    model, batch = tiny_model(num_layers=3), make_batch(T=T, B=B)
    ex = PipelineExplorer(model, batch, devices=2, schedule="zbv", micro_batches=[1, 3, 3, 1],
                          costs=profile(model, batch, micro_batches=M, warmup=0, repeats=1))
    ex.wait(timeout=120)                                # widths 1 and 3, measured in the background
    assert not ex.figures["estimated"] and ex.placement.stage_devices == [0, 1, 1, 0]
    shown = ex.figures["memory_bytes"]
    with Pipeline(model, ex.placement, "zbv", micro_batches=[1, 3, 3, 1]) as pipe:
        held = memory_estimate(pipe, batch)
        timeline = pipe.train_step(batch).timeline
    for f in held:
        assert f.activations == pytest.approx(timeline.peak_memory(f.device), rel=0.05)
        assert shown[f.device] == pytest.approx(f.total, rel=0.05), (f.device, shown, f)
