"""mpedu.distributed.native: mpedu's schedule names map to PyTorch's own schedule classes (--runtime torch)."""
import pytest

from mpedu.distributed import plan_schedule


@pytest.mark.parametrize("schedule,ranks,expected,per_call", [
    ("gpipe", [0, 1], "ScheduleGPipe", 4),
    ("naive", [0, 1], "ScheduleGPipe", 1),            # one micro-batch per step() call, m calls
    ("1f1b", [0, 1], "Schedule1F1B", 4),
    ("1F1B", [0, 1, 2], "Schedule1F1B", 4),
    ("zb1", [0, 1], "ScheduleInterleavedZeroBubble", 4),
    ("zero-bubble", [0, 1], "ScheduleInterleavedZeroBubble", 4),
    ("gpipe", [0, 1, 0, 1], "ScheduleLoopedBFS", 4),
    ("1f1b", [0, 1, 0, 1], "ScheduleInterleaved1F1B", 4),
    ("interleaved", [0, 1, 0, 1], "ScheduleInterleaved1F1B", 4),
    ("zb1", [0, 1, 0, 1], "ScheduleInterleavedZeroBubble", 4),
])
def test_mpedu_schedules_map_to_torch_classes(schedule, ranks, expected, per_call):
    plan = plan_schedule(schedule, ranks, 4)
    assert plan.cls.__name__ == expected
    assert plan.per_call == per_call


@pytest.mark.parametrize("schedule,ranks,words", [
    ("interleaved", [0, 1], "v >= 2 stages"),
    ("gpipe", [0, 1, 0], "round-robin"),                  # 3 stages on 2 ranks: not looped
    ("zb1", [0, 1, 1, 0], "ZBV"),                         # a V: torch's ZBV cannot eval in this version
    ("wavefront", [0, 1], "unknown schedule"),            # PyTorch has no class for it (mpedu's runtime refuses chunks)
    ("sideways", [0, 1], "unknown schedule"),
])
def test_unsupported_combinations_say_why(schedule, ranks, words):
    with pytest.raises(ValueError, match=words):
        plan_schedule(schedule, ranks, 4)
