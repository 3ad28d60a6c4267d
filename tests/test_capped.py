"""Zero bubble under a memory cap: any cap gives a valid order that never holds more, and the knob spans the
family (1F1B's memory, ZB-H1's bubble, down to one micro-batch at a time). Exactness against one device and the
memory model against the step's hooks are in test_exact.py and test_footprint.py (zb_cap2, zb_cap1 on a V)."""
import pytest
from hypothesis import given, settings, strategies as st

from mpedu.core import schedules
from mpedu.predict import simulate
from mpedu.runtime import Link

FREE = Link(latency_s=0.0)


def held_at_most(schedule) -> dict[int, int]:
    """The most micro-batches each device holds at once: from its first F there to its last W there."""
    out = {}
    for d, row in enumerate(schedule.actions):
        stages = {a.stage for a in row}
        w_left, peak = {}, 0
        for a in row:
            if a.kind == "F" and a.mb not in w_left:
                w_left[a.mb] = set(stages)
            elif a.kind == "W":
                w_left[a.mb].discard(a.stage)
                if not w_left[a.mb]:
                    del w_left[a.mb]
            peak = max(peak, len(w_left))
        out[d] = peak
    return out


def ticks(schedule) -> float:
    return simulate(schedule, [1.0] * schedule.num_stages, link=FREE).makespan       # F = B = W = 1


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 1, 0], [0, 1, 0, 1], [0, 1, 2, 2, 1, 0]]),
       st.integers(1, 9), st.integers(1, 6))
def test_every_cap_gives_a_valid_order_that_never_holds_more(stage_devices, m, cap):
    schedule = schedules.zb_capped(stage_devices, m, cap)          # validated: every F, B, W once, and no deadlock
    assert schedule.name == f"zb_cap{cap}" and schedule.split_backward == frozenset(range(len(stage_devices)))
    assert max(held_at_most(schedule).values()) <= min(cap, m)


def test_the_knob_spans_the_zero_bubble_family_on_one_stage_per_device():
    # 2 devices: a cap of 2 is ZB-H1's memory and ZB-H1's length; 1 runs one micro-batch at a time
    zb1 = schedules.make("zb1", [0, 1], 8)
    assert ticks(schedules.zb_capped([0, 1], 8, 2)) == ticks(zb1) == 25
    assert held_at_most(schedules.zb_capped([0, 1], 8, 2)) == {0: 2, 1: 2}
    # 4 devices: more memory, shorter steps, down to ZB-H1's 27 ticks from a cap of 5
    steps = [ticks(schedules.zb_capped([0, 1, 2, 3], 8, cap)) for cap in range(1, 7)]
    assert steps == sorted(steps, reverse=True) and steps[4] == ticks(schedules.make("zb1", [0, 1, 2, 3], 8)) == 27
    assert steps[3] <= ticks(schedules.make("1f1b", [0, 1, 2, 3], 8))          # 1F1B's memory (p): no longer than 1F1B
    assert schedules.zb_capped([0, 1], 4, 1).to_text() == ("0F0 0B0 0W0 0F1 0B1 0W1 0F2 0B2 0W2 0F3 0B3 0W3\n"
                                                  "1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2 1F3 1B3 1W3")


def test_on_a_v_the_cap_trades_memory_for_bubble_down_from_zbvs_length():
    v = [0, 1, 2, 3, 3, 2, 1, 0]
    zbv = schedules.make("zbv", v, 8)
    assert ticks(schedules.zb_capped(v, 8, 4)) == ticks(zbv) == 51           # 6m + p - 1, holding what zbv holds
    assert ticks(schedules.zb_capped(v, 8, 3)) < ticks(schedules.zb_capped(v, 8, 2)) < ticks(schedules.zb_capped(v, 8, 1))


def test_make_reads_the_cap_from_the_name_and_refuses_a_bad_one():
    assert schedules.make("ZB-cap3", [0, 1, 2], 4).name == "zb_cap3"
    with pytest.raises(ValueError, match=r"or zb_cap<k> \(zero bubble holding at most k micro-batches per device"):
        schedules.make("zb_cap0", [0, 1], 4)
    with pytest.raises(ValueError, match="cap=0: the micro-batches a device may hold at once, a whole number >= 1"):
        schedules.zb_capped([0, 1], 4, 0)
    with pytest.raises(ValueError, match="m=0: the number of micro-batches"):
        schedules.zb_capped([0, 1], 0, 2)
