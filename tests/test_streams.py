"""Streams around a step: pinned micro-batch blocks, and a GPU worker's stream ordered after the caller's."""
import dataclasses

import pytest
import torch

from conftest import make_batch
from mpedu.runtime import MicroBatches, streams

pytestmark = pytest.mark.cuda      # the pinned case runs where CUDA exists (see conftest)
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("pin", [pytest.param(False, id="cpu-twin"), pytest.param(True, id="pinned", marks=NO_GPU)])
def test_micro_batches_a_gpu_reads_are_pinned_once_per_step(pin):
    batch = make_batch(T=9, B=8)
    micro = MicroBatches(9, 8, 4, [(0, 4), (4, 9)], pin_inputs=pin, pin_targets=False).load(batch)
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


@pytest.mark.parametrize("sizes", [None, (1, 3, 2, 2)], ids=["equal", "unequal"])
def test_each_steps_batch_is_copied_into_the_blocks_its_shape_made_once(sizes):
    """The blocks and their views are made at a shape's first step; a later step's batch is copied into them at
    its first read, not before. Token ids of another dtype get blocks of their own."""
    chunks = [(0, 4), (4, 9)]
    micro = MicroBatches(9, 8, 4, chunks, pin_inputs=False, pin_targets=False, sizes=sizes)
    first, second = make_batch(seed=0), make_batch(seed=1)
    assert not torch.equal(first.inputs[4:9, 6:8], second.inputs[4:9, 6:8])
    kept = None
    for batch in (first, second):
        micro.load(batch)
        for i, mb in enumerate(batch.split(list(sizes or (2,) * 4))):
            for c, (lo, hi) in enumerate(chunks):
                assert torch.equal(micro.inputs(i, c), mb.inputs[lo:hi])
                assert torch.equal(micro.targets(i, c), mb.targets[lo:hi])
        kept = kept if kept is not None else micro.inputs(3, 1)
        assert micro.inputs(3, 1) is kept                # one view for every step, holding the step's batch
    micro.load(dataclasses.replace(first, inputs=first.inputs.int()))
    assert torch.equal(kept, second.inputs[4:9, 6:8])    # loading copies nothing: a worker copies at its first read
    ids = micro.inputs(3, 1)
    assert ids.dtype == torch.int32 and torch.equal(ids, first.inputs[4:9, 6:8].int())


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
