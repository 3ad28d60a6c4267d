"""What a learner passes wrongly to the public API is refused at once, in words that name it (a review
of the API with hostile inputs): nothing trains the wrong weights, scores with a wrong mask, or fails
deep inside torch."""
import dataclasses
import threading
import time

import pytest
import torch

from conftest import VOCAB, make_batch, tiny_model
from mpedu.lm import BucketIterator, LSTMLM
from mpedu.predict import Costs, StageCost, memory_report, plan, profile, simulate
from mpedu.core import Pipeline, Placement, Stage
from mpedu.training import train

TWO = "embed,lstm0:vgpu0 | lstm1-2,decode:vgpu1"


def test_train_refuses_a_runner_built_on_another_model_or_no_runner_at_all(corpus):
    model, other = (LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab)) for _ in range(2))
    with Pipeline(other, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", micro_batches=2) as pipe:
        with pytest.raises(ValueError, match="the runner was built on another model"):
            train(model, corpus, runner=pipe, epochs=1, limit_batches=1, log=lambda *a: None, progress=False)
    with pytest.raises(TypeError, match="runner='gpipe' is not a runner"):
        train(model, corpus, runner="gpipe", epochs=1, progress=False)
    with pytest.raises(TypeError, match="train needs a Corpus .* got Sentences.*not one split"):
        train(model, corpus.train, epochs=1, progress=False)


def test_a_schedule_built_for_other_micro_batches_or_chunks_is_refused_not_overridden():
    """Pipeline(model, TWO, gpipe-for-2, micro_batches=4) ran 2 micro-batches without a word."""
    from mpedu.core import schedules
    model = tiny_model()
    for schedule, options, what in ((schedules.gpipe([0, 1], 2), {"micro_batches": 4}, "micro_batches=4"),
                                    (schedules.wavefront([0, 1], 2, 3), {"chunks": 1}, "chunks=1")):
        with pytest.raises(ValueError, match=f"{what}, but the schedule '\\w+' was built for"):
            Pipeline(model, TWO, schedule, **options)
    with Pipeline(model, TWO, schedules.wavefront([0, 1], 2, 3), micro_batches=2, chunks=3) as pipe:
        assert (pipe.micro_batches, pipe.chunks) == (2, 3)       # the same numbers again are fine


def test_a_second_thread_is_refused_while_a_step_runs():
    model, batch = tiny_model(), make_batch()
    slow, original = threading.Event(), Stage.forward

    def slowed(self, *args, **kwargs):
        slow.set()
        time.sleep(0.3)
        return original(self, *args, **kwargs)

    with Pipeline(model, TWO, "gpipe", micro_batches=2) as pipe:
        reference = pipe.train_step(batch).loss
        Stage.forward = slowed
        try:
            first = {}
            runner = threading.Thread(target=lambda: first.setdefault("loss", pipe.train_step(batch).loss))
            runner.start()
            assert slow.wait(10)
            with pytest.raises(RuntimeError, match="running a step in another thread"):
                pipe.train_step(batch)
            runner.join(30)
        finally:
            Stage.forward = original
        assert first["loss"] == pytest.approx(reference, rel=1e-6)     # the first step was not disturbed


def test_profile_checks_the_batch_and_its_counts():
    model, batch = tiny_model(), make_batch()
    with pytest.raises(ValueError, match=f"vocabulary has ids 0..{VOCAB - 2}"):
        profile(LSTMLM.from_config("tiny", VOCAB - 1, num_layers=3), batch)
    for name, value in (("repeats", 1.5), ("repeats", None), ("warmup", -1), ("repeats", True)):
        with pytest.raises(ValueError, match=f"{name}={value!r}: expected a whole number"):
            profile(model, batch, **{name: value})


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf")])
def test_costs_refuse_times_no_machine_measures(bad):
    with pytest.raises(ValueError, match=r"a stage's backward \(seconds\)=.*: expected a finite number >= 0"):
        StageCost(1.0, backward=bad)
    good = dict(names=["a", "b"], forward=[1.0, 1.0], backward=[2.0, 2.0], backward_input=[1.0, 1.0],
                backward_weight=[1.0, 1.0], activation_bytes=[0, 0], output_bytes=[0, 0], param_bytes=[0, 0],
                shared_bytes=[0, 0], micro_batch=(1, 1))
    Costs(**good)
    with pytest.raises(ValueError, match=r"a layer's forward \(seconds\)="):
        Costs(**{**good, "forward": [1.0, bad]})


def test_timelines_and_memory_reports_name_devices_they_do_not_have():
    model, batch = tiny_model(), make_batch()
    with Pipeline(model, TWO, "gpipe", micro_batches=2) as pipe:
        result = pipe.train_step(batch)
        timeline = result.timeline
        for method in (timeline.busy, timeline.idle, timeline.peak_memory, timeline.compute):
            with pytest.raises(ValueError, match="no device 'vgpu0'; its devices are vgpu:0, vgpu:1"):
                method("vgpu0")
        # a StepResult reads as its timeline
        assert memory_report(pipe, result).table() == memory_report(pipe, timeline).table()
        with pytest.raises(TypeError, match="needs a Pipeline and a training step's timeline, got LSTMLM"):
            memory_report(model, timeline)
    with Pipeline(tiny_model(), "embed,lstm0:vgpu2 | lstm1-2,decode:vgpu3", "gpipe", micro_batches=2) as other:
        with pytest.raises(ValueError, match="the timeline has no device vgpu:2, vgpu:3"):
            memory_report(other, timeline)


def test_devices_and_choices_given_as_one_value(corpus):
    model = tiny_model()
    assert [d.name for d in Placement.even(model, "vgpu:1").devices] == ["vgpu:1"]
    with pytest.raises(ValueError, match="name vgpu:0 twice"):
        Placement.even(model, ["vgpu:0", "vgpu:0"])
    with pytest.raises(TypeError, match="devices=True: give a count"):
        Placement.even(model, True)
    with pytest.raises(TypeError, match="placement must be"):
        Pipeline(model, True)
    with pytest.raises(TypeError, match="vocab_size must be a whole number, got Vocabulary"):
        LSTMLM.from_config("tiny", vocab_size=corpus.vocab)
    with pytest.raises(TypeError, match=r"BucketIterator\(corpus.train, batch_size\)"):
        BucketIterator(corpus, 4)


def test_plan_takes_one_value_where_a_tuple_of_choices_goes_and_names_bad_ones():
    model, batch = tiny_model(), make_batch(B=4)
    costs = profile(model, batch, micro_batches=2, warmup=0, repeats=1)
    one = plan(model, batch, ["vgpu:0", "vgpu:1"], costs=costs, schedules="gpipe", micro_batches=2, recompute=None)
    assert {(c.schedule, c.micro_batches, c.recompute) for c in one.simulated} == {("gpipe", 2, None)}
    with pytest.raises(ValueError, match="'some' is not a recomputation mode"):
        plan(model, batch, 2, costs=costs, micro_batches=2, recompute=("some",))
    with pytest.raises(ValueError, match=r"chunks=\(50,\): the wavefront needs a chunk count from 1 to the batch's 9"):
        plan(model, batch, 2, costs=costs, micro_batches=2, schedules=("wavefront",), chunks=(50,))


def test_a_mask_that_disagrees_with_the_targets_is_refused_by_every_runner():
    model, batch = tiny_model(), make_batch()
    wrong = dataclasses.replace(batch, mask=torch.ones_like(batch.mask))
    with Pipeline(model, TWO, "gpipe", micro_batches=2) as pipe:
        with pytest.raises(ValueError, match="mask must be a bool tensor True exactly where a target is a real"):
            pipe.train_step(wrong)


@pytest.mark.parametrize("placement", [TWO, "embed,lstm0-2,decode:vgpu0"], ids=["two devices", "one device"])
def test_targets_the_last_stage_checks_are_refused_in_words_and_change_nothing(placement):
    """A pipeline checks the inputs before any device runs and the targets on the last stage's device, while the
    first stage computes: a bad target still ends the step with the check's words, before any backward."""
    model, batch = tiny_model(), make_batch()
    targets = batch.targets.clone()
    targets[0, 1] = VOCAB + 3
    with Pipeline(model, placement, "1f1b", micro_batches=2) as pipe:
        with pytest.raises(ValueError, match=f"the batch holds token id {VOCAB + 3}, but the model's vocabulary "
                                             f"has ids 0..{VOCAB - 1}"):
            pipe.train_step(dataclasses.replace(batch, targets=targets))
        assert all(p.grad is None for p in model.parameters())
        assert pipe.train_step(batch).tokens == int(batch.mask.sum())


def test_simulate_names_costs_of_another_model_or_none():
    model, other = tiny_model(), tiny_model(num_layers=2)
    costs = profile(other, make_batch(), micro_batches=2, warmup=0, repeats=1)
    with pytest.raises(ValueError, match="these costs cover layers embed, lstm0, lstm1, decode, the placement "
                                         "places embed, lstm0, lstm1, lstm2, decode"):
        simulate("gpipe", costs, Placement.parse(TWO, model), micro_batches=2)
    for nothing in ([], None):
        with pytest.raises(ValueError, match="give per-layer Costs .* or one cost per stage"):
            simulate("gpipe", nothing, micro_batches=2)


def test_measuring_plans_needs_steps_and_two_plans():
    model, batch = tiny_model(), make_batch(B=4)
    plans = plan(model, batch, 2, costs=profile(model, batch, micro_batches=2, warmup=0, repeats=1))
    with pytest.raises(ValueError, match="steps=0: expected a whole number >= 1"):
        plans.measure(model, batch, steps=0)
    with pytest.raises(ValueError, match="only 1 candidate.*ask for top >= 2"):
        plans.measure(model, batch, top=1)


def test_a_batch_field_that_is_not_a_tensor_is_named():
    batch = make_batch()
    with Pipeline(tiny_model(), TWO, "gpipe", micro_batches=2) as pipe:
        with pytest.raises(TypeError, match=r"got Batch \(inputs is ndarray\)"):
            pipe.train_step(dataclasses.replace(batch, inputs=batch.inputs.numpy()))


def test_corpus_and_bucket_arguments_of_the_wrong_kind():
    from mpedu.lm import load_corpus
    with pytest.raises(TypeError, match="path=5: give a folder"):
        load_corpus(5)
    with pytest.raises(ValueError, match="seed='a'"):
        load_corpus(seed="a")
    sentences = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    with pytest.raises(TypeError, match=r"buckets=10: give a list of bucket lengths, e.g. \[10\]"):
        BucketIterator(sentences, 2, buckets=10)
    with pytest.raises(ValueError, match="sentence 1 must be a non-empty 1-D tensor of int64 token ids"):
        BucketIterator([sentences[0], sentences[1].float()], 2)


def test_no_batch_at_all_a_missing_folder_and_a_foreign_dict_are_named(tmp_path):
    from mpedu.core import Timeline
    sentences = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    with pytest.raises(ValueError, match="drop_last=True leaves no batch: no bucket holds 4 sentences"):
        BucketIterator(sentences, 4, drop_last=True)
    assert len(BucketIterator(sentences, 4)) >= 1            # without drop_last the sentences are batched
    timeline = Timeline(["vgpu:0"])
    with pytest.raises(FileNotFoundError, match=f"no folder {tmp_path / 'missing'} to write step.json into"):
        timeline.to_json(tmp_path / "missing" / "step.json")
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="not a timeline: expected a dict with 'devices' and 'events'"):
        Timeline.from_dict({"a": 1})
