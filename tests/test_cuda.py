"""The CUDA path (streams, events, copies between a GPU and the CPU or another GPU).

The GPU placements run only where CUDA is present. Each test also runs a CPU twin, the same
stages on virtual devices, so the checks themselves are exercised on every machine. The
reference is the whole model on the CPU, in fp32.
"""
import time

import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.lm import Position, keep_mask, nll_sum
from mpedu.core import Pipeline, SingleDevice

pytestmark = pytest.mark.cuda      # GPU placements run here where CUDA exists (see conftest)
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


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dropout_on_a_gpu_draws_the_cpu_masks(placement):
    """Positional dropout masks are int64 arithmetic, the same on any device: a pipeline with GPU stages
    gives the CPU model's loss and gradients with dropout on."""
    batch = make_batch()
    ref_model = tiny_model(dropout=0.5)
    ref = SingleDevice(ref_model)
    ref.dropout_seed = 3
    ref_loss = ref.train_step(batch).loss
    model = tiny_model(dropout=0.5)
    with Pipeline(model, placement, "1f1b", micro_batches=4) as pipe:
        pipe.dropout_seed = 3
        assert pipe.train_step(batch).loss == pytest.approx(ref_loss, rel=1e-5)
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
    _, plain = reference(tiny_model(dropout=0.0), batch)                            # the masks matter
    assert max((plain[name] - p.grad).abs().max().item() for name, p in ref_model.named_parameters()) > 1e-3


@NO_GPU
def test_a_dropout_mask_on_the_gpu_is_the_cpus():
    where = Position(seed=7, step=11, sequence=5, time=3)
    on_gpu = keep_mask(0.3, 2, (9, 4, 33), where, device="cuda:0")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), keep_mask(0.3, 2, (9, 4, 33), where))


@pytest.mark.parametrize("placement", PLACEMENTS[:3])
def test_eval_matches_the_cpu_model(placement):
    batch = make_batch()
    ref_loss, _ = reference(tiny_model(dropout=0.0), batch)
    with Pipeline(tiny_model(dropout=0.0), placement, "gpipe", micro_batches=2) as pipe:
        assert pipe.eval_step(batch).loss == pytest.approx(ref_loss, rel=1e-5)


SGD_PLACEMENTS = [
    pytest.param("embed,lstm0:vgpu:0 | lstm1-2,decode:vgpu:1", id="cpu-twin"),
    # the step's last stage and the optimizer's gradients on the CPU, the first stages' on the GPU
    pytest.param("embed,lstm0,lstm1:cuda:0 | lstm2,decode:vgpu:0", id="gpu-then-cpu", marks=NO_GPU),
    pytest.param("embed,lstm0:cuda:0 | lstm1-2,decode:cuda:1", id="two-gpus", marks=NO_TWO_GPUS),
]
SLEEP_CYCLES = 100_000_000     # ~50-100 ms of a GPU's time: much longer than a tiny step


def _sends(timeline, last: int) -> tuple[dict, dict]:
    """{(stage, mb): end} of the activations and of the gradients each stage sent. A stage sends
    a micro-batch's activation (in F) before its gradient (in B); the first stage sends no
    gradient and the last no activation."""
    acts, grads = {}, {}
    for e in sorted(timeline.transfers(), key=lambda e: e.start):
        to_grads = e.stage == last or (e.stage > 0 and (e.stage, e.mb) in acts)
        (grads if to_grads else acts)[e.stage, e.mb] = e.end
    return acts, grads


@pytest.mark.parametrize("placement", SGD_PLACEMENTS)
def test_optimizer_steps_between_pipeline_steps_are_ordered_with_the_workers(placement):
    """Three clipped SGD steps give the CPU model's losses and weights.

    On a GPU the optimizer runs on the caller's (default) stream and each worker on a stream of its
    own, which does not wait for the default stream by itself. A sleep queued on the default stream
    before each optimizer step holds the update back: a worker that did not wait for it would run
    the next forward on the old weights (a different loss) and reuse gradient memory still being
    read. The same sleep would shift the GPU's event times by the queued work if the clock's
    reference were not synchronised: gradients would seem to arrive before they were sent.
    """
    batch = make_batch()
    ref, model = tiny_model(dropout=0.0), tiny_model(dropout=0.0)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=2.0), torch.optim.SGD(model.parameters(), lr=2.0)
    ref_losses, losses = [], []
    with Pipeline(model, placement, "1f1b", micro_batches=4) as pipe:
        gpus = [d.torch_device for d in pipe.devices if d.is_cuda]
        for _ in range(3):
            ref_opt.zero_grad(set_to_none=True)
            loss = nll_sum(ref(batch.inputs)[0], batch.targets) / batch.tokens
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_losses.append(loss.item())

            opt.zero_grad(set_to_none=True)
            started = time.perf_counter()
            result = pipe.train_step(batch)
            wall = time.perf_counter() - started
            losses.append(result.loss)
            # the sleep after the clip (which, with a CPU stage, waits for the GPU's stream), before the step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            for gpu in gpus:
                with torch.cuda.device(gpu):
                    torch.cuda._sleep(SLEEP_CYCLES)
            opt.step()

            events = result.timeline.events
            slack = 1e-3 if gpus else 1e-4
            assert all(-slack <= e.start <= e.end <= wall + slack for e in events)
            last = len(pipe.stages) - 1
            acts, grads = _sends(result.timeline, last)
            for e in result.timeline.compute():
                if e.kind == "F" and e.stage > 0:
                    assert e.start >= acts[e.stage - 1, e.mb] - slack, e.label
                if e.kind == "B" and e.stage < last:
                    assert e.start >= grads[e.stage + 1, e.mb] - slack, e.label
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert len(set(losses)) == 3                        # the steps changed the weights
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-6, msg=name)


