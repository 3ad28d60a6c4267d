"""The explorer's words: every menu entry names something the library accepts, a link's label gives its speed, and
the note on small micro-batches appears only when they cost clearly more per sequence."""
from conftest import tiny_model
from test_widgets import B, M, fixed_costs
from mpedu.predict import planner
from mpedu.runtime import LINKS, Link
from mpedu.core import make
from mpedu.course import RECOMPUTE, SCHEDULES, cost_note, link_label, sequences


def test_every_menu_entry_is_a_schedule_and_a_recomputation_the_library_takes():
    assert set(SCHEDULES) == set(planner.SCHEDULES)
    for name in SCHEDULES:
        assert make(name, [0, 1, 0, 1] if name == "interleaved" else [0, 1], 2).name
    assert {None if key == "none" else key for key in RECOMPUTE} == set(planner.RECOMPUTE)


def test_a_link_label_gives_its_latency_and_bandwidth():
    assert link_label("shared", LINKS["shared"]).endswith("(no added delay)")
    assert "5000 µs + 0.01 GB/s" in link_label("mine", Link(5e-3, 1e7, "mine"))
    assert "no bandwidth limit" in link_label("slow", Link(1e-3, float("inf"), "slow"))
    assert all(link_label(key, link) for key, link in LINKS.items())


def test_the_note_explains_an_estimate_and_dearer_small_micro_batches_only():
    model = tiny_model(num_layers=3)
    usual, small = fixed_costs(model, B // M), fixed_costs(model, 1, per_sequence=2.0)
    assert "measuring the layers on micro-batches of 1 sequence now" in cost_note(small, [usual], measured=False)
    assert cost_note(usual, [usual, small], measured=True) == ""
    assert "2.0× the time per sequence" in cost_note(small, [usual, small], measured=True)
    near = fixed_costs(model, 1, per_sequence=1.1)       # 10% dearer: within noise, no note
    assert cost_note(near, [usual, near], measured=True) == ""
    assert (sequences(1), sequences(3)) == ("1 sequence", "3 sequences")
