"""The layer board's front end: it reads only the traits Python syncs, fetches nothing, and its text is legible. And
the board's stages in the explorer: the V-shape schedules lay the layers out as a V (two stages a device, device 0
holding the first and the last), a drag keeps a V where it can, a layout that is no V is refused with a button."""
import json
import re

import pytest

pytest.importorskip("anywidget")

from conftest import make_batch, tiny_model  # noqa: E402
from mpedu.core import Placement  # noqa: E402
from mpedu.course import BOARD_CSS, BOARD_ESM, LayerBoard, PipelineExplorer  # noqa: E402
from mpedu.predict import Candidate  # noqa: E402
from test_widgets import B, M, T, fixed_costs  # noqa: E402


def test_the_page_reads_every_synced_trait_and_no_other():
    read = set(re.findall(r'model\.get\("(\w+)"\)', BOARD_ESM))
    for names in re.findall(r"\[([^\]]*)\]\.map\(\(n\) => model\.get\(n\)\)|const names = \[([^\]]*)\]", BOARD_ESM):
        read |= set(re.findall(r'"(\w+)"', "".join(names)))
    assert read == set(LayerBoard.class_own_traits(sync=True))


def test_a_drop_sends_back_the_assignment_python_reads():
    board = LayerBoard(layers=["embed", "decode"], devices=["vgpu:0", "vgpu:1"],
                       assignment={"embed": "vgpu:0", "decode": "vgpu:0"})
    assert 'model.set("assignment", a)' in BOARD_ESM and "model.save_changes()" in BOARD_ESM
    seen = []
    board.observe(lambda change: seen.append(change["new"]), "assignment")
    board.set_state({"assignment": {"embed": "vgpu:0", "decode": "vgpu:1"}})   # what the front end's save sends
    assert seen == [{"embed": "vgpu:0", "decode": "vgpu:1"}]


def test_the_board_front_end_fetches_nothing():
    code = BOARD_ESM + BOARD_CSS
    assert "http" not in code and "import " not in code
    assert "@import" not in BOARD_CSS


def test_board_text_is_at_least_11_pixels():
    sizes = [int(s) for s in re.findall(r"font-size:\s*(\d+)px", BOARD_CSS)]
    assert sizes and min(sizes) >= 11


# -- stage cuts and the V (ZB-V, DualPipeV) on the explorer's board, without a browser --------------------------------
def v_explorer(num_layers=3, devices=2, tied=False, **kwargs):
    model = tiny_model(num_layers=num_layers, **(dict(tie_weights=True, embed_size=64) if tied else {}))
    kwargs.setdefault("micro_batches", M)
    return PipelineExplorer(model, make_batch(T=T, B=B), devices=devices, costs=fixed_costs(model), **kwargs)


def stages_of(explorer) -> dict:
    """{device: [the layers of each stage it holds]}, as the board's stage boxes group them."""
    held = {}
    for device, layers in explorer.placement.stages:
        held.setdefault(device.name, []).append(layers)
    return held


def words(explorer) -> str:
    return re.sub(r"<[^>]+>", "", explorer.message.value)


def test_picking_a_v_schedule_lays_the_layers_out_as_a_v_with_the_first_and_last_stage_on_device_0(tmp_path):
    explorer = v_explorer(state_file=tmp_path / "state.json")     # embed, lstm0-2, decode on 2 devices, evenly
    assert explorer.board.cuts == [] and len(explorer.placement.stages) == 2
    explorer.schedule_menu.value = "zbv"
    assert explorer.placement == Placement.v_shape(explorer.model, 2)
    assert stages_of(explorer) == {"vgpu:0": [["embed", "lstm0"], ["decode"]], "vgpu:1": [["lstm1"], ["lstm2"]]}
    assert explorer.board.cuts == ["lstm2"]              # lstm1 | lstm2: two stages on vgpu:1, the V's turn
    # the prediction runs the V: device 0 runs the first stage and the last
    assert {e.stage for e in explorer.predicted.compute("vgpu:0")} == {0, 3}
    assert {e.kind for e in explorer.predicted.compute()} == {"F", "B", "W"}
    assert "4 stages on 2 devices" in explorer.figure_line.value
    state = json.loads(explorer.state_file.read_text())                # what a browser test reads
    assert state["cuts"] == ["lstm2"]
    assert state["placement"] == "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu1 | decode:vgpu0"


