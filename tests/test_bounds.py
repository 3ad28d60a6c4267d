"""The planner's lower bounds, on textbook schedules: what each device holds, its memory floor, the time bound."""
import pytest

from mpedu.predict import StageCost, held_units, memory_floor, simulate, time_bound
from mpedu.core import make

P, M = 2, 4
UNIT = [StageCost(1.0, activation_bytes=100, param_bytes=10, input_bytes=30)] * P   # F = 1, B + W = 2


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p():
    # GPipe runs all m forwards before any backward; 1F1B's first device warms up with p forwards
    assert held_units(make("gpipe", [0, 1], M)) == [[[(0, M)]], [[(1, M)]]]
    assert held_units(make("1f1b", [0, 1], M)) == [[[(0, P)]], [[(1, 1)]]]


def test_the_memory_floor_counts_weights_gradients_and_what_is_held():
    for name, units in (("gpipe", M), ("1f1b", P)):
        schedule = make(name, [0, 1], M)
        held = held_units(schedule)
        assert memory_floor(UNIT, [0, 1], held, None, 1) == 10 + 10 + units * 100
        # recomputation keeps only each stage's input (30 bytes) per micro-batch
        assert memory_floor(UNIT, [0, 1], held, "all", 1) == 10 + 10 + units * 30


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "zb1"])
def test_the_time_bound_is_below_the_simulated_step(name):
    uneven = [StageCost(1.0), StageCost(2.5)]
    heavy_forward = [StageCost(2.0, backward=1.0), StageCost(1.0)]
    schedule = make(name, [0, 1], M)
    for costs in (UNIT, uneven, heavy_forward):
        for recompute in (None, "all"):
            # cores < 1: two workers doing less than one core's worth together (a loaded machine), which
            # simulate still runs a lone device at full speed through
            for cores in (None, 0.5, 1.0, 1.5):
                step = simulate(schedule, costs, recompute=recompute, cores=cores).makespan
                assert 0 < time_bound(schedule, costs, P, cores, recompute) <= step * (1 + 1e-9), cores


def test_the_time_bound_is_the_textbook_gpipe_step_on_unit_stages():
    bound = time_bound(make("gpipe", [0, 1], M), UNIT, P, None, None)
    assert bound == pytest.approx((M + P - 1) * 3.0)        # (m + p - 1) (F + B), the textbook GPipe step
    # two devices sharing one core: all the work, one after another
    assert time_bound(make("gpipe", [0, 1], M), UNIT, P, 1.0, None) == pytest.approx(P * M * 3.0)
