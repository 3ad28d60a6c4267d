"""Plans measured for real beside their predictions: the rows, the worst error, and Kendall's tau of the ranking."""
import pytest

from conftest import fake_costs, make_batch, tiny_model
from mpedu.planner import plan
from mpedu.profile import Costs
from mpedu.ranking import Measurement, kendall_tau, measure


@pytest.fixture(scope="module")
def model():
    return tiny_model(num_layers=3)


def test_kendall_tau_on_literal_orders():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="length >= 2"):
        kendall_tau([1], [1])


def test_measure_runs_the_top_candidates_for_real(model):
    batch = make_batch(T=9, B=8)
    costs = Costs.from_dict(fake_costs(model.layer_names, 9, 4).to_dict())
    plans = plan(model, batch, 2, costs=costs, schedules=("gpipe", "1f1b"))
    top = plans.top(3)
    assert len(top) == 3 and [c.step_s for c in top] == sorted(c.step_s for c in top)
    result = plans.measure(model, batch, top=3, steps=1, warmup=0)
    assert [r["label"] for r in result.rows] == [c.label for c in top]
    assert all(r["measured_s"] > 0 and r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
               for r in result.rows)
    assert -1.0 <= result.kendall_tau <= 1.0
    assert "Kendall tau" in result.table()
    assert all(p.grad is None for p in model.parameters())     # measuring leaves the model as it was


def test_measure_lets_the_caller_run_the_rounds_again(model):
    # a benchmark's round runner: run round 0 twice (the first "disturbed", so forgotten), then the rest
    batch = make_batch(T=9, B=8)
    plans = plan(model, batch, 2, costs=fake_costs(model.layer_names, 9, 4), schedules=("gpipe", "1f1b"))
    calls = []

    def rounds(one_round, count):
        one_round(0)()                                  # disturbed: undone
        for r in range(count):
            calls.append(r)
            one_round(r)

    result = plans.measure(model, batch, top=2, steps=3, warmup=1, rounds=rounds)
    assert calls == [0, 1, 2] and all(len(r["steps_s"]) == 3 for r in result.rows)


def test_a_measurement_reads_its_worst_error_and_needs_two_plans(model):
    rows = [{"label": "gpipe m=2", "placement": "a", "predicted_s": 0.010, "measured_s": 0.008, "error": 0.25},
            {"label": "1f1b m=4", "placement": "b", "predicted_s": 0.012, "measured_s": 0.015, "error": -0.2}]
    result = Measurement(rows, kendall_tau([0.010, 0.012], [0.008, 0.015]))
    assert result.kendall_tau == 1.0 and result.worst_error == 0.25
    assert "+25.0%" in str(result) and "worst error 25.0%" in str(result)
    one = plan(model, make_batch(T=9, B=8), 2, costs=fake_costs(model.layer_names, 9, 4)).top(1)
    with pytest.raises(ValueError, match="a ranking needs two or more"):
        measure(one, model, make_batch(T=9, B=8))
