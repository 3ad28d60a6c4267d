"""The pipeline gives exactly the single-device loss and gradients, survives failures, and cleans up."""
import gc
import os
import signal
import threading
import time
import traceback
import warnings

import pytest
import torch

from conftest import make_batch, reference, tiny_model
from mpedu.core import Mailbox, Pipeline, Stage, schedules as S
from mpedu.lm import nll_sum
from mpedu.runtime import CallerThread, Worker

BALANCED = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"
UNBALANCED = "embed:vgpu0 | lstm0-2,decode:vgpu1"
NON_CONTIGUOUS = "embed,lstm0:vgpu0 | lstm1:vgpu1 | lstm2:vgpu0 | decode:vgpu1"
THREE = "embed:vgpu0 | lstm0-1:vgpu1 | lstm2,decode:vgpu2"
SINGLE = "embed,lstm0-2,decode:vgpu0"

CASES = [
    ("naive", SINGLE, 1), ("naive", BALANCED, 1), ("naive", UNBALANCED, 4),
    ("gpipe", SINGLE, 4), ("gpipe", BALANCED, 4), ("gpipe", UNBALANCED, 8), ("gpipe", NON_CONTIGUOUS, 2),
    ("gpipe", THREE, 8),
    ("1f1b", BALANCED, 4), ("1f1b", UNBALANCED, 2), ("1f1b", THREE, 8),
    ("interleaved", NON_CONTIGUOUS, 4), ("1f1b", NON_CONTIGUOUS, 2),
    ("zb1", BALANCED, 4), ("zb1", THREE, 8), ("zb1", SINGLE, 2),
]


@pytest.mark.parametrize("schedule,placement,m", CASES)
def test_pipeline_gives_the_single_device_loss_and_gradients(schedule, placement, m, batch):
    model = tiny_model()
    ref_loss, ref_grads = reference(model, batch)
    with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
        result = pipe.train_step(batch)
        assert result.loss == pytest.approx(ref_loss, rel=1e-6)
        assert result.tokens == batch.tokens
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        # a second step accumulates: gradients double
        pipe.train_step(batch)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, 2 * ref_grads[name], rtol=1e-5, atol=2e-7, msg=name)


def test_eval_step_matches_the_model_and_leaves_no_gradients(batch):
    model = tiny_model()
    ref_loss, _ = reference(model, batch)
    with Pipeline(model, BALANCED, "1f1b", micro_batches=4) as pipe:
        result = pipe.eval_step(batch)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert {e.kind for e in result.timeline.events} == {"F", "send"}


def test_stream_mode_carries_state_per_micro_batch_like_one_device():
    first, second = make_batch(seed=1, carry_state=True), make_batch(seed=2, carry_state=True)
    # no padding in stream mode
    for b in (first, second):
        b.targets[b.targets == 0] = 5
        b.inputs[b.inputs == 0] = 5
        b.mask[:] = True
    model = tiny_model()
    with torch.no_grad():
        _, state = model(first.inputs)
        logits, _ = model(second.inputs, state)
        ref = (nll_sum(logits, second.targets) / second.tokens).item()
        logits, _ = model(second.inputs)
        fresh = (nll_sum(logits, second.targets) / second.tokens).item()
    assert abs(ref - fresh) > 1e-4, "the test needs state to matter"
    with Pipeline(model, BALANCED, "gpipe", micro_batches=4) as pipe:
        pipe.eval_step(first)
        assert pipe.eval_step(second).loss == pytest.approx(ref, rel=1e-6)
        pipe.reset_state()
        assert pipe.eval_step(second).loss == pytest.approx(fresh, rel=1e-6)


class Injected(RuntimeError):
    pass


