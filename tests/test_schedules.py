"""Schedules are data: generators checked against literal tables, the validator, the string form."""
import math

import pytest
from hypothesis import given, strategies as st

from conftest import FUZZ, make_batch, tiny_model
from mpedu.core import Action, B, F, Pipeline, Schedule, ScheduleError, W, make, run_order


def table(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in row) for row in schedule.actions]


# Each table is one row per device, aligned so a reader sees the phases.

def test_gpipe_fills_then_drains():
    assert table(make("gpipe", [0, 1, 2], 4)) == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    ]


def test_gpipe_with_a_device_holding_two_stages():
    assert table(make("gpipe", [0, 1, 0], 3)) == [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 2B1 2B2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_1f1b_warm_up_steady_cool_down():
    assert table(make("1f1b", [0, 1, 2], 4)) == [
        # warm-up  | steady state | cool-down
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    assert table(make("1f1b", [0, 1], 5)) == [
        "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0B4",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1F4 1B4",
    ]


def test_1f1b_with_fewer_micro_batches_than_stages():
    assert table(make("1f1b", [0, 1, 2], 1)) == ["0F0 0B0", "1F0 1B0", "2F0 2B0"]


def test_zb1_delays_w_by_the_stage_index():
    assert table(make("zb1", [0, 1, 2], 3)) == [
        "0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2",
        "1F0 1F1 1B0 1F2 1B1 1W0 1B2 1W1 1W2",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2W1 2W2",
    ]


def test_interleaved_two_devices_two_chunks():
    assert table(make("interleaved", [0, 1, 0, 1], 4)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    # 1f1b on a round-robin placement is the interleaved schedule
    assert table(make("1f1b", [0, 1, 0, 1], 4)) == table(make("interleaved", [0, 1, 0, 1], 4))


def test_naive_runs_one_micro_batch_at_a_time():
    assert table(make("naive", [0, 1], 2)) == ["0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1"]
    played = run_order(make("naive", [0, 1, 2], 3))
    starts = sorted((start, end) for _, _, start, end in played)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(starts, starts[1:])), \
        "naive model parallelism must keep exactly one device busy at a time"


@pytest.mark.parametrize("text", ["0F0", "1F3", "12B7", "2W0", "3F1.2"])
def test_action_string_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_parse_rejects_garbage_with_a_hint():
    with pytest.raises(ValueError, match="stage 1, forward, micro-batch 3"):
        Action.parse("F13")


def _bubble(schedule, f=1.0, b=2.0, w=1.0):
    def cost(d, a):
        if a.kind == "F":
            return f
        if a.kind == "W":
            return w
        return b - w if a.stage in schedule.split_backward else b
    played = run_order(schedule, cost)
    span = max(end for *_, end in played)
    busy = sum(end - start for _, _, start, end in played)
    return 1 - busy / (schedule.num_devices * span), span


@pytest.mark.parametrize("p,m", [(2, 4), (3, 8), (4, 8), (8, 32)])
def test_textbook_bubbles_with_equal_costs(p, m):
    devices = list(range(p))
    gpipe, _ = _bubble(make("gpipe", devices, m))
    assert gpipe == pytest.approx((p - 1) / (m + p - 1))
    one_f, span_1f1b = _bubble(make("1f1b", devices, m))
    assert one_f == pytest.approx(gpipe)
    # ZB-H1 with F = B = W: idle time per device (p - 1) against 1F1B's 3 (p - 1)
    _, span_zb = _bubble(make("zb1", devices, m), f=1, b=2, w=1)
    assert span_zb == pytest.approx(3 * m + (p - 1))
    assert (span_zb - 3 * m) == pytest.approx((span_1f1b - 3 * m) / 3)


def test_interleaving_shrinks_the_bubble():
    plain, _ = _bubble(make("1f1b", [0, 1], 8))
    inter, _ = _bubble(make("interleaved", [0, 1, 0, 1], 8), f=0.5, b=1.0)  # half-size stages
    assert inter < plain


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_every_generated_schedule_validates(name, p, m):
    schedule = make(name, list(range(p)), m)
    counts = sum(len(row) for row in schedule.actions)
    assert counts == p * m * (3 if name == "zb1" else 2)


def test_validator_names_a_missing_action():
    s = make("gpipe", [0, 1], 2)
    s.actions[1].remove(B(1, 1))
    with pytest.raises(ScheduleError, match="1B1 is missing"):
        s.validate()


def test_validator_marks_an_action_on_the_wrong_device():
    s = make("gpipe", [0, 1], 2)
    s.actions[0].append(F(1, 0))
    with pytest.raises(ScheduleError) as err:
        s.validate()
    assert "1F0: stage 1 lives on device 1, not device 0" in str(err.value)
    assert "dev 0" in str(err.value) and "<-- ERROR HERE" in str(err.value)


def test_validator_finds_a_deadlock_and_says_who_waits_for_what():
    s = Schedule("bad", (0, 1), 1, [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]])
    with pytest.raises(ScheduleError, match="deadlock") as err:
        s.validate()
    assert "device 0 waits at 0B0 for 0F0" in str(err.value)


def test_validator_rejects_duplicates_and_w_without_split():
    s = make("gpipe", [0, 1], 2)
    s.actions[0].insert(0, F(0, 0))
    with pytest.raises(ScheduleError, match="appears twice"):
        s.validate()
    s = make("gpipe", [0, 1], 1)
    s.actions[0].append(W(0, 0))
    with pytest.raises(ScheduleError, match="no separate W"):
        s.validate()


def test_make_explains_bad_names_and_counts():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe"):
        make("pipedream", [0, 1], 2)
    with pytest.raises(ValueError, match="micro_batches must be .* got 0"):
        make("gpipe", [0, 1], 0)
    with pytest.raises(ValueError, match="multiple of the 2 devices"):
        make("interleaved", [0, 1, 0, 1], 3)
    with pytest.raises(ValueError, match="one stage per device"):
        make("zb1", [0, 1, 0], 2)
    with pytest.raises(ValueError, match="round-robin"):
        make("1f1b", [0, 0, 1], 2)


def test_wavefront_dependencies_follow_bptt():
    s = Schedule("chunks", (0, 1), 1, [[], []], chunks=3)
    assert set(s.dependencies(F(1, 0, 2))) == {F(0, 0, 2), F(1, 0, 1)}
    assert set(s.dependencies(B(0, 0, 1))) == {F(0, 0, 1), B(1, 0, 1), B(0, 0, 2)}
    assert set(s.dependencies(B(1, 0, 2))) == {F(1, 0, 2)}


def test_wavefront_walks_the_diagonal_and_reverses_chunks_in_backward():
    s = make("wavefront", [0, 1], 1, chunks=3)
    assert table(s) == [
        "0F0 0F0.1 0F0.2 0B0.2 0B0.1 0B0",
        "1F0 1F0.1 1F0.2 1B0.2 1B0.1 1B0",
    ]
    played = {a: (start, end) for _, a, start, end in run_order(s)}
    assert played[F(1, 0, 0)][0] == played[F(0, 0, 1)][0], "stage 1 works on chunk 0 while stage 0 does chunk 1"
    # with micro-batches too: a 2-D grid of (micro-batch, chunk) units
    assert table(make("wavefront", [0, 1], 2, chunks=2)) == [
        "0F0 0F0.1 0F1 0F1.1 0B0.1 0B0 0B1.1 0B1",
        "1F0 1F0.1 1F1 1F1.1 1B0.1 1B0 1B1.1 1B1",
    ]
    assert "0F0.0" in s.grid(), "with time chunks the grid always names the chunk"
    with pytest.raises(ValueError, match="only the 'wavefront' schedule pipelines along time"):
        make("gpipe", [0, 1], 2, chunks=2)


@pytest.mark.parametrize("p,c", [(2, 2), (2, 8), (4, 8)])
def test_wavefront_speedup_over_naive_with_equal_costs(p, c):
    """One batch, no micro-batching: the diagonal overlaps stages; naive keeps one busy."""
    _, naive_span = _bubble(make("naive", list(range(p)), 1))
    _, wave_span = _bubble(make("wavefront", list(range(p)), 1, chunks=c), f=1 / c, b=2 / c)
    assert wave_span == pytest.approx(3 * (c + p - 1) / c)
    assert naive_span / wave_span == pytest.approx(p * c / (c + p - 1))


# ---------------------------------------------------------------- bad names and counts, fuzzed

NAMES = ["naive", "gpipe", "1f1b", "1F1B", "interleaved", "zb1", "zb", "wavefront", "fastest", "", "gpipe "]


whole_or_not = st.one_of(st.integers(-3, 12), st.floats(-2, 9), st.sampled_from([None, "4", True, 2**70]))


@given(st.one_of(st.sampled_from(NAMES), st.text(max_size=8), st.integers()), whole_or_not, whole_or_not)
@FUZZ
def test_schedule_names_and_counts_give_clear_errors(name, m, chunks):
    model = tiny_model()
    batch = make_batch(T=9, B=8)
    try:
        with Pipeline(model, "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2,decode:vgpu0", name, m, chunks) as pipe:
            result = pipe.train_step(batch)
    except (ValueError, TypeError) as e:
        text = str(e)
        assert text and ("schedule" in text or "micro" in text or "chunk" in text or "interleaved" in text), text
    else:
        assert math.isfinite(result.loss)
        m, chunks = (4 if m is None else m), (1 if chunks is None else chunks)     # None: Pipeline's defaults
        assert 8 % m == 0 and chunks <= 9


def test_a_hand_built_schedule_with_no_micro_batches_or_text_rows_is_refused_before_a_step():
    """validate() let micro_batches=0 through (a ZeroDivisionError at the first step) and rows of text
    ("0F0") failed with an AttributeError."""
    with pytest.raises(ScheduleError, match="micro_batches=0; it must be a whole number >= 1"):
        Schedule("mine", (0, 1), 0, [[], []]).validate()
    with pytest.raises(ScheduleError, match="chunks=0"):
        Schedule("mine", (0, 1), 1, [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]], chunks=0).validate()
    with pytest.raises(ScheduleError, match=r"holds '0F0', not an Action: .*Action.parse\('0F1'\)"):
        Schedule("mine", (0, 1), 1, [["0F0", "0B0"], ["1F0", "1B0"]]).validate()


