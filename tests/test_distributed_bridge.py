"""mpedu.distributed.bridge: mpedu's action lists become torch's runtime actions, one for one; what cannot run
there is refused with the reason."""
import pytest

from mpedu.distributed import ScheduleRefused, read_schedule, resolve, schedule_arg, torch_order
from mpedu.core import Schedule, ScheduleError, make, wavefront

HAND = """
# a learner's own order: stage 1 answers each forward at once
0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""


@pytest.mark.parametrize("name,stages", [("gpipe", [0, 1]), ("1f1b", [0, 1, 2]), ("zb1", [0, 1]),
                                         ("interleaved", [0, 1, 0, 1]), ("naive", [0, 1, 0])])
def test_every_action_keeps_its_device_and_place(name, stages):
    schedule = make(name, stages, 4)
    order = torch_order(schedule)
    assert sorted(order) == list(range(schedule.num_devices))
    for d, row in enumerate(schedule.actions):
        # torch writes an action as <stage><kind><micro-batch>; a split backward's B is torch's I (input only)
        expected = [str(a).replace("B", "I") if a.stage in schedule.split_backward else str(a) for a in row]
        assert [repr(a) for a in order[d]] == expected


def test_a_hand_written_schedule_is_read_validated_and_translated():
    schedule = read_schedule(HAND, [0, 1], 4, name="mine")
    assert schedule.name == "mine" and schedule.split_backward == frozenset()
    assert [repr(a) for a in torch_order(schedule)[0]][:4] == ["0F0", "0F1", "0F2", "0B0"]
    with_w = read_schedule("0F0 0B0 0W0\n1F0 1B0 1W0", [0, 1], 1)
    assert with_w.split_backward == {0, 1}
    assert [repr(a) for a in torch_order(with_w)[1]] == ["1F0", "1I0", "1W0"]


@pytest.mark.parametrize("text,words", [
    ("0F0 0B0 0F1 0B1\n1B0 1F0 1F1 1B1", "deadlock"),       # 1B0 before its own forward
    ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1", "0B1 is missing"),
    ("0F0 0F1 0B0 0B1", "2 devices"),
    ("0F0 0Q1", "cannot read action"),
])
def test_a_hand_written_schedule_that_cannot_run_is_refused_before_any_process_waits(text, words):
    with pytest.raises(ValueError, match=words):
        read_schedule(text, [0, 1], 2)


def test_time_chunks_are_refused_with_the_reason():
    schedule = wavefront([0, 1], 2, chunks=2).validate()
    with pytest.raises(ScheduleRefused, match=r"time chunks.*state \(h, c\).*between ranks"):
        torch_order(schedule)
    assert torch_order(wavefront([0, 1], 2, chunks=1))   # one chunk: an ordinary schedule


def test_resolve_checks_a_schedule_against_the_placement():
    assert resolve("zero-bubble", [0, 1], 2).name == "zb1"          # mpedu's aliases
    with pytest.raises(ValueError, match="ranks"):
        resolve(make("gpipe", [0, 1, 0], 2), [0, 1], 2)
    with pytest.raises(ValueError, match="micro_batches=2"):
        resolve(make("gpipe", [0, 1], 2), [0, 1], 4)
    bad = Schedule("broken", (0, 1), 1, [[make("gpipe", [0, 1], 1).actions[0][0]], []])
    with pytest.raises(ScheduleError):
        resolve(bad, [0, 1], 1)


@pytest.mark.parametrize("name", ["wavefront", "Wavefront"])
def test_the_wavefront_is_refused_under_torchrun_with_what_to_run_instead(name):
    with pytest.raises(ValueError, match="use gpipe, or run the wavefront on mpedu's threads"):
        schedule_arg(name, [0, 1], 4)
    assert schedule_arg("gpipe", [0, 1], 4) == "gpipe"


# the V on 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1), 4 micro-batches: PyTorch's own
# ScheduleZBVZeroBubble order, action for action; every backward split (I, then W)
ZBV_2X4 = {
    0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
    1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
}
# dualpipev: each overlapped pair is one OVERLAP_F_B holding its forward and backward (torch's container)
DUALPIPEV_2X4 = {
    0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3I1)OVERLAP_F_B 3W1 (3F2;0I0)OVERLAP_F_B 0W0 3I2 3W2 "
       "(3F3;0I1)OVERLAP_F_B 0W1 3I3 3W3 0I2 0W2 0I3 0W3",
    1: "1F0 2F0 1F1 2F1 1F2 2I0 2W0 (2F2;1I0)OVERLAP_F_B 1W0 (1F3;2I1)OVERLAP_F_B 2W1 (2F3;1I1)OVERLAP_F_B "
       "1W1 2I2 2W2 1I2 1W2 2I3 1I3 2W3 1W3",
}


@pytest.mark.parametrize("name,table", [("zbv", ZBV_2X4), ("dualpipev", DUALPIPEV_2X4)])
def test_the_v_schedules_become_torch_orders_rank_by_rank(name, table):
    order = torch_order(resolve(name, [0, 1, 1, 0], 4))
    assert {rank: " ".join(map(repr, row)) for rank, row in order.items()} == table
    # torch's runtime reads its stage -> rank map off these lists: its "v" style, stages r and 2p-1-r on rank r
    from torch.distributed.pipelining.schedules import _validate_schedule
    assert _validate_schedule(order, 2, 4, 4) == {0: 0, 3: 0, 1: 1, 2: 1}


def test_an_overlapped_pair_keeps_its_two_actions_in_order():
    from torch.distributed.pipelining.schedules import _ComputationType
    schedule = resolve("dualpipev", [0, 1, 1, 0], 4)
    order = torch_order(schedule)
    for d, row in enumerate(schedule.actions):
        flat = [sub for a in order[d] for sub in (a.sub_actions or (a,))]
        assert [repr(a) for a in flat] == [str(a).replace("B", "I") for a in row]      # nothing lost or moved
        pairs = [a for a in order[d] if a.computation_type == _ComputationType.OVERLAP_F_B]
        assert len(pairs) == sum(1 for dev, _ in schedule.overlapped if dev == d) == 3


@pytest.mark.parametrize("name,words", [
    ("zbv", "PyTorch's own ScheduleZBVZeroBubble, whose eval\\(\\) fails.*leave --runtime at mpedu"),
    ("dualpipev", "ScheduleDualPipeV.*mpedu's dualpipev is its order action for action"),
])
def test_torchs_own_v_classes_are_refused_naming_the_schedule_and_the_way_that_runs(name, words):
    from mpedu.distributed import plan_schedule
    with pytest.raises(ValueError, match=f"--runtime torch --schedule {name}: .*{words}"):
        plan_schedule(name, [0, 1, 1, 0], 4)
    assert torch_order(resolve(name, [0, 1, 1, 0], 4))               # mpedu's own lists run it


@pytest.mark.parametrize("name,stages,m,words", [
    ("zbv", [0, 1], 4, r"zbv needs the V placement.*stage devices \[0, 1, 1, 0\]"),
    ("dualpipev", [0, 1, 1, 0], 2, "m >= 2p = 4 for 2 devices, got m=2"),
])
def test_a_v_schedule_the_placement_or_the_micro_batches_cannot_take_is_refused_before_any_rank_waits(
        name, stages, m, words):
    with pytest.raises(ValueError, match=words):
        resolve(name, stages, m)
