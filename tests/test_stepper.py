"""Stepping through a timeline without a browser: the order of the actions, what each waits for and what every device
holds after each one, checked by hand for GPipe and 1F1B on 2 devices (m = 4, unit costs: F = 1 s, B = 2 s, the
shared link's 20 µs per transfer); properties on other schedules, a measured step, the widget's traits and the
explorer's toggle."""
import re

import pytest

pytest.importorskip("anywidget")

from conftest import make_batch, tiny_model  # noqa: E402
from mpedu.core import schedules  # noqa: E402
from mpedu.course import PipelineExplorer, StepThrough, TimelineView, step_through, walk_timeline  # noqa: E402
import mpedu.course.stepper as stepper  # noqa: E402
from mpedu.predict import Costs, StageCost, simulate  # noqa: E402

# Worked out by hand from the schedules' rows and the costs: "k device action <- device of what it waits for and
# that action | what gpu:0 holds | what gpu:1 holds". Ties in start time go in device order (none here: the
# 20 µs transfers break them). A B frees its micro-batch from its start; an F holds it from its start.
GPIPE = """
 1 0 F0 <-        | F0 |
 2 0 F1 <-        | F0 F1 |
 3 1 F0 <- 0 F0   | F0 F1 | F0
 4 0 F2 <-        | F0 F1 F2 | F0
 5 1 F1 <- 0 F1   | F0 F1 F2 | F0 F1
 6 0 F3 <-        | F0 F1 F2 F3 | F0 F1
 7 1 F2 <- 0 F2   | F0 F1 F2 F3 | F0 F1 F2
 8 1 F3 <- 0 F3   | F0 F1 F2 F3 | F0 F1 F2 F3
 9 1 B0 <- 1 F0   | F0 F1 F2 F3 | F1 F2 F3
10 1 B1 <- 1 F1   | F0 F1 F2 F3 | F2 F3
11 0 B0 <- 1 B0   | F1 F2 F3 | F2 F3
12 1 B2 <- 1 F2   | F1 F2 F3 | F3
13 0 B1 <- 1 B1   | F2 F3 | F3
14 1 B3 <- 1 F3   | F2 F3 |
15 0 B2 <- 1 B2   | F3 |
16 0 B3 <- 1 B3   | |
"""
ONE_F_ONE_B = """
 1 0 F0 <-        | F0 |
 2 0 F1 <-        | F0 F1 |
 3 1 F0 <- 0 F0   | F0 F1 | F0
 4 1 B0 <- 1 F0   | F0 F1 |
 5 1 F1 <- 0 F1   | F0 F1 | F1
 6 0 B0 <- 1 B0   | F1 | F1
 7 1 B1 <- 1 F1   | F1 |
 8 0 F2 <-        | F1 F2 |
 9 0 B1 <- 1 B1   | F2 |
10 1 F2 <- 0 F2   | F2 | F2
11 1 B2 <- 1 F2   | F2 |
12 0 F3 <-        | F2 F3 |
13 1 F3 <- 0 F3   | F2 F3 | F3
14 0 B2 <- 1 B2   | F3 | F3
15 1 B3 <- 1 F3   | F3 |
16 0 B3 <- 1 B3   | |
"""
# Where a device sat idle waiting for what the action needs, and for how long (seconds), also by hand: GPipe's
# gpu:1 waits 1 s for the first forward, then gpu:0 waits from its last forward (ends at 4) to the first gradient
# (arrives at 7.00004); 1F1B's waits are shorter and more, two of them the 20 µs of a transfer that lands as the
# device finishes.
GPIPE_WAITS = {3: 1.00002, 11: 3.00004}
ONE_F_ONE_B_WAITS = {3: 1.00002, 6: 2.00004, 10: 0.00004, 14: 0.00004, 16: 1.0}


def table(steps) -> str:
    def device(name):
        return name[-1]
    lines = []
    for s in steps:
        e, n = s.action, s.waits_for
        wait = f"{device(n.device)} {n.kind}{n.mb}" if n is not None else ""
        held = " | ".join(" ".join(s.held[d]) for d in ("gpu:0", "gpu:1"))
        lines.append(f"{s.number} {device(e.device)} {s.label} <- {wait} | {held}")
    return "\n".join(lines)


def normal(text: str) -> str:
    return "\n".join(re.sub(r"\s+", " ", line).strip() for line in text.strip().splitlines())


@pytest.mark.parametrize("name, expected, waits", [("gpipe", GPIPE, GPIPE_WAITS),
                                                   ("1f1b", ONE_F_ONE_B, ONE_F_ONE_B_WAITS)])
def test_two_devices_four_micro_batches_step_by_step(name, expected, waits):
    steps = walk_timeline(simulate(name, [1.0, 1.0], micro_batches=4))
    assert normal(table(steps)) == normal(expected)
    assert [s.of for s in steps] == [16] * 16
    assert {s.number: pytest.approx(s.waiting, abs=1e-9) for s in steps if s.waiting > 1e-9} == waits