def _inject(monkeypatch, kind, stage_index, mb):
    """Make one action raise Injected; count how many actions ran."""
    method = "forward" if kind == "F" else "backward"
    original = getattr(Stage, method)

    def broken(self, mb_, chunk, *args, **kwargs):
        if self.index == stage_index and mb_ == mb:
            raise Injected(f"boom in {kind} stage {stage_index} mb {mb}")
        return original(self, mb_, chunk, *args, **kwargs)

    monkeypatch.setattr(Stage, method, broken)
    return original


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("kind", ["F", "B"])
@pytest.mark.parametrize("stage_index", [0, 1, 2])
@pytest.mark.parametrize("mb", [0, 3])
def test_an_exception_anywhere_reaches_the_caller_and_the_next_step_works(
        monkeypatch, schedule, kind, stage_index, mb, batch):
    model = tiny_model()
    ref_loss, ref_grads = reference(model, batch)
    pipe = Pipeline(model, THREE, schedule, micro_batches=4)
    try:
        _inject(monkeypatch, kind, stage_index, mb)
        with pytest.raises(Injected, match=f"boom in {kind} stage {stage_index} mb {mb}") as err:
            pipe.train_step(batch)
        frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
        assert "broken" in frames, f"the original traceback is lost: {frames}"
        assert all(w.alive for w in pipe._workers)
        monkeypatch.undo()
        model.zero_grad()
        result = pipe.train_step(batch)
        assert result.loss == pytest.approx(ref_loss, rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7)
    finally:
        pipe.close()


def test_a_failure_stops_the_other_devices_early(monkeypatch):
    """After stage 0 fails on micro-batch 0, later forwards never run (a counter proves it)."""
    batch = make_batch(B=16)
    model = tiny_model()
    ran = []
    original = Stage.forward

    def counting(self, mb, chunk, *args, **kwargs):
        if self.index == 0 and mb == 0:
            raise Injected("first forward fails")
        ran.append((self.index, mb))
        return original(self, mb, chunk, *args, **kwargs)

    monkeypatch.setattr(Stage, "forward", counting)
    with Pipeline(model, BALANCED, "gpipe", micro_batches=8) as pipe:
        with pytest.raises(Injected):
            pipe.train_step(batch)
    assert not any(stage == 1 for stage, _ in ran), "stage 1 cannot have received anything"
    assert len(ran) < 8


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
def test_a_worker_that_fails_while_the_callers_device_waits_for_it_ends_the_step_with_its_error(monkeypatch,
                                                                                                  schedule):
    """With a core per device the caller's thread plays vgpu:0 itself (CallerThread), and waits in a receive for
    what vgpu:1's worker sends. Until 2026-12-07 a stage failing there left the caller waiting for ever: the
    failed worker neither sent nor said it had finished. Now a failed device aborts the step's mailbox."""
    batch = make_batch(B=16)
    model = tiny_model()
    original = Stage.forward

    def failing(self, mb, chunk, *args, **kwargs):
        if self.index == 1 and mb == 1:
            raise Injected("stage 1 fails on micro-batch 1")
        return original(self, mb, chunk, *args, **kwargs)

    outcome = []

    def step():                  # in a thread of its own, so that a hang fails the test instead of the suite
        with Pipeline(model, BALANCED, schedule, micro_batches=4) as pipe:
            monkeypatch.setattr(Stage, "forward", failing)
            try:
                pipe.train_step(batch)
            except Injected as e:
                outcome.append(e)
            monkeypatch.undo()
            outcome.append(pipe.train_step(batch).loss)       # and the pipeline steps again
    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()
    stepper.join(timeout=60)
    assert not stepper.is_alive(), "the step waited for ever for the failed device"
    assert isinstance(outcome[0], Injected) and outcome[1] == pytest.approx(reference(model, batch)[0], rel=1e-6)


@pytest.fixture
def step_aborted(monkeypatch) -> threading.Event:
    """Set when a step's mailbox is aborted: what a Ctrl-C test waits for, rather than sleeping."""
    aborted, real_abort = threading.Event(), Mailbox.abort

    def abort(self):
        aborted.set()
        real_abort(self)
    monkeypatch.setattr(Mailbox, "abort", abort)
    return aborted


