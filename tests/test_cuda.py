"""The CUDA path (streams, events, copies between a GPU and the CPU or another GPU).

The GPU placements run only where CUDA is present. Each test also runs a CPU twin, the same
stages on virtual devices, so the checks themselves are exercised on every machine. The
reference is the whole model on the CPU, in fp32.
"""
import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.pipeline import Pipeline

NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
PLACEMENTS = [
    # the CPU twin: three stages, one device each, as below
    pytest.param("embed:vgpu:0 | lstm0:vgpu:1 | lstm1-2,decode:vgpu:2", id="cpu-twin"),
    # activations GPU -> CPU (the host waits for the copy), gradients CPU -> GPU
    pytest.param("embed:cuda:0 | lstm0:vgpu:0 | lstm1-2,decode:vgpu:1", id="gpu-then-cpu", marks=NO_GPU),
    # activations CPU -> GPU (the GPU's stream waits), gradients GPU -> CPU, the loss on the GPU
    pytest.param("embed:vgpu:0 | lstm0:vgpu:1 | lstm1-2,decode:cuda:0", id="cpu-then-gpu", marks=NO_GPU),
    pytest.param("embed,lstm0:cuda:0 | lstm1-2,decode:cuda:1", id="two-gpus", marks=NO_TWO_GPUS),
]


@pytest.fixture(autouse=True)
def exact_fp32():
    """cuDNN may use TF32 for the LSTM's matrix products; the comparison needs plain fp32."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("schedule,m", [("gpipe", 4), ("1f1b", 4), ("zb1", 2)])
def test_the_pipeline_gives_the_cpu_models_loss_and_gradients(placement, schedule, m):
    batch = make_batch()
    ref_loss, ref_grads = reference(tiny_model(dropout=0.0), batch)
    model = tiny_model(dropout=0.0)
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        for _ in range(2):     # the second step reuses the workers' streams and the cached plan
            model.zero_grad()
            result = pipe.train_step(batch)
            assert result.loss == pytest.approx(ref_loss, rel=1e-5)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad.cpu(), ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        timeline = result.timeline
    compute = timeline.compute()
    assert len(compute) == sum(len(row) for row in pipe.schedule.actions)
    assert all(e.end >= e.start >= 0 for e in timeline.events)
    # The times (CUDA events on a GPU) respect causality: a stage's forward starts after its input was
    # sent. A stage sends a micro-batch's activation (in F) before its gradient (in B): keep the first.
    # CUDA event times reach the CPU's clock through one reference event per device: allow a millisecond.
    slack = 1e-3 if "cuda" in placement else 1e-4
    sent = {}
    for e in timeline.transfers():
        sent.setdefault((e.stage, e.mb), e.end)
    for e in compute:
        if e.kind == "F" and e.stage > 0:
            assert e.start >= sent[e.stage - 1, e.mb] - slack, e.label
    assert timeline.bytes_moved > 0


@pytest.mark.parametrize("placement", PLACEMENTS[:3])
def test_eval_matches_the_cpu_model(placement):
    batch = make_batch()
    ref_loss, _ = reference(tiny_model(dropout=0.0), batch)
    with Pipeline(tiny_model(dropout=0.0), placement, "gpipe", micro_batches=2) as pipe:
        assert pipe.eval_step(batch).loss == pytest.approx(ref_loss, rel=1e-5)
