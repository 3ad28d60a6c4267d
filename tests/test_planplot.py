"""The planner's picture: every simulated candidate, the front, the best, the cap, and measured points."""
import matplotlib.pyplot as plt
import pytest

from conftest import fake_costs, make_batch, tiny_model
from mpedu.predict import CostCurve, Measurement, plan
from mpedu.pictures import plot_plans


@pytest.fixture(scope="module")
def plans():
    model = tiny_model(num_layers=3)
    curve = CostCurve([fake_costs(model.layer_names, 9, b) for b in (1, 2, 4, 8)], [])
    free = plan(model, make_batch(T=9, B=8), 2, costs=curve)
    cap = (free.front[0].peak_bytes + free.front[-1].peak_bytes) // 2
    return plan(model, make_batch(T=9, B=8), 2, costs=curve, memory_cap=cap)


def test_the_picture_shows_every_candidate_the_front_and_the_cap(plans):
    ax = plot_plans(plans)
    [grey] = ax.collections
    assert len(grey.get_offsets()) == len(plans.simulated)
    lines = {line.get_label(): line for line in ax.get_lines()}
    front = lines["Pareto front (predicted)"]
    assert list(front.get_xdata()) == pytest.approx([c.step_s * 1e3 for c in plans.front])
    assert list(front.get_ydata()) == pytest.approx([c.peak_bytes / 1e6 for c in plans.front])
    assert lines[f"fastest that fits: {plans.best.label}"].get_xdata()[0] == pytest.approx(plans.best.step_s * 1e3)
    assert lines["memory cap"].get_ydata()[0] == pytest.approx(plans.memory_cap / 1e6)
    assert plans.plot().get_legend() is not None          # Plans.plot draws the same picture
    plt.close("all")


def test_measured_points_sit_at_their_plans_memory(plans):
    chosen = plans.top(2)
    rows = [{"label": c.label, "placement": str(c.placement), "predicted_s": c.step_s,
             "measured_s": 2 * c.step_s, "error": -0.5} for c in chosen]
    ax = plot_plans(plans, measured=Measurement(rows, 1.0))
    squares = [line for line in ax.get_lines() if line.get_marker() == "s" and len(line.get_xdata())]
    drawn = sorted((x, y) for line in squares for x, y in zip(line.get_xdata(), line.get_ydata()))
    want = sorted((2 * c.step_s * 1e3, c.peak_bytes / 1e6) for c in chosen)    # measured x, the plan's memory y
    assert [x for x, _ in drawn] == pytest.approx([x for x, _ in want])
    assert [y for _, y in drawn] == pytest.approx([y for _, y in want])
    assert "measured (same memory)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close("all")
