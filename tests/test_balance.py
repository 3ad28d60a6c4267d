"""balance finds the best contiguous split (checked against brute force) and explains memory limits."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from mpedu.predict import Costs, balance, balance_by_params, balance_by_time, to_placement


def splits(n, p):
    """Every way to cut n layers into p non-empty contiguous stages, as layer counts."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def stage_sums(values, counts):
    out, at = [], 0
    for c in counts:
        out.append(sum(values[at:at + c]))
        at += c
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_balance_matches_brute_force(data):
    n = data.draw(st.integers(1, 8))
    p = data.draw(st.integers(1, n))
    costs = data.draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n))
    counts = balance(costs, p)
    assert len(counts) == p and sum(counts) == n and min(counts) >= 1
    best = min(max(stage_sums(costs, c)) for c in splits(n, p))
    assert max(stage_sums(costs, counts)) == pytest.approx(best, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_balance_under_a_memory_cap_matches_brute_force(data):
    n = data.draw(st.integers(1, 8))
    p = data.draw(st.integers(1, n))
    costs = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    memory = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    cap = data.draw(st.integers(0, 60))
    feasible = [c for c in splits(n, p) if max(stage_sums(memory, c)) <= cap]
    if not feasible:
        with pytest.raises(ValueError, match="memory_cap"):
            balance(costs, p, memory, cap)
        return
    counts = balance(costs, p, memory, cap)
    assert max(stage_sums(memory, counts)) <= cap
    assert max(stage_sums(costs, counts)) == min(max(stage_sums(costs, c)) for c in feasible)


def test_a_heavy_last_layer_gets_a_device_of_its_own():
    # like a 10k-vocabulary decoder: the equal-count split [3, 3] would be 2x slower
    assert balance([0.2, 8, 8, 8, 8, 40], 2) == [5, 1]
    assert balance([1] * 6, 3) == [2, 2, 2]


def test_memory_errors_say_what_would_fit():
    with pytest.raises(ValueError, match=r"smallest cap that fits is 3; at 2 you need 3 devices: pass p=3"):
        balance([1] * 6, 2, memory=[1] * 6, memory_cap=2)
    with pytest.raises(ValueError, match="decode alone needs 5, more than memory_cap=2: no number of devices"):
        balance([1] * 3, 2, memory=[1, 1, 5], memory_cap=2, names=["embed", "lstm0", "decode"])
    assert balance([1, 1, 1, 9], 2, memory=[2, 2, 2, 1], memory_cap=4) == [2, 2]   # time alone says [3, 1]
    assert balance([1, 1, 1, 9], 2) == [3, 1]


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="3 devices but only 2 layers"):
        balance([1, 2], 3)
    with pytest.raises(ValueError, match="layer 1 is -1"):
        balance([1, -1], 1)
    with pytest.raises(ValueError, match="give both memory"):
        balance([1, 2], 1, memory=[1, 1])


def test_balance_by_params_and_by_time_build_placements():
    model = tiny_model(num_layers=3)        # embed, lstm0-2, decode
    placement = balance_by_params(model, ["vgpu:0", "vgpu:1"])
    sizes = [sum(p.numel() for p in model.layers[n].parameters()) for n in model.layer_names]
    counts = [len(names) for _, names in placement.stages]
    assert max(stage_sums(sizes, counts)) == min(max(stage_sums(sizes, c)) for c in splits(5, 2))
    n = len(model.layer_names)
    costs = Costs(model.layer_names, [1, 1, 1, 1, 6.0], [2, 2, 2, 2, 12.0], [1] * n, [1] * n, [0] * n, [0] * n,
                  [0] * n, [0] * n, (9, 8))
    placement = balance_by_time(model, None, ["vgpu:0", "vgpu:1"], costs=costs)
    assert str(placement) == "embed,lstm0-2:vgpu0 | decode:vgpu1"
    assert to_placement(model, [2, 3], ["vgpu:1", "vgpu:0"]) == placement.__class__.parse(
        "embed,lstm0:vgpu1 | lstm1-2,decode:vgpu0", model)
    with pytest.raises(ValueError, match="tie"):
        balance_by_params(tiny_model(embed_size=64, tie_weights=True), 2)
