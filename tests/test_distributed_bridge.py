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