@pytest.mark.usefixtures("python_handles_ctrl_c")
def test_ctrl_c_during_a_step_leaves_the_pipeline_usable(monkeypatch, batch, step_aborted):
    model = tiny_model()
    ref_loss, _ = reference(model, batch)
    original, aborted = Stage.forward, step_aborted

    def interrupting(self, mb, chunk, *args, **kwargs):
        if self.index == 1 and mb == 1:
            os.kill(os.getpid(), signal.SIGINT)   # what Jupyter's "interrupt kernel" sends
            aborted.wait(10)                      # until the step is stopped, however late the main thread runs
        return original(self, mb, chunk, *args, **kwargs)

    with Pipeline(model, BALANCED, "gpipe", micro_batches=4) as pipe:
        monkeypatch.setattr(Stage, "forward", interrupting)
        try:
            with pytest.raises(KeyboardInterrupt) as interrupted:
                pipe.train_step(batch)
        finally:
            aborted.set()                         # never leave the worker waiting, whatever happened
        monkeypatch.undo()
        # one line for the learner, no chain of worker frames behind it
        assert str(interrupted.value).startswith("the step was interrupted; the pipeline is ready for the next one")
        assert "zero the gradients" in str(interrupted.value) and interrupted.value.__cause__ is None
        assert interrupted.value.__suppress_context__
        model.zero_grad()
        assert pipe.train_step(batch).loss == pytest.approx(ref_loss, rel=1e-6)


@pytest.mark.usefixtures("python_handles_ctrl_c")
def test_ctrl_c_that_lands_in_a_worker_thread_interrupts_the_step(monkeypatch, batch, step_aborted):
    """The kernel hands a process-directed SIGINT to any thread that does not block it: here, a worker.
    Python runs the handler only on the main thread, which must notice it while the step still runs
    (before this fix it slept until the step ended, and the interrupt was lost or came late)."""
    model = tiny_model()
    ref_loss, _ = reference(model, batch)
    original, aborted = Stage.forward, step_aborted
    seen = {}

    def interrupting(self, mb, chunk, *args, **kwargs):
        if self.index == 1 and mb == 1:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)   # delivered to this worker thread
            seen["abort during the step"] = aborted.wait(10)            # the state asserted, waited for
        return original(self, mb, chunk, *args, **kwargs)

    with Pipeline(model, BALANCED, "gpipe", micro_batches=4) as pipe:
        monkeypatch.setattr(Stage, "forward", interrupting)
        try:
            with pytest.raises(KeyboardInterrupt):
                pipe.train_step(batch)
        finally:
            aborted.set()                   # never leave the worker waiting, whatever happened
        assert seen == {"abort during the step": True}
        monkeypatch.undo()
        model.zero_grad()
        assert pipe.train_step(batch).loss == pytest.approx(ref_loss, rel=1e-6)


def _wait_until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_workers_end_when_closed_or_collected(batch):
    pipe = Pipeline(tiny_model(), BALANCED, "gpipe", micro_batches=2)
    pipe.train_step(batch)
    threads = [w._thread for w in pipe._workers if isinstance(w, Worker)]    # (vgpu:0 may be the caller's thread)
    expected = ["mpedu-vgpu:1"] if isinstance(pipe._workers[0], CallerThread) else ["mpedu-vgpu:0", "mpedu-vgpu:1"]
    assert [t.name for t in threads] == expected and all(t.is_alive() for t in threads)
    pipe.close()
    assert not any(t.is_alive() for t in threads), "close() returned before the workers ended"
    with pytest.raises(RuntimeError, match="closed"):
        pipe.train_step(batch)

    pipe = Pipeline(tiny_model(), BALANCED, "gpipe", micro_batches=2)
    pipe.train_step(batch)
    threads = [w._thread for w in pipe._workers if isinstance(w, Worker)]
    del pipe
    gc.collect()
    assert _wait_until(lambda: not any(t.is_alive() for t in threads)), "an unreferenced pipeline kept its workers"


def test_virtual_workers_run_torch_single_threaded():
    with Pipeline(tiny_model(), BALANCED, "gpipe", micro_batches=2) as pipe:
        counts = [w.submit(torch.get_num_threads).result() for w in pipe._workers]
    assert counts == [1, 1]


