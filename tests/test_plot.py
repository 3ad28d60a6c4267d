"""Gantt charts, side-by-side timelines, Chrome traces and saved files, checked through their data."""
import json
import threading
from dataclasses import replace

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.patches import Rectangle

from conftest import make_batch, tiny_model
from mpedu.core import Event, Pipeline, Timeline, plot_timelines

BALANCED = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"


def gpipe_by_hand():
    # vgpu:0: F0 [0,1) F1 [1,2) .......... B0 [5,7) B1 [7,9)      (seconds)
    # vgpu:1:        F0 [1,2) F1 [2,3) B0 [3,5) B1 [5,7)
    t = Timeline(["vgpu:0", "vgpu:1"])
    for e in [Event("vgpu:0", "F", 0, 0, 0.0, 1.0, memory=10), Event("vgpu:0", "F", 0, 1, 1.0, 2.0, memory=10),
              Event("vgpu:0", "send", 0, 0, 1.0, 1.0, bytes=100, peer="vgpu:1"),
              Event("vgpu:0", "send", 0, 1, 2.0, 2.0, bytes=100, peer="vgpu:1"),
              Event("vgpu:1", "F", 1, 0, 1.0, 2.0, memory=20), Event("vgpu:1", "F", 1, 1, 2.0, 3.0, memory=20),
              Event("vgpu:1", "B", 1, 0, 3.0, 5.0, memory=-20), Event("vgpu:1", "B", 1, 1, 5.0, 7.0, memory=-20),
              Event("vgpu:1", "send", 1, 0, 5.0, 5.0, bytes=100, peer="vgpu:0"),
              Event("vgpu:1", "send", 1, 1, 7.0, 7.0, bytes=100, peer="vgpu:0"),
              Event("vgpu:0", "B", 0, 0, 5.0, 7.0, memory=-10), Event("vgpu:0", "B", 0, 1, 7.0, 9.0, memory=-10)]:
        t.add(e)
    return t


def boxes(ax):
    """The action boxes by row (0 = top), each as (x, width); the idle background is not a box."""
    rows = {}
    for p in ax.patches:
        if isinstance(p, Rectangle) and p.get_gid():
            rows.setdefault(round(p.get_y() + p.get_height() / 2), []).append((p.get_x(), p.get_width()))
    return {row: sorted(xs) for row, xs in rows.items()}


def texts(ax):
    return sorted(t.get_text() for t in ax.texts)


