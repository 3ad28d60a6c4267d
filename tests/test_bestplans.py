"""The explorer's best plans: the planner's own answer for the board's devices, link and cap, on the explorer's costs;
a row's button puts its plan on the board (drawn once, predicted as the row says); the planner runs again only when
what it depends on changes, never for a drag."""
import re

import pytest

pytest.importorskip("anywidget")

from conftest import make_batch, tiny_model  # noqa: E402
from test_widgets import B, M, T, fixed_costs, moved  # noqa: E402
from mpedu.course import PipelineExplorer, describe, same_plan  # noqa: E402
from mpedu.predict import CostCurve, plan, search_shapes  # noqa: E402
from mpedu.runtime import LINKS  # noqa: E402


def make(memory_cap=None, costs=None):
    model = tiny_model(num_layers=3)                    # embed, lstm0-2, decode: 5 layers
    explorer = PipelineExplorer(model, make_batch(T=T, B=B), devices=2, micro_batches=M, steps=2,
                                costs=costs(model) if costs else fixed_costs(model), memory_cap=memory_cap)
    explorer.wait(timeout=60)
    return explorer


def planned(explorer, memory_cap=None, profiles=None):
    """What mpedu.plan says for the explorer's devices and link, on its costs (the time chunks' bytes weighed, as the
    explorer weighs them), searched afresh."""
    profiles = profiles or [fixed_costs(explorer.model)]
    ms = sorted(B // c.micro_batch[1] for c in profiles)
    curve = CostCurve(profiles, []).weigh(explorer.model, search_shapes(T, B, ms))
    return plan(explorer.model, explorer.batch, explorer.board.devices, memory_cap,
                costs=curve, micro_batches=ms, link=explorer.link)


def key(c):
    return str(c.placement), c.schedule, c.micro_batches, c.chunks, c.recompute, c.step_s, c.device_bytes


def text(box) -> str:
    return re.sub(r"<[^>]+>", "", box.children[1].value)


def uncapped_fastest_peak():
    explorer = make()
    return planned(explorer).front[0].peak_bytes


def test_the_first_row_that_fits_is_the_planners_best():
    explorer = make()
    rows = explorer.best_plans.rows
    assert rows and all(c.fits for c in rows)
    assert key(rows[0]) == key(planned(explorer).best)
    assert [c.step_s for c in rows] == sorted(c.step_s for c in rows)
    assert "★" in text(explorer.best_plans.table.children[0])


def test_with_a_cap_the_best_is_the_planners_and_the_rows_over_it_exceed_it():
    cap = uncapped_fastest_peak() - 1                   # the fastest plan no longer fits
    explorer = make(memory_cap=cap)
    assert explorer.best_plans.memory_cap == cap
    rows = explorer.best_plans.rows
    best = planned(explorer, cap).best
    assert key(next(c for c in rows if c.fits)) == key(best)
    assert any(not c.fits for c in rows), "the plans the cap excludes are not shown"
    for c, box in zip(rows, explorer.best_plans.table.children):
        assert c.fits == (max(c.device_bytes) <= cap)
        assert ("over the cap" in text(box)) == (not c.fits)
        assert ("★" in text(box)) == (key(c) == key(best))
        assert describe(c) in text(box)


def test_the_planner_searches_the_explorers_link_and_every_measured_micro_batch_count():
    explorer = make(costs=lambda model: [fixed_costs(model, B // M), fixed_costs(model, 1, per_sequence=2.0)])
    profiles = [fixed_costs(explorer.model, B // M), fixed_costs(explorer.model, 1, per_sequence=2.0)]
    assert key(explorer.best_plans.rows[0]) == key(planned(explorer, profiles=profiles).best)
    assert {c.micro_batches for c in explorer.best_plans.plans.simulated} <= {M, B}
    explorer.link_menu.value = next(k for k, link in LINKS.items() if link.emulated and link.bandwidth_Bps < 50e9)
    explorer.slowdown.value = 100
    explorer.wait(timeout=60)
    assert key(explorer.best_plans.rows[0]) == key(planned(explorer, profiles=profiles).best)


def test_a_row_puts_its_plan_on_the_board_drawn_once_and_predicted_as_the_row_says():
    explorer = make(memory_cap=uncapped_fastest_peak() - 1)
    rows = list(explorer.best_plans.rows)
    assert len({(str(c.placement), c.schedule, c.chunks, c.recompute) for c in rows}) > 1
    for c, box in zip(rows, explorer.best_plans.table.children):
        redraws = explorer._redraws
        box.children[0].click()                         # the row's "apply" button
        assert explorer._redraws == redraws + 1
        assert explorer.placement == c.placement
        assert (explorer.schedule_menu.value, explorer.micro_batches.value, explorer.recompute) == (
            c.schedule, c.micro_batches, c.recompute)
        if c.chunks > 1:
            assert explorer.chunks.value == c.chunks
        assert explorer.predicted.makespan == pytest.approx(c.step_s, rel=1e-9)
        assert tuple(explorer.figures["memory_bytes"].values()) == c.device_bytes
        assert "← your choice" in text(box)
        assert ("over the cap" in explorer.best_plans.versus.value) == (not c.fits)
    assert explorer.best_plans.searches == 1            # applying a plan of these devices searches nothing


def test_the_choice_is_shown_against_the_best():
    explorer = make()
    best = explorer.best_plans.plans.best
    line = explorer.best_plans.versus.value
    assert f"{explorer.predicted.makespan * 1e3:.1f} ms" in line
    assert f"{explorer.predicted.makespan / best.step_s:.2f}×" in line
    explorer.apply(best)
    assert "it is the fastest plan that fits" in explorer.best_plans.versus.value
    explorer.schedule_menu.value = "zb1"                # refused: each device must hold one stage ...
    moved(explorer, "lstm0", "vgpu:1")                  # ... and now one holds two
    assert explorer.placement is None and "refused" in explorer.best_plans.versus.value
    first = explorer.best_plans.rows[0]
    explorer.best_plans.table.children[0].children[0].click()   # a way out of a refusal
    assert explorer.placement == first.placement and explorer.schedule_menu.value == first.schedule
    assert same_plan(first, (str(first.placement), first.schedule, first.micro_batches, first.chunks, first.recompute))
    assert "← your choice" in text(explorer.best_plans.table.children[0])


def test_a_drag_or_a_menu_searches_nothing_new_devices_a_link_a_cap_or_new_costs_do():
    explorer = make()
    plans = explorer.best_plans
    assert plans.searches == 1
    moved(explorer, "lstm2", "vgpu:0")
    explorer.schedule_menu.value = "1f1b"
    explorer.recompute_menu.value = "all"
    explorer.wait(timeout=60)
    assert plans.searches == 1
    explorer.device_count.value = 3
    explorer.wait(timeout=60)
    assert plans.searches == 2 and all(len(c.placement.devices) == 3 for c in plans.rows)
    explorer.link_menu.value = "pcie4"
    explorer.wait(timeout=60)
    assert plans.searches == 3
    plans.cap.value = "1GB"
    explorer.wait(timeout=60)
    assert plans.searches == 4 and plans.plans.memory_cap == 10**9
    explorer.micro_batches.value = B                    # a new width: measured in the background, then searched
    explorer.wait(timeout=60)
    assert plans.searches == 5, plans.header.value
    assert {c.micro_batches for c in plans.plans.simulated} == {M, B}


def test_the_last_of_quick_changes_is_the_one_listed():
    explorer = make()
    for p in (3, 4, 2, 3):
        explorer.device_count.value = p
    explorer.wait(timeout=60)
    assert 2 <= explorer.best_plans.searches <= 5
    assert all(len(c.placement.devices) == 3 for c in explorer.best_plans.rows)


def test_a_cap_nothing_fits_or_that_is_not_a_size_is_said_in_the_panel():
    explorer = make()
    explorer.best_plans.cap.value = "1kB"
    explorer.wait(timeout=60)
    header = explorer.best_plans.header.value
    assert explorer.best_plans.rows == [] and "No plan fits the cap of 1 kB per device on 2 devices" in header
    assert "memory_cap=" not in header and "recompute=" not in header      # the explorer's words, not the API's
    assert "over the cap" in explorer.best_plans.versus.value              # and the board's own choice is over it
    # the minimum it names, typed back, fits (rounded down, "555 kB" for 555,072 bytes, it did not)
    least = re.search(r"the smallest needs (\S+ \S+) on its largest device", header).group(1)
    explorer.best_plans.cap.value = least.replace(" ", "")
    explorer.wait(timeout=60)
    assert explorer.best_plans.rows and explorer.best_plans.plans.best is not None
    explorer.best_plans.cap.value = "plenty"
    assert "plenty" in explorer.best_plans.header.value and explorer.best_plans.rows == []
    explorer.best_plans.cap.value = ""
    explorer.wait(timeout=60)
    assert explorer.best_plans.rows and explorer.best_plans.memory_cap is None


def test_while_a_run_trains_no_plan_can_be_applied():
    explorer = make()
    explorer.run()
    buttons = [box.children[0] for box in explorer.best_plans.table.children]
    assert buttons and all(b.disabled for b in buttons) and explorer.best_plans.cap.disabled
    explorer.wait(timeout=120)
    assert not any(b.disabled for b in buttons) and not explorer.best_plans.cap.disabled