def test_timeline_records_every_action_and_transfer_in_causal_order(batch):
    with Pipeline(tiny_model(), THREE, "1f1b", micro_batches=4) as pipe:
        result = pipe.train_step(batch)
    tl = result.timeline
    assert tl.devices == ["vgpu:0", "vgpu:1", "vgpu:2"]
    assert len(tl.compute()) == 3 * 4 * 2
    # forwards send to the next stage, backwards to the previous: 2 edges x 4 mbs x 2 directions
    assert len(tl.transfers()) == 16
    ends = {(e.kind, e.stage, e.mb): e.end for e in tl.compute()}
    for e in tl.compute():
        if e.kind == "F" and e.stage > 0:
            assert e.start >= ends["F", e.stage - 1, e.mb]
        if e.kind == "B" and e.stage < 2:
            assert e.start >= ends["B", e.stage + 1, e.mb]
    for d in tl.devices:
        boxes = tl.compute(d)
        assert all(a.end <= b.start for a, b in zip(boxes, boxes[1:])), f"{d} ran two actions at once"
        assert [e.label for e in boxes] == [str(a) for a in pipe.schedule.actions[tl.devices.index(d)]]
    # the activation sent from stage 0 is (T, b, E) floats
    sent = [e for e in tl.transfers() if e.stage == 0 and e.mb == 0]
    assert sent[0].bytes == batch.inputs.shape[0] * 2 * 32 * 4 and sent[0].peer == "vgpu:1"
    assert 0.0 <= tl.bubble_fraction < 1.0


def test_bad_arguments_get_clear_errors(batch):
    model = tiny_model()
    with pytest.raises(ValueError, match="micro_batches=3 does not divide"):
        with Pipeline(model, BALANCED, "gpipe", micro_batches=3) as pipe:
            pipe.train_step(batch)
    with pytest.raises(ValueError, match="unknown schedule"):
        Pipeline(model, BALANCED, "fastest")
    tied = tiny_model(embed_size=64, tie_weights=True)
    with pytest.raises(ValueError, match="tied weights: embed .vgpu:0. and decode .vgpu:1."):
        Pipeline(tied, BALANCED, "gpipe")
    ref_loss, ref_grads = reference(tied, batch)
    with Pipeline(tied, SINGLE, "gpipe", 2) as pipe:   # together on one device: allowed
        assert pipe.train_step(batch).loss == pytest.approx(ref_loss, rel=1e-6)