def test_gantt_draws_a_box_per_action_on_its_device_row():
    t = gpipe_by_hand()
    ax = t.plot()
    assert [label.get_text() for label in ax.get_yticklabels()] == ["vgpu:0", "vgpu:1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1], "device 0 belongs at the top"
    assert boxes(ax) == {0: [(0.0, 1e3), (1e3, 1e3), (5e3, 2e3), (7e3, 2e3)],
                         1: [(1e3, 1e3), (2e3, 1e3), (3e3, 2e3), (5e3, 2e3)]}
    assert texts(ax) == sorted(["F0", "F1", "B0", "B1"] * 2)
    assert "makespan 9000.0 ms" in ax.get_title("left") and "bubble 33%" in ax.get_title("left")
    assert [x.get_text() for x in ax.get_legend().get_texts()] == ["F forward", "B backward", "transfer", "idle"]
    # transfers: a line per send from the sender's row to the receiver's, at the send's time
    (lines,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    ends = sorted((seg[0][0], seg[1][0], seg[0][1] < seg[1][1]) for seg in lines.get_segments())
    assert ends == [(1e3, 1e3, True), (2e3, 2e3, True), (5e3, 5e3, False), (7e3, 7e3, False)]
    # the idle background spans each row over the whole step
    idle = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_gid()]
    assert [(p.get_x(), p.get_width()) for p in idle] == [(0.0, 9e3)] * 2


def test_gantt_options_title_units_limits_and_no_transfers():
    ax = gpipe_by_hand().plot(title="GPipe by hand", time_unit="s", show_transfers=False, xlim=(0, 12))
    assert ax.get_title("left").startswith("GPipe by hand: makespan 9.0 s, bubble 33%")
    assert ax.get_xlim() == (0, 12) and ax.get_xlabel().startswith("time (s)")
    assert "F3 = forward of micro-batch 3" in ax.get_xlabel(), "the axis label says how to read a box's label"
    assert boxes(ax)[0][2] == (5.0, 2.0)
    assert not [c for c in ax.collections if isinstance(c, LineCollection)]
    assert "transfer" not in [x.get_text() for x in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="time_unit"):
        gpipe_by_hand().plot(time_unit="minutes")


def test_a_device_with_several_stages_names_the_stage_in_each_box():
    t = Timeline(["vgpu:0", "vgpu:1"])
    for s, (d, start) in enumerate([("vgpu:0", 0), ("vgpu:1", 1), ("vgpu:0", 2), ("vgpu:1", 3)]):
        t.add(Event(d, "F", s, 0, start, start + 1))
    ax = t.plot()
    assert texts(ax) == ["0F0", "1F0", "2F0", "3F0"]
    hatched = sorted(p.get_gid() for p in ax.patches if p.get_gid() and p.get_hatch())
    assert hatched == ["vgpu:0 2F0", "vgpu:1 3F0"], "a device's later stage is hatched"
    assert "2nd stage on a device" in [x.get_text() for x in ax.get_legend().get_texts()]


def test_gantt_of_a_real_step_and_of_200_actions():
    with Pipeline(tiny_model(), BALANCED, "1f1b", micro_batches=4) as pipe:
        tl = pipe.train_step(make_batch()).timeline
    ax = tl.plot()
    for row, device in enumerate(tl.devices):
        drawn = boxes(ax)[row]
        assert drawn == sorted((e.start * 1e3, e.duration * 1e3) for e in tl.compute(device))
    big = Timeline([f"vgpu:{d}" for d in range(4)])
    for d in range(4):
        for k in range(50):
            big.add(Event(f"vgpu:{d}", "FBW"[k % 3], d, k, k + d, k + d + 1))
    ax = big.plot()
    assert sum(len(b) for b in boxes(ax).values()) == 200
    FigureCanvasAgg(ax.figure).draw()   # renders with Agg, no pyplot


def test_plotting_works_off_the_main_thread():
    done = []
    thread = threading.Thread(target=lambda: done.append(gpipe_by_hand().plot()))
    thread.start()
    thread.join()
    assert done and boxes(done[0])


def test_predicted_and_measured_stack_on_one_time_axis():
    fast, slow = gpipe_by_hand(), gpipe_by_hand()
    slow.events = [replace(e, start=2 * e.start, end=2 * e.end) for e in slow.events]
    fig = plot_timelines([fast, slow], titles=["predicted", "measured"])
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim() == (0.0, 18e3)
    assert top.get_title("left").startswith("predicted: makespan 9000.0 ms")
    assert bottom.get_title("left").startswith("measured: makespan 18000.0 ms")
    assert top.get_legend() is not None and bottom.get_legend() is None, "one legend serves both"
    own = plot_timelines([fast, slow], shared_axis=False).axes
    assert own[0].get_xlim() == (0.0, 9e3) and own[0].get_title("left").startswith("measured timeline")
    with pytest.raises(ValueError, match="2 titles for 1 timelines"):
        plot_timelines([fast], titles=["a", "b"])


def test_one_legend_keys_the_marks_of_every_panel():
    # GPipe on top (F, B only), zero bubble below (W boxes), interleaved at the bottom (a device's 2nd stage
    # hatched, labels with the stage) and a wavefront (time chunks): the top panel's legend keys all of them.
    gpipe = gpipe_by_hand()
    zb = Timeline(["vgpu:0"], [Event("vgpu:0", "F", 0, 0, 0.0, 1.0), Event("vgpu:0", "B", 0, 0, 1.0, 2.0),
                               Event("vgpu:0", "W", 0, 0, 2.0, 3.0)])
    interleaved = Timeline(["vgpu:0"], [Event("vgpu:0", "F", 0, 0, 0.0, 1.0), Event("vgpu:0", "F", 2, 0, 1.0, 2.0)])
    wave = Timeline(["vgpu:0"], [Event("vgpu:0", "F", 0, 0, 0.0, 1.0, chunk=0),
                                 Event("vgpu:0", "F", 0, 0, 1.0, 2.0, chunk=1)])
    fig = plot_timelines([gpipe, zb, interleaved, wave])
    keys = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert keys == ["F forward", "B backward", "W weight gradient", "1st stage on a device",
                    "2nd stage on a device", "transfer", "idle"]
    assert all(ax.get_legend() is None for ax in fig.axes[1:])
    assert "1F3.2 = stage 1's forward of micro-batch 3, time chunk 2" in fig.axes[-1].get_xlabel()
    hatched = [p for p in fig.axes[0].get_legend().get_patches() if p.get_hatch()]
    assert len(hatched) == 1, "the hatched key stands for the hatched boxes"
    alone = gpipe.plot()
    assert "W weight gradient" not in [x.get_text() for x in alone.get_legend().get_texts()], \
        "a timeline drawn alone keys only its own marks"


def test_chrome_trace_has_a_slice_per_action_a_track_per_device_and_memory_counters(tmp_path):
    t = gpipe_by_hand()
    t.to_chrome_trace(tmp_path / "step.json")
    trace = json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "vgpu:0", 1: "vgpu:1"}
    assert {e["pid"] for e in trace} == {0}
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == len(t.events)
    for e in t.events:
        (x,) = [x for x in slices if x["cat"] == e.kind and x["args"]["mb"] == e.mb and x["args"]["stage"] == e.stage]
        assert x["tid"] == t.devices.index(e.device)
        assert x["ts"] == pytest.approx(e.start * 1e6) and x["dur"] == pytest.approx(e.duration * 1e6)
    assert {x["name"] for x in slices if x["cat"] == "F"} == {"F mb0 s0", "F mb1 s0", "F mb0 s1", "F mb1 s1"}
    send = next(x for x in slices if x["cat"] == "send")
    assert send["args"]["bytes"] == 100 and send["args"]["to"] == "vgpu:1"
    # each send is a flow arrow from the sender's track into the action that used the data
    starts = {e["id"]: e for e in trace if e["ph"] == "s"}
    lands = {e["id"]: e for e in trace if e["ph"] == "f"}
    assert len(starts) == 4 and starts.keys() == lands.keys()
    used = {(x["tid"], x["name"]) for x in slices for f in lands.values()
            if f["tid"] == x["tid"] and x["ts"] <= f["ts"] <= x["ts"] + x["dur"] and x["cat"] != "send"}
    assert used == {(1, "F mb0 s1"), (1, "F mb1 s1"), (0, "B mb0 s0"), (0, "B mb1 s0")}
    for d, per_mb in (("vgpu:0", 10), ("vgpu:1", 20)):
        series = [(c["ts"], c["args"]["bytes"]) for c in trace if c["ph"] == "C" and c["name"] == f"{d} activations"]
        assert series == [(t * 1e6, b) for t, b in t.memory_over_time(d)]
        assert max(b for _, b in series) == 2 * per_mb


def test_save_writes_the_picture_the_trace_and_the_timeline(tmp_path):
    t = gpipe_by_hand()
    paths = t.save(tmp_path / "out", stem="last")
    assert [p.name for p in paths] == ["last.png", "last.json", "last.timeline.json"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "traceEvents" in json.loads(paths[1].read_text())
    assert Timeline.from_dict(json.loads(paths[2].read_text())).events == t.events


def test_time_chunk_labels_name_chunk_zero_too_and_units_follow_the_caller():
    from mpedu.core import plot_timelines
    t = Timeline(["vgpu:0"])
    for c in range(2):
        t.add(Event("vgpu:0", "F", 0, 0, float(c), c + 1.0, chunk=c))
    ax = t.plot()
    assert sorted(x.get_text() for x in ax.texts if x.get_text().startswith("F")) == ["F0.0", "F0.1"]
    fig = plot_timelines([t, t], time_unit="s")
    assert fig.axes[-1].get_xlim()[1] == pytest.approx(2.0)
