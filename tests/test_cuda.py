"""The CUDA path (streams, events, copies between a GPU and the CPU or another GPU).

These run only where CUDA is present: on a CPU-only machine every other test covers the
same engine with virtual devices. The reference is the whole model on the CPU, in fp32.
"""
import pytest
import torch

from conftest import make_batch, tiny_model
from mpedu.model import nll_sum
from mpedu.pipeline import Pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# GPU -> CPU -> GPU: both copy directions, the host waiting for a device copy, and back.
MIXED = "embed:cuda:0 | lstm0:vgpu:0 | lstm1-2,decode:cuda:0"
TWO_GPUS = "embed,lstm0:cuda:0 | lstm1-2,decode:cuda:1"


@pytest.fixture(autouse=True)
def exact_fp32():
    """cuDNN may use TF32 for the LSTM's matrix products; the comparison needs plain fp32."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def cpu_reference(batch):
    model = tiny_model(dropout=0.0)
    logits, _ = model(batch.inputs)
    loss = nll_sum(logits, batch.targets) / batch.tokens
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def placements():
    yield MIXED
    if torch.cuda.device_count() >= 2:
        yield TWO_GPUS


@pytest.mark.parametrize("placement", list(placements()) if torch.cuda.is_available() else [MIXED])
@pytest.mark.parametrize("schedule,m", [("gpipe", 4), ("1f1b", 4), ("zb1", 2)])
def test_gpu_pipeline_gives_the_cpu_models_loss_and_gradients(placement, schedule, m):
    batch = make_batch()
    ref_loss, ref_grads = cpu_reference(batch)
    model = tiny_model(dropout=0.0)
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        for _ in range(2):     # the second step reuses the cached streams, events and plan
            model.zero_grad()
            result = pipe.train_step(batch)
            assert result.loss == pytest.approx(ref_loss, rel=1e-5)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad.cpu(), ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        timeline = result.timeline
    compute = timeline.compute()
    assert len(compute) == sum(len(row) for row in pipe.schedule.actions)
    assert all(e.end >= e.start >= 0 for e in timeline.events)
    # times from CUDA events line up with causality: a stage's forward starts after its input was sent
    sent = {(e.stage, e.mb): e.end for e in timeline.transfers()}
    for e in compute:
        if e.kind == "F" and e.stage > 0:
            assert e.start >= sent[e.stage - 1, e.mb] - 1e-4
    assert timeline.bytes_moved > 0


def test_eval_on_gpu_matches_the_cpu_model():
    batch = make_batch()
    ref_loss, _ = cpu_reference(batch)
    with Pipeline(tiny_model(dropout=0.0), MIXED, "gpipe", micro_batches=2) as pipe:
        assert pipe.eval_step(batch).loss == pytest.approx(ref_loss, rel=1e-5)