def test_a_drag_between_the_stages_of_a_v_keeps_a_v_and_one_that_breaks_it_is_refused_with_a_button():
    explorer = v_explorer(schedule="dualpipev")          # starts on the V
    assert stages_of(explorer)["vgpu:0"] == [["embed", "lstm0"], ["decode"]]
    explorer.board.assignment = {**explorer.board.assignment, "lstm0": "vgpu:1"}     # stage 0 gives lstm0 to stage 1
    assert stages_of(explorer) == {"vgpu:0": [["embed"], ["decode"]], "vgpu:1": [["lstm0", "lstm1"], ["lstm2"]]}
    explorer.board.assignment = {**explorer.board.assignment, "lstm2": "vgpu:0"}     # stage 2 gives lstm2 to stage 3
    # vgpu:1's one run is cut where the V turns: still 4 stages, device 0 holding the first and the last
    assert stages_of(explorer) == {"vgpu:0": [["embed"], ["lstm2", "decode"]], "vgpu:1": [["lstm0"], ["lstm1"]]}
    assert explorer.predicted is not None
    explorer.board.assignment = {**explorer.board.assignment, "lstm0": "vgpu:0"}     # vgpu:1 keeps one layer: no V
    assert explorer.predicted is None
    assert "DualPipeV needs the layers laid out as a V" in words(explorer)
    assert "vgpu:0 holds the first stage and the last" in words(explorer)
    assert explorer.fix_button.description == "lay the layers out as a V"
    explorer.fix_button.click()
    assert explorer.predicted is not None and len(stages_of(explorer)["vgpu:0"]) == 2


def test_the_v_schedules_refusals_are_in_words_with_a_fix():
    explorer = v_explorer(schedule="dualpipev", micro_batches=2)
    assert "needs at least as many micro-batches as stages: 4 for 2 devices, but you chose 2" in words(explorer)
    explorer.fix_button.click()
    assert explorer.micro_batches.value == 4 and explorer.predicted is not None
    explorer.device_count.value = 3                       # 5 layers cannot make 6 stages
    assert "needs two stages on every device, so at least 6 layers for 3 devices; this model has 5" in words(explorer)
    explorer.device_count.value = 2                       # a new count under a V schedule: a V again
    assert explorer.predicted is not None and explorer.board.cuts
    explorer.schedule_menu.value = "1f1b"                 # the V has two stages a device: not for 1F1B
    assert "vgpu:0 holds 2: embed lstm0 / decode (the V that ZB-V and DualPipeV run on)" in words(explorer)
    explorer.fix_button.click()
    assert explorer.schedule_menu.value == "gpipe" and explorer.placement.stage_devices == [0, 1, 1, 0]


def test_a_tied_model_is_refused_across_devices_and_trains_on_a_v():
    explorer = v_explorer(num_layers=2, tied=True, steps=2)
    assert explorer.predicted is None and explorer.run_button.disabled
    assert ("embed and decode share one weight matrix (tied weights), so they must sit on one device, but embed is "
            "on vgpu:0 and decode on vgpu:1") in words(explorer)
    explorer.fix_button.click()                           # the V puts them on vgpu:0
    assert [layers for device, layers in explorer.placement.stages if device.name == "vgpu:0"] == [["embed"],
                                                                                                   ["decode"]]
    explorer.schedule_menu.value = "zbv"
    explorer.run()
    explorer.wait(timeout=60)
    assert "step 2/2" in explorer.run_status.value and len(explorer.losses) == 2
    assert {e.stage for e in explorer.measured.compute("vgpu:0")} == {0, 3}


def test_a_v_plan_applied_puts_its_cuts_on_the_board_and_its_sizes_in_the_box():
    explorer = v_explorer(num_layers=4)
    v = Placement.v_shape(explorer.model, 2, sizes=[1, 1, 3, 1])
    explorer.apply(Candidate(v, "zbv", 4, 1, None, 0.01, (1, 1), True, (1, 3, 3, 1)))
    assert explorer.schedule_menu.value == "zbv" and explorer.placement == v and explorer.board.cuts == ["lstm1"]
    assert explorer.sizes.value == "1,3,3,1" and explorer.predicted.micro_batch_sizes == (1, 3, 3, 1)
    explorer.wait(timeout=60)