def test_what_an_action_waits_for_reads_as_a_sentence():
    steps = walk_timeline(simulate("gpipe", [1.0, 1.0], micro_batches=4))
    third, eleventh = steps[2], steps[10]
    # gpu:1's first forward: gpu:0's F0, over a transfer (sent as F0 ends at 1 s, landing 20 µs later)
    assert third.transfer is not None and (third.transfer.device, third.transfer.peer) == ("gpu:0", "gpu:1")
    assert third.ready == pytest.approx(1.00002) and third.needs == (third.waits_for,)
    assert third.describe() == ("gpu:1 runs F0, 1000 → 2000 ms; it needs F0 from gpu:0 (sent at 1000 ms, here at "
                                "1000 ms): gpu:1 waited 1000 ms for it")
    # gpu:0's first backward needs its own F0 (long done) and gpu:1's B0 (the gradient of its output): the latter
    assert [(n.device, n.kind, n.mb) for n in eleventh.needs] == [("gpu:1", "B", 0), ("gpu:0", "F", 0)]
    assert eleventh.describe().endswith("gpu:0 waited 3000 ms for it")
    assert steps[8].describe() == "gpu:1 runs B0, 5000 → 7000 ms; it needs F0, done here at 2000 ms"
    assert steps[0].describe() == "gpu:0 runs F0, 0.00 → 1000 ms; it needs only the batch"
    assert steps[2].holdings() == ["gpu:0 holds 2 micro-batches' activations: F0 F1",
                                   "gpu:1 holds 1 micro-batch's activations: F0"]
    assert steps[-1].holdings() == ["gpu:0 holds no activations", "gpu:1 holds no activations"]


def test_1f1b_holds_at_most_two_micro_batches_on_device_0_where_gpipe_holds_four():
    most = {name: max(len(s.held["gpu:0"]) for s in walk_timeline(simulate(name, [1.0, 1.0], micro_batches=4)))
            for name in ("gpipe", "1f1b")}
    assert most == {"gpipe": 4, "1f1b": 2}


COSTS = [StageCost(1e-3, activation_bytes=2_000_000, output_bytes=1000)] * 2


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb1"])
def test_bytes_follow_the_held_micro_batches_and_peak_where_the_memory_model_does(name):
    timeline = simulate(name, COSTS, micro_batches=4)
    steps = walk_timeline(timeline)
    if name != "zb1":           # a split backward keeps its output's gradient between B and W: more than activations
        assert all(s.held_bytes[d] == 2_000_000 * len(s.held[d]) for s in steps for d in timeline.devices)
    for d in timeline.devices:  # a device runs one action at a time: by start or by end, the same running sums
        assert max(s.held_bytes[d] for s in steps) == timeline.peak_memory(d)
    assert steps[-1].held_bytes == {"gpu:0": 0, "gpu:1": 0}
    assert steps[1].holdings()[0] == "gpu:0 holds 2 micro-batches' activations: F0 F1 (4.0 MB)"
    assert steps[1].holdings()[1] == "gpu:1 holds no activations (0 MB)"
    assert walk_timeline(simulate(name, [1.0, 1.0], micro_batches=4))[0].held_bytes is None   # no memory data


def test_a_split_backward_holds_its_micro_batch_until_the_weights_gradient():
    steps = walk_timeline(simulate("zb1", [1.0, 1.0], micro_batches=4))
    at = {(s.action.device, s.label): s for s in steps}
    b, w = at["gpu:0", "B0"], at["gpu:0", "W0"]
    assert "F0" in b.held["gpu:0"] and "F0" not in w.held["gpu:0"]
    assert (w.waits_for.device, w.waits_for.kind, w.waits_for.mb) == ("gpu:0", "B", 0) and w.transfer is None


def test_a_recomputed_backward_waits_for_its_forward_run_again():
    steps = walk_timeline(simulate("1f1b", COSTS, micro_batches=4, recompute="all"))
    rerun = [s for s in steps if s.action.kind == "B" and any(n.kind == "R" for n in s.needs)]
    assert len(rerun) == 8                                       # every micro-batch, on both stages
    assert all(s.waits_for.kind == "R" and s.waits_for.device == s.action.device for s in rerun)


@pytest.mark.parametrize("name, stage_devices, chunks", [("gpipe", [0, 1, 2], 1), ("1f1b", [0, 1, 2], 1),
                                                         ("zb1", [0, 1], 1), ("interleaved", [0, 1, 0, 1], 1),
                                                         ("wavefront", [0, 1], 2)])
