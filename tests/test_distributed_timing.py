"""mpedu.distributed.timing: each rank's marks, on one time axis, in one Timeline."""
import pytest
import torch

from mpedu.distributed import Recorder, merge
from mpedu.core import ALL_REDUCE


def test_ranks_events_merge_into_one_timeline_starting_at_zero():
    rank0 = [("F", 0, 0, 10.0, 10.5, 0, ""), ("send", 0, 0, 10.5, 10.5, 64, "rank:1"), ("B", 0, 0, 11.5, 12.0, 0, "")]
    rank1 = [("F", 1, 0, 10.6, 11.0, 0, ""), ("B", 1, 0, 11.0, 11.4, 0, ""), (ALL_REDUCE, 1, 0, 11.4, 11.6, 8, "")]
    timeline = merge([rank0, rank1], ["rank:0", "rank:1"])
    assert min(e.start for e in timeline.events) == 0.0
    assert [e.label for e in timeline.compute("rank:1")] == ["1F0", "1B0"]
    assert timeline.makespan == pytest.approx(2.0)
    assert [e.device for e in timeline.collectives()] == ["rank:1"]
    assert timeline.busy("rank:1") == pytest.approx(0.8)           # the all-reduce is communication, not compute


def test_a_recorder_marks_in_seconds_since_its_base_and_records_nothing_when_off():
    import time
    recorder = Recorder(torch.device("cpu"), time.perf_counter())
    recorder.start_step()
    a = recorder.now()
    recorder.add("F", 0, 1, a, recorder.now())
    recorder.extend_forward(recorder.now())
    [(kind, stage, mb, start, end, _, _)] = recorder.events()
    assert (kind, stage, mb) == ("F", 0, 1) and 0 <= start <= end < 60
    recorder.enabled = False
    recorder.start_step()
    recorder.add("B", 0, 1, recorder.now(), recorder.now())
    assert recorder.events() == []
