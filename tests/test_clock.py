"""The clock both engines time a step with: CPU marks here (a GPU's CUDA events run under bench/gpu_check.sh)."""
import time

import pytest
import torch

from mpedu.runtime import Clock, get_device


@pytest.mark.parametrize("device", [get_device("vgpu:0"), torch.device("cpu"), "cpu"])
def test_cpu_marks_are_seconds_since_t0_in_order(device):
    t0 = time.perf_counter()
    clock = Clock(device, t0)
    assert not clock.cuda
    first = clock.mark()
    time.sleep(0.002)                       # a sleep never returns early: the marks are at least this far apart
    second = clock.mark()
    assert 0 <= clock.seconds(first) < clock.seconds(second)
    assert clock.seconds(second) - clock.seconds(first) >= 0.002


def test_a_torch_device_of_a_gpu_is_timed_with_cuda_events(monkeypatch):
    # no GPU needed to see the choice: a CUDA torch.device selects the event path before any event is made
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw) or _FakeEvent())
    clock = Clock(torch.device("cuda", 0), t0=0.0)
    assert clock.cuda and made == [{"enable_timing": True}]
    assert clock.seconds(clock.mark()) == pytest.approx(clock.ref_cpu + 0.25e-3)


class _FakeEvent:
    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):           # milliseconds, as CUDA reports them
        return 0.25