def test_every_schedule_steps_in_time_order_each_waiting_for_an_output_already_there(name, stage_devices, chunks):
    schedule = schedules.make(name, stage_devices, 4, chunks)
    timeline = simulate(schedule, [1.0] * schedule.num_stages)
    steps = walk_timeline(timeline)
    assert len(steps) == len(timeline.compute())
    assert [s.action.start for s in steps] == sorted(s.action.start for s in steps)
    forwards = [s for s in steps if s.action.kind == "F"]
    for s in steps:
        if s.waits_for is not None:
            assert s.waits_for in s.needs and s.ready <= s.action.start + 1e-9          # no output from the future
            assert (s.transfer is None) == (s.waits_for.device == s.action.device)      # a transfer between devices
        else:
            assert s.action.kind == "F" and s.action.stage == 0 and s.action.chunk == 0  # only the batch
        done = [f for f in forwards if f.number <= s.number]
        assert sum(map(len, s.held.values())) <= len(done)
    assert all(not held for held in steps[-1].held.values())
    if name == "interleaved":                     # a device holds two stages: labels name them, as the boxes do
        assert steps[0].label == "0F0" and {"0F0", "2F0"} <= {label for s in steps for label in s.held["gpu:0"]}
    if chunks > 1:
        assert steps[0].label == "F0.0" and "chunk's activations" in steps[0].holdings()[0]


def test_the_widget_syncs_each_steps_boxes_words_and_where_the_page_is():
    timeline = simulate("1f1b", COSTS, micro_batches=4)
    view = step_through(timeline)
    [panel] = view.panels
    assert panel["title"] == "predicted step: 15.1 ms, bubble 20%"
    assert len(view.steps) == 16 and view.step == 1 and view.current.label == "F0"
    for page, s in zip(view.steps, view.walked):
        assert panel["boxes"][page["box"]][6] == page["label"] == s.label       # the box the page outlines
        assert page["text"] == s.describe() and page["memory"] == s.holdings()
    third = view.steps[2]
    sender, _, receiver, _ = panel["transfers"][third["transfer"]]
    assert (sender, receiver) == (0, 1) and panel["boxes"][third["waits"]][:2] == [0, 0.0]   # gpu:0's F0
    view.step = 3                                  # what a click in the page sends
    assert view.current.action.device == "gpu:1" and view.current.held["gpu:1"] == ("F0",)
    view.load(simulate("gpipe", COSTS, micro_batches=4), "GPipe", at=99)
    assert view.step == 16 and view.panels[0]["title"] == "GPipe" and view.current.held == {"gpu:0": (), "gpu:1": ()}
    view.show([], [])
    assert view.steps == [] and view.current is None and view.panels == []
    assert isinstance(StepThrough(), StepThrough)


def test_the_page_reads_every_synced_trait_fetches_nothing_and_writes_legibly():
    read = set(re.findall(r'model\.get\("(\w+)"\)', stepper.STEPPER_ESM))
    assert read == set(TimelineView.class_own_traits(sync=True)) | set(StepThrough.class_own_traits(sync=True))
    code = stepper.STEPPER_ESM + stepper.STEPPER_CSS
    assert "http" not in code.replace("http://www.w3.org/2000/svg", "") and "import " not in code
    sizes = [int(s) for s in re.findall(r"font-size:\s*(\d+)px", stepper.STEPPER_CSS)]
    assert sizes and min(sizes) >= 11


def fixed_costs(model, T=9, sequences=2):
    n = len(model.layer_names)
    forward = [1e-3] * n
    return Costs(model.layer_names, forward, [2 * f for f in forward], forward, forward,
                 activation_bytes=[1000] * n, output_bytes=[100] * (n - 1) + [0], param_bytes=[5000] * n,
                 shared_bytes=[0] * n, micro_batch=(T, sequences))


def test_the_explorers_toggle_steps_through_the_prediction_then_the_last_run():
    model = tiny_model(num_layers=3)
    explorer = PipelineExplorer(model, make_batch(T=9, B=8), devices=2, micro_batches=4, costs=fixed_costs(model),
                                steps=1)
    assert explorer.stepper.layout.display == "none" and explorer.step_toggle.layout.display is None
    explorer.step_toggle.value = True
    assert explorer.stepper.layout.display is None
    assert len(explorer.stepper.steps) == len(explorer.predicted.compute())
    assert explorer.stepper.panels[0]["title"].startswith("stepping through the predicted step")
    explorer.stepper.step = 5
    explorer.schedule_menu.value = "1f1b"           # a new prediction: stepped at the same action number
    assert explorer.stepper.step == 5 and explorer.stepper.walked[0].action in explorer.predicted.events
    explorer.schedule_menu.value = "zb1"
    explorer.board.assignment = {**explorer.board.assignment, "embed": "vgpu:1"}     # two stages on vgpu:1: refused
    assert explorer.predicted is None
    assert explorer.stepper.layout.display == "none" and explorer.step_toggle.layout.display == "none"
    explorer.board.assignment = {**explorer.board.assignment, "embed": "vgpu:0"}
    explorer.schedule_menu.value = "gpipe"
    assert explorer.stepper.layout.display is None
    explorer.run()
    explorer.wait(60)
    assert explorer.measured is not None
    assert explorer.stepper.panels[0]["title"].startswith("stepping through the last measured step")
    assert explorer.stepper.walked[0].action in explorer.measured.events
    assert all(not held for held in explorer.stepper.walked[-1].held.values())
    explorer.step_toggle.value = False
    assert explorer.stepper.layout.display == "none"