def test_a_schedule_edited_after_the_pipeline_was_built_does_not_reach_its_steps():
    """The Pipeline kept the caller's Schedule: rows edited into a cycle between the devices hung the step."""
    schedule = make("gpipe", [0, 1], 2)
    with Pipeline(tiny_model(), "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1", schedule) as pipe:
        schedule.actions[0][:] = [F(0, 0), B(0, 0), F(0, 1), B(0, 1)]
        schedule.actions[1][:] = [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]    # each device waits for the other
        with pytest.raises(ScheduleError, match="deadlock|waits"):
            schedule.validate()
        result = pipe.train_step(make_batch(T=6, B=4))                    # its own copy: GPipe, as built
        assert [str(e.label) for e in result.timeline.compute("vgpu:0")][:2] == ["0F0", "0F1"]


def test_a_deadlock_marks_the_device_that_waits_for_its_own_later_action():
    """A B before its own F on device 1: the grid marked device 0's row, which only waits for device 1."""
    s = Schedule("mine", (0, 1), 1, [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]])
    with pytest.raises(ScheduleError) as caught:
        s.validate()
    text = str(caught.value)
    assert "device 1 waits at 1B0 for 1F0, which comes later in device 1's own list" in text
    assert [line for line in text.splitlines() if "ERROR HERE" in line][0].strip().startswith("dev 1")


