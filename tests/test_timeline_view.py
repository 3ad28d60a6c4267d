"""The timeline view: a simulated step becomes boxes, transfers and a legend naming every mark; its front end
reads only the traits Python syncs, fetches nothing, and its text is legible."""
import re

import pytest

pytest.importorskip("anywidget")

from mpedu.predict import simulate  # noqa: E402
from mpedu.course import TIMELINE_CSS, TIMELINE_ESM, TimelineView, timeline_panel  # noqa: E402

P, M = 2, 4


def test_a_step_becomes_one_box_per_action_and_one_arrow_per_transfer():
    step = simulate("gpipe", [1e-3] * P, micro_batches=M)
    panel, marks, kinds = timeline_panel(step, "GPipe", step.makespan)
    assert panel["devices"] == step.devices and panel["end"] == pytest.approx(step.makespan * 1e3)
    assert len(panel["boxes"]) == len(step.compute()) == 2 * P * M
    assert len(panel["transfers"]) == len(step.transfers())
    assert sorted(b[6] for b in panel["boxes"] if b[0] == 0) == sorted(f"{k}{mb}" for k in "FB" for mb in range(M))
    assert set(marks) == {("F", 0), ("B", 0), "transfer"} and kinds == set()


def test_show_sends_panels_and_a_legend_for_every_mark_then_bumps_the_revision():
    view = TimelineView()
    step = simulate("zb1", [1e-3] * P, micro_batches=M)
    view.show([step], ["zero bubble"])
    assert view.revision == 1 and [p["title"] for p in view.panels] == ["zero bubble"]
    words = " ".join(m["label"] for m in view.legend["marks"])
    for mark in ("F forward", "B backward", "W weight gradient", "transfer", "waits"):
        assert mark in words
    view.show([], [])
    assert view.revision == 2 and view.panels == []


def test_the_page_reads_every_synced_trait_and_no_other():
    read = set(re.findall(r'model\.get\("(\w+)"\)', TIMELINE_ESM))
    assert read == set(TimelineView.class_own_traits(sync=True))


def test_the_timeline_front_end_fetches_nothing():
    code = TIMELINE_ESM + TIMELINE_CSS
    assert "http" not in code.replace("http://www.w3.org/2000/svg", "") and "import " not in code
    assert "@import" not in TIMELINE_CSS


def test_timeline_text_is_at_least_11_pixels():
    sizes = [int(s) for s in re.findall(r"font-size:\s*(\d+)px", TIMELINE_CSS)]
    assert sizes and min(sizes) >= 11


def test_unequal_micro_batches_show_in_the_box_lengths_their_words_on_hover_and_the_legend():
    sizes = [2, 6, 6, 2]
    step = simulate("gpipe", [1e-3] * P, micro_batches=sizes)
    panel, _, kinds = timeline_panel(step, "GPipe", step.makespan)
    forwards = {b[6]: b for b in panel["boxes"] if b[0] == 0 and b[6].startswith("F")}
    assert forwards["F1"][2] == pytest.approx(3 * forwards["F0"][2])      # 6 sequences take 3 times 2 sequences'
    assert forwards["F1"][7] == "F1: stage 0, micro-batch 1, 6 sequences, 1.50 ms"
    assert ("sizes", (2, 6, 6, 2)) in kinds
    view = TimelineView()
    view.show([step], ["GPipe"])
    assert "micro-batch 0 holds 2 sequences, 1 holds 6, 2 holds 6 and 3 holds 2" in view.legend["labels"]
    equal = simulate("gpipe", [1e-3] * P, micro_batches=M)
    view.show([equal], ["GPipe"])
    assert "holds" not in view.legend["labels"] and "sequence" not in view.panels[0]["boxes"][0][7]
    assert 'svg("title", {}, tip)' in TIMELINE_ESM                                   # the tip, drawn as an SVG title
