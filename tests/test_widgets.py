"""PipelineExplorer without a browser: trait changes redraw, bad choices become messages, Run trains and Stop stops."""
import json
import time

import pytest
import torch

pytest.importorskip("anywidget")

from conftest import make_batch, tiny_model  # noqa: E402
from mpedu.placement import Placement  # noqa: E402
from mpedu.profile import Costs  # noqa: E402
from mpedu.timeline import Timeline  # noqa: E402
from mpedu.widgets import _CSS, _ESM, PipelineExplorer  # noqa: E402

B, T, M = 8, 9, 4


def fixed_costs(model):
    """Made-up costs for micro-batches of B / M columns: the decoder is the heavy layer, as in a real LM."""
    n = len(model.layer_names)
    forward = [1e-4] + [1e-3] * (n - 2) + [4e-3]
    return Costs(model.layer_names, forward, [2 * f for f in forward], [f for f in forward], [f for f in forward],
                 activation_bytes=[1000] * n, output_bytes=[100] * (n - 1) + [0], param_bytes=[5000] * n,
                 shared_bytes=[0] * n, micro_batch=(T, B // M))


@pytest.fixture
def explorer(tmp_path):
    model = tiny_model(num_layers=3)                    # embed, lstm0-2, decode: 5 layers
    return PipelineExplorer(model, make_batch(T=T, B=B), devices=2, micro_batches=M, costs=fixed_costs(model),
                            steps=3, state_file=tmp_path / "state.json")


def moved(explorer, layer, device):
    """What a drop in the browser does: send back the assignment with one layer changed."""
    explorer.board.assignment = {**explorer.board.assignment, layer: device}


def test_starts_with_an_even_split_and_its_prediction(explorer):
    assert explorer.placement == Placement.even(explorer.model, 2)
    assert explorer.board.devices == ["vgpu:0", "vgpu:1"]
    assert explorer.board.layers == explorer.model.layer_names
    assert isinstance(explorer.predicted, Timeline) and explorer.predicted.source == "predicted"
    assert bytes(explorer.image.value[:4]) == b"\x89PNG"
    assert str(explorer.placement) in explorer.message.value
    assert set(explorer.figures) >= {"makespan_s", "bubble", "speedup", "transfers", "memory_bytes"}
    assert explorer.figures["transfers"] == 2 * M        # one cut, both directions, every micro-batch
    assert set(explorer.board.device_notes) == {"vgpu:0", "vgpu:1"}
    assert repr(explorer) == ("PipelineExplorer(embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1, schedule=gpipe, "
                              "micro_batches=4)")


def test_a_dropped_layer_changes_the_placement_and_redraws_quickly(explorer):
    before, picture = explorer.predicted.makespan, explorer.image.value
    start = time.perf_counter()
    moved(explorer, "lstm2", "vgpu:0")                  # the observer redraws before this returns
    seconds = time.perf_counter() - start
    print(f"redraw after a drop: {seconds * 1e3:.0f} ms")
    assert str(explorer.placement) == "embed,lstm0-2:vgpu0 | decode:vgpu1"
    assert explorer.predicted.makespan != before
    assert explorer.image.value != picture
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
    explorer.micro_batches.value = 2                    # a new micro-batch shape: profiled once, then cached
    assert len(explorer.predicted.compute()) == 2 * 2 * 2
    seen.add(explorer.predicted.makespan)
    assert explorer.chunks.disabled
    explorer.schedule_menu.value = "wavefront"
    assert not explorer.chunks.disabled
    explorer.chunks.value = 3
    assert {e.chunk for e in explorer.predicted.compute()} == {0, 1, 2}
    assert len(seen) == 2


def test_only_divisors_of_the_batch_are_offered(explorer):
    assert explorer.micro_batches.options == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="micro_batches=3 does not divide the batch size 8"):
        PipelineExplorer(explorer.model, explorer.batch, micro_batches=3, costs=fixed_costs(explorer.model))


@pytest.mark.parametrize("change, words", [
    (lambda ex: setattr(ex.board, "assignment", dict.fromkeys(ex.model.layer_names, "vgpu:0")),
     "vgpu:1 holds no layer"),
    (lambda ex: setattr(ex.device_count, "value", 6), "6 devices but only 5 layers"),
    (lambda ex: (moved(ex, "lstm0", "vgpu:1"), setattr(ex.schedule_menu, "value", "zb1")),
     "zb1 schedule needs one stage per device"),
    (lambda ex: setattr(ex.schedule_menu, "value", "interleaved"), "interleaved needs each of the p devices"),
])
def test_invalid_choices_show_a_message_not_a_traceback(explorer, change, words):
    change(explorer)
    assert words in explorer.message.value
    assert "Traceback" not in explorer.message.value
    assert explorer.placement is None or explorer.predicted is None
    assert explorer.predicted is None and explorer.figures == {}
    assert explorer.run_button.disabled
    assert explorer.image.layout.visibility == "hidden"


def test_fixing_the_choice_clears_the_message(explorer):
    explorer.board.assignment = dict.fromkeys(explorer.model.layer_names, "vgpu:0")
    assert explorer.predicted is None
    moved(explorer, "decode", "vgpu:1")
    assert explorer.predicted is not None and "⚠" not in explorer.message.value
    assert not explorer.run_button.disabled and explorer.image.layout.visibility == "visible"


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


def test_the_state_file_holds_what_python_sees(explorer):
    moved(explorer, "lstm2", "vgpu:0")
    state = json.loads(explorer.state_file.read_text())
    assert state["placement"] == "embed,lstm0-2:vgpu0 | decode:vgpu1"
    assert state["assignment"]["lstm2"] == "vgpu:0"
    assert state["figures"]["transfers"] == 2 * M


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


def test_a_failing_run_reports_in_the_widget():
    model = tiny_model(num_layers=2, embed_size=64, tie_weights=True)   # embed and decode share one weight
    explorer = PipelineExplorer(model, make_batch(T=T, B=B), devices=2, micro_batches=M, costs=fixed_costs(model))
    explorer.run()
    explorer.wait(timeout=60)
    assert "tied weights" in explorer.run_status.value and "Traceback" not in explorer.run_status.value
    assert not explorer.running and not explorer.board.locked


def test_the_front_end_code_fetches_nothing():
    assert "http" not in _ESM + _CSS and "import " not in _ESM and "@import" not in _CSS
