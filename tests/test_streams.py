"""Streams around a step: pinned micro-batch blocks, and a GPU worker's stream ordered after the caller's."""
import pytest
import torch

from conftest import make_batch
from mpedu.runtime import MicroBatches, streams

pytestmark = pytest.mark.cuda      # the pinned case runs where CUDA exists (see conftest)
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("pin", [pytest.param(False, id="cpu-twin"), pytest.param(True, id="pinned", marks=NO_GPU)])
def test_micro_batches_a_gpu_reads_are_pinned_once_per_step(pin):
    batch = make_batch(T=9, B=8)
    micro = MicroBatches(batch, 4, [(0, 4), (4, 9)], pin_inputs=pin, pin_targets=False)
    for i, mb in enumerate(batch.split(4)):
        chunks = [(micro.inputs(i, c), micro.targets(i, c)) for c in range(2)]
        assert torch.equal(torch.cat([x for x, _ in chunks]), mb.inputs)
        assert torch.equal(torch.cat([y for _, y in chunks]), mb.targets)
        # every slice is a view of one block per tensor (one pinned copy per step, not one per chunk)
        assert chunks[0][0].untyped_storage().data_ptr() == micro.inputs(0).untyped_storage().data_ptr()
        assert all(x.is_contiguous() for x, _ in chunks)     # a non-contiguous copy would be staged
        # cut once per step: asking again makes no torch call (each lets go of the interpreter lock)
        assert all(micro.inputs(i, c) is x and micro.targets(i, c) is y for c, (x, y) in enumerate(chunks))
        if torch.cuda.is_available():
            assert chunks[0][0].is_pinned() == pin and not chunks[0][1].is_pinned()


def test_a_gpu_job_first_waits_for_the_callers_stream(monkeypatch):
    """The ordering itself, with stand-in streams (no GPU needed): the worker's stream waits for the
    caller's before the job's first op; a virtual device's job is left as it is."""
    order = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            order.append(f"{self.name} waits for {other.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("worker"))
    job = lambda: order.append("job") or 7        # noqa: E731
    assert streams.after(None, job) is job
    assert streams.after(Stream("caller"), job)() == 7
    assert order == ["worker waits for caller", "job"]