def test_gpipe_holds_m_micro_batches_of_activations_1f1b_at_most_p(batch):
    """The known difference, measured with saved-tensor hooks: stage 0 keeps m vs p micro-batches."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        with Pipeline(tiny_model(), BALANCED, schedule, micro_batches=8) as pipe:
            tl = pipe.train_step(make_batch(B=16)).timeline
        one_mb = max(e.memory for e in tl.compute("vgpu:0"))
        assert one_mb > 0
        peaks[schedule] = tl.peak_memory("vgpu:0") / one_mb
        assert tl.memory_over_time("vgpu:0")[-1][1] == 0, "everything saved must be freed by the end"
    assert peaks["gpipe"] == pytest.approx(8, rel=0.15)
    assert peaks["1f1b"] == pytest.approx(2, rel=0.15)


@pytest.mark.parametrize("placement,m,chunks", [
    (BALANCED, 1, 2), (BALANCED, 1, 3), (THREE, 2, 3), (NON_CONTIGUOUS, 1, 4), (SINGLE, 2, 2), (THREE, 1, 9)])
def test_wavefront_over_time_chunks_gives_the_single_device_gradients(placement, m, chunks, batch):
    model = tiny_model()
    ref_loss, ref_grads = reference(model, batch)
    with Pipeline(model, placement, "wavefront", micro_batches=m, chunks=chunks) as pipe:
        result = pipe.train_step(batch)
        assert result.loss == pytest.approx(ref_loss, rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        assert pipe.eval_step(batch).loss == pytest.approx(ref_loss, rel=1e-6)
    # the diagonal: stage 1 starts chunk 0 before stage 0 has finished its last chunk
    if placement == BALANCED:
        f = {(e.stage, e.chunk): e for e in result.timeline.compute() if e.kind == "F"}
        assert f[1, 0].start >= f[0, 0].end
        assert [e.chunk for e in result.timeline.compute("vgpu:0") if e.kind == "B"] == list(
            reversed(range(chunks)))


def test_buckets_get_one_cached_plan_each(batch):
    with Pipeline(tiny_model(), BALANCED, "wavefront", micro_batches=2, chunks=3) as pipe:
        for T in (9, 6, 9, 9):
            pipe.train_step(make_batch(T=T))
        assert sorted(pipe.bucket_cache) == [(6, 8), (9, 8)]
        plan = pipe.bucket_cache[9, 8]
        assert plan.steps == 3 and plan.sizes == (4, 4) and plan.chunk_bounds == [(0, 3), (3, 6), (6, 9)]
        assert "bucket T=9, B=8: micro-batches of 4" in str(plan)
        with pytest.raises(ValueError, match="chunks=3 but this batch has only T=2"):
            pipe.train_step(make_batch(T=2))


def test_a_failed_step_frees_what_its_forwards_saved(monkeypatch, batch):
    """Regression: the saved-tensor hook returned each tensor as-is, so an output saved by its own
    op pointed back at its grad_fn, a cycle that only backward breaks. A step that failed before
    its backwards leaked its graphs: bench/soak.py measured 0.4 MB per failed step."""
    def tensors():
        gc.collect()
        with warnings.catch_warnings():     # isinstance() pokes deprecated torch.distributed objects
            warnings.simplefilter("ignore")
            return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    with Pipeline(tiny_model(), THREE, "gpipe", micro_batches=4) as pipe:
        _inject(monkeypatch, "F", 2, 1)     # the last stage fails on micro-batch 1: stages 0, 1 ran forwards
        for k in range(12):
            if k == 2:
                before = tensors()
            with pytest.raises(Injected):
                pipe.train_step(batch)
        assert tensors() - before < 10


@pytest.mark.parametrize("queued", [False, True], ids=["before-the-second-submit", "after-its-job-was-queued"])
def test_ctrl_c_between_submitting_two_devices_jobs_does_not_hang(monkeypatch, batch, queued):
    """Ctrl-C lands in the caller between the devices' submissions (the last device's first): vgpu:1's job is
    queued and waits for vgpu:0's messages, which will never come. The step must abort it, and close() must
    return. (Where vgpu:0 is the caller's own thread, `queued` runs its job there before the Ctrl-C.)"""
    model = tiny_model()
    ref_loss, _ = reference(model, batch)
    pipe = Pipeline(model, BALANCED, "gpipe", micro_batches=4)
    second = pipe._workers[pipe._submit_order[1]]      # the worker submitted second
    real_submit = type(second).submit

    def interrupted(fn):
        if queued:
            real_submit(second, fn)      # the job is queued, but its future never reaches the step
        raise KeyboardInterrupt

    monkeypatch.setattr(second, "submit", interrupted)
    outcome = {}

    def step_then_close():
        try:
            pipe.train_step(batch)
        except KeyboardInterrupt:
            outcome["interrupted"] = True
        monkeypatch.undo()
        model.zero_grad()
        outcome["loss"] = pipe.train_step(batch).loss
        pipe.close()
        outcome["closed"] = True

    runner = threading.Thread(target=step_then_close, daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive(), "the step or close() hung after a Ctrl-C between two submissions"
    assert outcome == {"interrupted": True, "loss": pytest.approx(ref_loss, rel=1e-6), "closed": True}
    assert not any(w.alive for w in pipe._workers)


# -- a schedule edited after the Pipeline was built is checked before it runs -----------------------------
def _edited(edit):
    model = tiny_model()
    pipe = Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=4)
    edit(pipe.schedule.actions)
    return model, pipe


@pytest.mark.parametrize("edit, words", [
    (lambda rows: rows[0].remove(S.B(0, 3)), "0B3 is missing"),
    (lambda rows: rows[0].remove(S.F(0, 3)), "0F3 is missing"),
    (lambda rows: rows[0].append(S.B(0, 3)), "0B3: appears twice"),
    (lambda rows: rows[1].reverse(), "deadlock: no device can go on"),
    (lambda rows: rows[1].append("1F9"), "device 1's row holds '1F9', not an Action"),
], ids=["a backward removed", "a forward removed", "a backward twice", "a row reversed", "text in a row"])
def test_a_schedule_edited_after_the_pipeline_was_built_is_refused_before_any_device_runs(edit, words, batch):
    model, pipe = _edited(edit)
    with pipe:
        with pytest.raises(S.ScheduleError, match="pipe.schedule was edited after the Pipeline was built") as e:
            pipe.train_step(batch)
        assert words in str(e.value)
        assert all(p.grad is None for p in model.parameters())          # no device ran an action
        assert pipe.eval_step(batch).loss > 0                           # evaluation plays its own order


def test_an_edit_that_still_runs_is_checked_once_and_played(batch):
    model, pipe = _edited(lambda rows: rows[1].sort(key=lambda a: (a.kind != "F", a.mb)))   # the same order
    with pipe:
        pipe.schedule.actions[0][:4] = [S.F(0, 1), S.F(0, 0), S.F(0, 2), S.F(0, 3)]          # 0F1 before 0F0
        first = pipe.train_step(batch).loss
        assert pipe.schedule._checked[0] == pipe.schedule.actions       # checked once, as edited
        assert pipe.train_step(batch).loss == first


def test_a_schedule_replaced_by_one_for_other_counts_is_refused(batch):
    model, pipe = _edited(lambda rows: None)
    with pipe:
        pipe.schedule = S.make("gpipe", [0, 1], 2)
        with pytest.raises(S.ScheduleError, match=r"with 2 micro-batches .* this pipeline \[0, 1\], 4 and 1"):
            pipe.train_step(batch)


def test_rows_that_wait_for_ever_end_in_a_deadlock_naming_who_waits_for_what(batch):
    # past the schedule check (as a bug in the engine would be): the mailbox sees every device waiting
    model = tiny_model()
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=2) as pipe:
        rows = [[S.F(0, 0), S.B(0, 0)], [S.F(1, 1)]]
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(_raised(lambda: pipe._step(batch, rows, True))))
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the step hung"
        text = str(outcome[0])
        assert "deadlock" in text
        assert "vgpu:1 at 1F1 waits for the activation 0F1 sends to stage 1" in text
        assert "vgpu:0 at 0B0 waits for the gradient 1B0 sends to stage 0" in text
        model.zero_grad()
        assert pipe.train_step(batch).loss > 0                       # and the pipeline works on


