"""balance finds the best contiguous split (checked against brute force) and explains memory limits."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from mpedu.predict import Costs, balance, balance_by_params, balance_by_time, balance_v, balance_v_by_time, to_placement


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


# ---- the V shape: device r holds stages r and 2p - 1 - r ---------------------------------------------------------

def v_loads(costs, sizes):
    """Each device's work when stage s of `sizes` sits on device min(s, 2p - 1 - s), told stage by stage."""
    p, loads, at = len(sizes) // 2, {}, 0
    for s, size in enumerate(sizes):
        loads[min(s, 2 * p - 1 - s)] = loads.get(min(s, 2 * p - 1 - s), 0) + sum(costs[at:at + size])
        at += size
    return loads


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=4, max_size=9), st.integers(1, 3))
def test_a_v_balance_is_the_best_of_every_v_split(costs, p):
    if 2 * p > len(costs):
        with pytest.raises(ValueError, match=f"a V shape on {p} devices needs {2 * p} stages"):
            balance_v(costs, p)
        return
    sizes = balance_v(costs, p)
    assert len(sizes) == 2 * p and sum(sizes) == len(costs) and min(sizes) >= 1
    best = min(max(v_loads(costs, c).values()) for c in splits(len(costs), 2 * p))
    assert max(v_loads(costs, sizes).values()) == best


def test_a_v_balance_puts_heavy_ends_together_and_keeps_tied_weights():
    model = tiny_model(num_layers=4, embed_size=64, hidden_size=64, tie_weights=True)   # embed, lstm0-3, decode
    n = len(model.layer_names)
    costs = Costs(model.layer_names, [0.1, 1, 1, 1, 1, 2.0], [0.2, 2, 2, 2, 2, 4.0], [1] * n, [1] * n,
                  [100] * n, [10] * n, [50] * n, [0] * n, (9, 8))        # activations, outputs, weights: bytes
    v = balance_v_by_time(model, None, ["vgpu:0", "vgpu:1"], costs=costs)
    assert v.stage_devices == [0, 1, 1, 0] and v.stages[0][1][0] == "embed" and v.stages[-1][1][-1] == "decode"
    loads = v_loads([f + b for f, b in zip(costs.forward, costs.backward)], [len(names) for _, names in v.stages])
    assert max(loads.values()) == pytest.approx(9.3)       # device 0 holds both ends: 0.3 + 3 + 6 at best
    with pytest.raises(ValueError, match=r"no V shape of 6 layers over 2 devices keeps every device within "
                                         r"memory_cap=1 under gpipe with 1 micro-batch: the smallest footprint is"):
        balance_v_by_time(model, None, ["vgpu:0", "vgpu:1"], costs=costs, memory_cap=1)
    roomy = balance_v_by_time(model, None, ["vgpu:0", "vgpu:1"], costs=costs, memory_cap="1GB")
    assert roomy == v                                        # a cap that binds nothing changes nothing
    with pytest.raises(ValueError, match="tie"):                 # a line cannot keep them together
        balance_by_time(model, None, ["vgpu:0", "vgpu:1"], costs=costs)
