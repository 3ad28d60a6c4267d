"""mpedu.distributed.pipeline: DistributedPipeline in a one-rank process group, in this process (the multi-rank
cases run under torchrun in test_distributed.py)."""
import pytest
import torch
import torch.distributed as dist

from conftest import make_batch, tiny_model
from mpedu.distributed import DistributedPipeline
from mpedu.core import SingleDevice, make


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_trains_and_evaluates_as_the_single_device_runner(one_rank):
    torch.manual_seed(0)
    model = tiny_model(dropout=0.2)
    reference = tiny_model(dropout=0.2)
    reference.load_state_dict(model.state_dict())
    batch = make_batch(T=6, B=8)
    schedule = make("gpipe", [0], 4)                       # a Schedule object, not a name
    pipe = DistributedPipeline(model, None, schedule, 4, width=8)
    one = SingleDevice(reference)
    for runner in (pipe, one):
        runner.dropout_seed = 3
    got, want = pipe.train_step(batch), one.train_step(batch)
    assert got.loss == pytest.approx(want.loss, rel=1e-6) and got.tokens == want.tokens
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert {e.kind for e in got.timeline.events} == {"F", "B"}
    assert [e.mb for e in got.timeline.compute() if e.kind == "F"] == [0, 1, 2, 3]
    assert pipe.eval_step(batch).loss == pytest.approx(one.eval_step(batch).loss, rel=1e-6)
    assert pipe.shapes == [(6, 8, True), (6, 8, False)]
    with pytest.raises(ValueError, match="multiple of 1 replica"):
        DistributedPipeline(model, None, "gpipe", 4, width=6)
    with pytest.raises(ValueError, match="--pipeline-devices 2 must divide"):
        DistributedPipeline(model, None, "gpipe", 4, pipeline_devices=2)


def test_one_rank_is_its_own_clock_origin_on_either_path(one_rank):
    import time
    from mpedu.distributed import shared_origin
    for same_host in (None, True, False):        # None asks the ranks; False estimates an offset (0 for rank 0)
        before = time.perf_counter()
        origin = shared_origin(same_host=same_host)
        assert before <= origin <= time.perf_counter()



def test_a_layer_thawed_after_the_pipeline_was_built_is_clipped_with_the_others(one_rank):
    # the rank's list of training weights was fixed when the pipeline was built: a thawed layer then went
    # unclipped (and, under data parallelism, un-reduced)
    model = tiny_model()
    model.layers["lstm0"].requires_grad_(False)
    pipe = DistributedPipeline(model, None, "gpipe", 2, width=8)
    assert all(p.requires_grad for p in pipe.params)
    model.layers["lstm0"].requires_grad_(True)
    pipe.train_step(make_batch(T=6, B=8))
    before = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    pipe.clip_grad_norm(1e-3)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert before > 1e-3 and after == pytest.approx(1e-3, rel=1e-3)


def test_train_says_when_the_runner_clips_too(one_rank, little):
    # DistributedPipeline(clip=1.0) clips inside its step; train's own default clip (0.25) then clipped again
    from conftest import lm
    from mpedu.training import train
    model, lines = lm(little), []
    pipe = DistributedPipeline(model, None, "gpipe", 2, width=8, clip=1.0)
    for clip in (0.25, None):
        train(model, little, runner=pipe, epochs=1, batch_size=8, limit_batches=1, clip=clip, progress=False,
              log=lines.append)
        said = any("the runner clips each step's gradients at 1 itself, and train's clip=0.25" in line
                   for line in lines)
        assert said == (clip is not None), lines
        lines.clear()


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_the_v_on_one_rank_trains_and_evaluates_a_tied_model_as_the_single_device_runner(one_rank, name):
    # p = 1: the V is stages 0 and 1 on rank 0, which hand their tensors over in memory (torch's V special
    # case); eval() then failed there ("can't steal_bwd_input if this stage doesn't have backward")
    model = tiny_model(num_layers=1, embed_size=64, tie_weights=True, dropout=0.2)
    reference = tiny_model(num_layers=1, embed_size=64, tie_weights=True, dropout=0.2)
    reference.load_state_dict(model.state_dict())
    batch = make_batch(T=6, B=8)
    pipe = DistributedPipeline(model, None, name, 4, width=8)              # no placement: the V
    assert pipe.placement.stage_devices == [0, 0] and pipe.schedule == name
    one = SingleDevice(reference)
    for runner in (pipe, one):
        runner.dropout_seed = 3
    got, want = pipe.train_step(batch), one.train_step(batch)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    for (n, a), b in zip(model.named_parameters(), reference.parameters()):   # the tied weight: both stages' share
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert {(e.stage, e.kind) for e in got.timeline.compute()} == {(s, k) for s in (0, 1) for k in "FBW"}
    assert pipe.eval_step(batch).loss == pytest.approx(one.eval_step(batch).loss, rel=1e-6)