def _raised(call):
    try:
        call()
    except Exception as e:
        return e
    return None


def test_the_middle_of_a_v_shape_hands_off_on_its_device_for_free(batch):
    """Stages 1 and 2 of a V share vgpu1: their hand-off crosses no link, in the step as in the prediction."""
    from mpedu.predict import simulate
    model = tiny_model()
    v = "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu1 | lstm2,decode:vgpu0"
    with Pipeline(model, v, "gpipe", micro_batches=4, link="10gbe/100") as pipe:
        timeline = pipe.train_step(batch).timeline
        assert pipe.placement.stage_devices == [0, 1, 1, 0]
    sends = [(e.stage, e.device, e.peer) for e in timeline.transfers()]
    assert all(device != peer for _, device, peer in sends)
    # 2 cuts between devices (stages 0|1 and 2|3) x 2 directions x 4 micro-batches; none from stage 1 to 2
    assert len(sends) == 16 and {s for s, _, _ in sends} == {0, 1, 2, 3}
    assert not any(s == 1 and device == "vgpu:1" and peer == "vgpu:1" for s, device, peer in sends)
    assert len(simulate(pipe.schedule, [1e-3] * 4, link="10gbe/100").transfers()) == 16


def test_tied_weights_train_exactly_where_a_v_shape_puts_embed_and_decode_together(batch):
    """The V shape's first and last stage share device 0: a tied embedding and decoder may sit there, as on one
    device; dealt to two devices they are refused."""
    model = tiny_model(embed_size=64, hidden_size=64, tie_weights=True)
    ref_loss, ref_grads = reference(model, batch)
    with Pipeline(model, "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu1 | lstm2,decode:vgpu0", "gpipe",
                  micro_batches=4) as pipe:
        assert pipe.train_step(batch).loss == pytest.approx(ref_loss, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="tied weights: embed .* and decode .* share one weight matrix"):
        Pipeline(model, "embed,lstm0:vgpu0 | lstm1,lstm2,decode:vgpu1", "gpipe", micro_batches=4)