@pytest.mark.parametrize("name,stage_devices,m,chunks", [("gpipe", [0, 1], 4, 1), ("1f1b", [0, 1, 2], 6, 1),
                                                         ("zb1", [0, 1], 4, 1), ("interleaved", [0, 1, 0, 1], 4, 1),
                                                         ("wavefront", [0, 1], 2, 3)])
def test_a_schedule_round_trips_through_its_text_form(name, stage_devices, m, chunks):
    made = make(name, stage_devices, m, chunks)
    again = Schedule.from_text(made.to_text(), stage_devices if name == "interleaved" else None)
    assert again.actions == made.actions and again.split_backward == made.split_backward
    assert (again.micro_batches, again.chunks, again.name) == (m, chunks, "by hand")


def test_text_with_no_actions_is_refused_in_words():
    with pytest.raises(ScheduleError, match="the text holds no actions; write one line of actions"):
        Schedule.from_text("  # only a comment\n\n")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 10, 12])
def test_looped_bfs_is_pytorchs_order_rank_by_rank(p, m):
    """The anchor: torch 2.13's own ScheduleLoopedBFS, two stages per rank dealt round-robin."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    theirs = visualizer.get_schedule_ops("LoopedBFS", p, m, num_stages_per_rank=2)
    ours = make("looped_bfs", [s % p for s in range(2 * p)], m)
    for rank, row in enumerate(theirs):
        assert [str(a) for a in row if a is not None] == [str(a) for a in ours.actions[rank]], f"rank {rank}"


def test_looped_bfs_plays_on_any_placement():
    """(Its exactness against one device, dropout included, is in test_exact.py's SCHEDULES.)"""
    from mpedu.predict import simulate
    for stage_devices in ([0, 1], [0, 1, 0, 1], [0, 0, 1, 1]):
        schedule = make("bfs", stage_devices, 4)
        assert schedule.name == "looped_bfs"
        played = simulate(schedule, [1.0] * len(stage_devices))       # no deadlock on any of them
        assert len(played.compute(played.devices[0])) == 2 * 4 * stage_devices.count(0)
