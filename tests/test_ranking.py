"""Plans measured for real beside their predictions: the rows, the worst error, and Kendall's tau of the ranking."""
import pytest

from conftest import fake_costs, make_batch, tiny_model
from mpedu.predict import Costs, Measurement, kendall_tau, measure, plan


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


def test_measured_plans_run_on_the_link_they_were_predicted_with(model, monkeypatch):
    from mpedu.predict import Candidate
    batch = make_batch(T=9, B=8)
    costs = Costs.from_dict(fake_costs(model.layer_names, 9, 4).to_dict())
    plans = plan(model, batch, 2, costs=costs, schedules=("gpipe",), link="10gbe")
    built = []
    real = Candidate.pipeline
    monkeypatch.setattr(Candidate, "pipeline", lambda self, model, **kw: built.append(kw) or real(self, model, **kw))
    plans.measure(model, batch, top=2, steps=1, warmup=0)
    assert [kw.get("link") for kw in built] == ["10gbe", "10gbe"]
    model.zero_grad(set_to_none=True)
    # on GPUs the copies take their real time, and a Pipeline refuses an emulated link there: none is passed

    class Built(Exception):
        pass

    def gpu_pipeline(self, model, **kw):
        built.append(kw)
        raise Built
    from mpedu.runtime import Device
    monkeypatch.setattr(Device, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(Candidate, "pipeline", gpu_pipeline)
    built.clear()
    with pytest.raises(Built):
        plans.measure(model, batch, top=2, steps=1, warmup=0)
    assert built == [{}]


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
    rows = [{"label": "gpipe m=2", "placement": "a", "predicted_s": 0.010, "measured_s": 0.008, "error": 0.25,
             "steps_s": [0.008, 0.009, 0.008]},
            {"label": "1f1b m=4", "placement": "b", "predicted_s": 0.012, "measured_s": 0.015, "error": -0.2,
             "steps_s": [0.015, 0.014, 0.016]}]
    result = Measurement(rows, kendall_tau([0.010, 0.012], [0.008, 0.015]))
    assert result.kendall_tau == 1.0 and result.worst_error == 0.25 and result.kendall_tau_apart == (1.0, 1, 1)
    assert "+25.0%" in str(result) and "worst error 25.0%" in str(result)
    assert "(+1.00 over the 1 of 1 pairs the rounds tell apart)" in str(result)
    one = plan(model, make_batch(T=9, B=8), 2, costs=fake_costs(model.layer_names, 9, 4)).top(1)
    with pytest.raises(ValueError, match="a ranking needs two or more"):
        measure(one, model, make_batch(T=9, B=8))


def test_the_ranking_is_also_judged_over_the_pairs_the_rounds_tell_apart():
    from mpedu.predict import tau_apart, told_apart
    steady = [1.00, 1.01, 1.00, 1.02, 1.00]
    assert told_apart(steady, [1.10, 1.12, 1.11, 1.10, 1.13])               # faster in every round
    assert not told_apart(steady, [1.01, 0.99, 1.02, 1.01, 0.99])           # noise: 3 rounds of 5 one way
    assert told_apart(steady, [1.01, 0.99, 1.02, 1.01, 0.99], share=0.6)
    with pytest.raises(ValueError, match="one step time per round"):
        told_apart(steady, steady[:3])
    # a and b are told apart (b slower every round), c lies within a's noise: only (a, b) and (b, c) count
    steps = [steady, [1.2, 1.21, 1.19, 1.2, 1.22], [1.01, 0.99, 1.02, 1.01, 0.99]]
    assert tau_apart([0.9, 1.3, 1.0], steps) == (1.0, 2, 3)
    assert tau_apart([0.9, 1.3, 0.8], steps) == (1.0, 2, 3)                 # a vs c misordered, but not told apart
    assert tau_apart([1.4, 1.3, 1.0], steps) == (0.0, 2, 3)                 # (a, b) wrong, (b, c) right
    assert tau_apart([1.0, 1.0], [steady, steady]) == (0.0, 0, 1)
