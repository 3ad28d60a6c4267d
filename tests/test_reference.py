"""The reference pipeline (mpedu.core.reference): the lesson's text, and an oracle. It gives one device's loss and
gradients, and mpedu.Pipeline's, on every schedule it plays; a schedule that deadlocks or a device that fails
stops it without a hang or a thread left behind."""
import threading
from pathlib import Path

import pytest
import torch

from conftest import make_batch, tiny_model
from mpedu.core import B, F, Pipeline, ReferencePipeline, Schedule, ScheduleError, SingleDevice

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread

TWO = "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1"
TWO_LOOPED = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"           # 2 stages per device
THREE = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2,decode:vgpu2"
THREE_LOOPED = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu2 | lstm2:vgpu0 | lstm3:vgpu1 | decode:vgpu2"
# schedule, placement, LSTM layers, micro-batches: every schedule the reference plays, on 2 and 3 devices
CASES = [("naive", TWO, 3, 2), ("gpipe", TWO, 3, 4), ("1f1b", TWO, 3, 4), ("interleaved", TWO_LOOPED, 3, 4),
         ("zb1", TWO, 3, 4), ("naive", THREE, 3, 1), ("gpipe", THREE, 3, 4), ("1f1b", THREE, 3, 4),
         ("interleaved", THREE_LOOPED, 4, 3), ("zb1", THREE, 3, 4)]


def step(runner, model, batch):
    model.zero_grad(set_to_none=True)
    loss = runner.train_step(batch).loss
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, expected):
    (loss, grads), (ref_loss, ref) = got, expected
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(grads) == set(ref)
    for name in ref:
        assert torch.allclose(grads[name], ref[name], rtol=1e-5, atol=1e-7), name


def device_threads():
    return [t for t in threading.enumerate() if t.name.startswith("device ")]


@pytest.mark.parametrize("schedule, placement, layers, m", CASES,
                         ids=[f"{c[0]}-{c[1].count('|') + 1}stages" for c in CASES])
def test_the_reference_gives_one_devices_and_the_engines_loss_and_gradients(schedule, placement, layers, m):
    model, batch = tiny_model(num_layers=layers), make_batch(T=7, B=12, seed=layers + m)
    single = step(SingleDevice(model), model, batch)
    got = step(ReferencePipeline(model, placement, schedule, micro_batches=m), model, batch)
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        engine = step(pipe, model, batch)
    assert_close(got, single)
    assert_close(got, engine)
    assert got[1]["layers.embed.embedding.weight"].abs().sum() > 0     # the gradient reached stage 0
    assert not device_threads()


def test_a_frozen_first_stage_gets_no_gradient_and_the_rest_train_like_one_device():
    model, batch = tiny_model(), make_batch(T=6, B=8, seed=3)
    for p in model.layers["embed"].parameters():
        p.requires_grad_(False)
    single = step(SingleDevice(model), model, batch)
    got = step(ReferencePipeline(model, "embed:vgpu0 | lstm0-2,decode:vgpu1", "1f1b", micro_batches=4), model, batch)
    assert_close(got, single)
    assert "layers.embed.embedding.weight" not in got[1]


def test_a_deadlocking_hand_written_schedule_is_refused_before_any_thread_starts():
    model = tiny_model()
    # device 0 runs 0B0 first, but 0B0 needs 1B0, which needs 1F0, which needs 0F0: later in device 0's row
    rows = [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]]
    before = threading.active_count()
    with pytest.raises(ScheduleError, match="deadlock") as refused:
        ReferencePipeline(model, TWO, Schedule("mine", (0, 1), 1, rows))
    assert "device 0 waits at 0B0 for 0F0, 1B0, which comes later in device 0's own list" in str(refused.value)
    assert threading.active_count() == before


def test_a_schedule_built_for_another_placement_is_refused_in_words():
    model = tiny_model()
    three = Schedule("gpipe3", (0, 1, 2), 1, [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)], [F(2, 0), B(2, 0)]])
    with pytest.raises(ValueError, match=r"schedule puts stages on devices \[0, 1, 2\], the placement on \[0, 1\]"):
        ReferencePipeline(model, TWO, three)


def test_a_device_that_fails_stops_every_device_and_its_error_reaches_the_caller(monkeypatch):
    model, batch = tiny_model(), make_batch()
    pipe = ReferencePipeline(model, TWO, "gpipe", micro_batches=4)

    def broken(x, state=None):
        raise RuntimeError("decode broke")
    monkeypatch.setattr(model.layers["decode"], "forward", broken)
    with pytest.raises(RuntimeError, match="decode broke"):
        pipe.train_step(batch)      # device 0 was waiting for gradients that never come: it stops too
    assert not device_threads()


def test_a_hand_off_that_never_comes_names_the_waiting_device_and_what_it_waited_for(monkeypatch):
    model, batch = tiny_model(), make_batch()
    monkeypatch.setattr("mpedu.core.reference.TIMEOUT_S", 0.2)
    pipe = ReferencePipeline(model, TWO, "gpipe", micro_batches=2)
    # stage 1 skips its backward, so no gradient comes back: only device 0 is left waiting
    monkeypatch.setattr(pipe, "B", lambda s, i: None if s == 1 else ReferencePipeline.B(pipe, s, i))
    with pytest.raises(TimeoutError, match="device 0 waited 0.2 s for stage 1's input gradient for micro-batch 0"):
        pipe.train_step(batch)
    assert not device_threads()


def test_the_reference_reads_in_one_sitting():
    import mpedu.core.reference
    lines = Path(mpedu.core.reference.__file__).read_text().splitlines()
    assert len(lines) <= 150, f"mpedu/core/reference.py has {len(lines)} lines; the lesson promises at most 150"
