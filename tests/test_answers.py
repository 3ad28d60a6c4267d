"""The checked exercises of notebooks 0, 1, 2 and 6 (`exercises.answer`): each accepts the right answer, names
typical wrong ones in words with a hint, and says "not done yet" to a placeholder. What depends on the machine
(a timeline, a memory report) comes from a run here, and the check is judged against that run."""
import math

import numpy as np
import pytest

import mpedu
from mpedu.course import exercises
from mpedu.predict import memory_report

answer = exercises.answer


@pytest.fixture(scope="module")
def corpus():
    return mpedu.load_corpus()


def says(result, *parts, ok=False):
    text = str(result)
    assert result.ok is ok, text
    for part in parts:
        assert part in text, f"{part!r} not in:\n{text}"
    return text


# ---- placeholders ----------------------------------------------------------------------------------------------

NEEDS = {"01.2": dict(lengths=[3, 5], bucket=np.ones((5, 2), bool), random=np.ones((5, 2), bool)),
         "01.3": dict(vocab_size=3289), "02.2": dict(timeline=None, placement=None),
         "02.3": dict(report=None, costs=None, placement=None), "06.2": dict(sentences=None)}


@pytest.mark.parametrize("exercise", list(exercises.ANSWERS))
def test_a_placeholder_is_not_done_yet_and_gets_its_hint(exercise):
    text = says(answer(exercise, None, **NEEDS.get(exercise, {}))).splitlines()
    assert text[0].startswith("not done yet: set `") or text[0].startswith("not done yet: write `"), text[0]
    assert text[-1].startswith("hint: ")


def test_a_choice_lists_its_options_while_not_done():
    text = says(answer("00.3", None), "not done yet: set `same_layer` to the letter of your answer")
    assert "  a) Nothing" in text and "  b) Both backwards" in text and "  c) They deadlock" in text


def test_a_function_that_still_raises_not_implemented_is_not_done_yet():
    def naive_bubble(costs):
        raise NotImplementedError
    says(answer("02.1", naive_bubble), "not done yet: replace the `raise NotImplementedError`", "hint: ")


def test_an_unknown_exercise_and_a_missing_notebook_object_are_refused():
    with pytest.raises(ValueError, match="choose one of 00.1"):
        answer("99.1", 1)
    with pytest.raises(TypeError, match="needs lengths=..."):
        answer("01.2", 0.5)


# ---- choices ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exercise, right, wrong", [
    ("00.1", "a", {"b": "PyTorch lets go of the GIL", "c": "the cores set the most it can be"}),
    ("00.3", "b", {"a": "the layer is one", "c": "neither backward waits"}),
    ("06.1", "a", {"b": "each row (time step) is contiguous", "c": "columns hold different numbers of tokens too"}),
    ("06.3", "a", {"b": "a column is a stream that goes on", "c": "shuffling columns keeps every shape"}),
])
def test_a_choice_accepts_its_answer_and_explains_each_wrong_one(exercise, right, wrong):
    says(answer(exercise, right), f"correct: {right}) ", ok=True)
    says(answer(exercise, f"({right.upper()})"), "correct: ", ok=True)          # "(A)" is "a"
    for letter, why in wrong.items():
        says(answer(exercise, letter), f"not yet: {letter}) ", "\nhint: ", why)
    says(answer(exercise, "d"), "answer 'd': choose one of 'a', 'b', 'c'")


# ---- notebook 0 ------------------------------------------------------------------------------------------------

def test_three_devices_on_two_cores():
    says(answer("00.2", 1.5), "correct: 1.5: three devices' work is 3/2 of two devices'", ok=True)
    says(answer("00.2", 1), "would mean three devices run at full speed")
    says(answer("00.2", 2.0), "twice as long is four devices on two cores")
    says(answer("00.2", 0.67), "more devices cannot do more at once than the cores allow")
    says(answer("00.2", "1.5"), "three_on_two should be a number, got '1.5'")


# ---- notebook 1 ------------------------------------------------------------------------------------------------

def test_the_perplexity_of_an_untrained_model():
    says(answer("01.1", 10_000), "correct: about 10,000", ok=True)
    says(answer("01.1", math.exp(math.log(10_000) + 0.01)), "correct: ", ok=True)
    says(answer("01.1", math.log(10_000)), "that is the loss", "hint: the perplexity is exp(loss)")
    says(answer("01.1", 1e-4), "the probability the untrained model gives each word")
    says(answer("01.1", 3289), "this corpus's vocabulary (3,289 words)")


def test_the_padding_if_every_batch_were_padded_to_the_corpus_max(corpus):
    lengths = np.array([len(s) for s in corpus.train])
    bucket = next(b for b in mpedu.BucketIterator(corpus.train, batch_size=32, shuffle=False) if b.bucket >= 24).mask
    picked = lengths[np.random.default_rng(0).choice(len(lengths), 32, replace=False)]
    random = np.arange(picked.max())[:, None] < picked[None, :]
    given = dict(lengths=lengths, bucket=bucket, random=random)
    want = 1 - lengths.mean() / lengths.max()           # every sentence padded to the longest
    says(answer("01.2", want, **given), f"correct: {want:.1%}", ok=True)
    says(answer("01.2", 100 * want, **given), "give a share between 0 and 1 (0.5 for half), not a percentage")
    says(answer("01.2", 1 - random.mean(), **given), "the left picture's padding")
    says(answer("01.2", 1 - bucket.float().mean().item(), **given), "one bucket's padding")
    says(answer("01.2", lengths.mean() / lengths.max(), **given), "the share of real tokens, not of padding")


def test_the_largest_output_of_the_small_model():
    V = 3289
    says(answer("01.3", ("decode", V / 200), vocab_size=V), "correct: decode's output, (T, B, 3289), is 16.4 times",
         ok=True)
    says(answer("01.3", ("embed", 1.0), vocab_size=V), "embed's output is (T, B, 200)", "hint: which layer gives")
    says(answer("01.3", ("decode", 200 / V), vocab_size=V), "upside down")
    says(answer("01.3", ("decode", V / 64), vocab_size=V), "the tiny model's ratio")
    says(answer("01.3", "decode", vocab_size=V), "give a pair")


# ---- notebook 2 ------------------------------------------------------------------------------------------------

def test_the_naive_bubble_against_the_simulator():
    says(answer("02.1", lambda costs: 1 - 1 / len(costs)), "correct: the naive bubble is 1 - 1/p", ok=True)
    says(answer("02.1", lambda costs: 1 - sum(costs) / (len(costs) * max(costs))),     # an imbalance formula
         "equal stages still leave a bubble", "hint: 0F0 -> 1F0 -> 1B0 -> 0B0 is a chain")
    says(answer("02.1", lambda costs: 1 / len(costs)), "1/p is the share of the step each device works")
    says(answer("02.1", lambda costs: 0.5), "naive_bubble([1.0, 1.0, 1.0]) gives 0.5", "grows with the number")
    says(answer("02.1", lambda costs: 1 - 1 / len(costs) if len(set(costs)) == 1 else 0.0),
         "with unequal costs the bubble does not change")
    says(answer("02.1", lambda costs: costs.missing), "raised AttributeError")
    says(answer("02.1", 0.5), "write a function of the stage costs")


@pytest.fixture(scope="module")
def small():
    corpus = mpedu.load_corpus()
    model = mpedu.LSTMLM.from_config("small", vocab_size=len(corpus.vocab))     # notebook 2's model
    batch = next(iter(mpedu.BucketIterator(corpus.train, batch_size=8, buckets=[12], seed=0)))
    return model, batch


def test_the_busiest_device_is_judged_against_this_timeline(small):
    model, batch = small
    three = mpedu.Placement.parse("embed,lstm0:vgpu0 | lstm1:vgpu1 | decode:vgpu2", model)
    with mpedu.Pipeline(model, three, "naive", micro_batches=1) as pipe:
        timeline = pipe.train_step(batch).timeline
    model.zero_grad(set_to_none=True)
    busy = {d: timeline.busy(d) for d in timeline.devices}
    top = max(busy, key=busy.get)
    says(answer("02.2", top, timeline=timeline, placement=three), f"correct: {top} (", "the most", ok=True)
    says(answer("02.2", int(top[-1]), timeline=timeline, placement=three), "correct: ", ok=True)     # 2 is vgpu:2
    other = next(d for d in busy if d != top)
    says(answer("02.2", other, timeline=timeline, placement=three), f"not yet: {other} (", f"; {top} (",
         "hint: the busiest device is the one with the longest boxes")
    says(answer("02.2", "vgpu:3", timeline=timeline, placement=three), "this step ran on vgpu:0, vgpu:1, vgpu:2")


def test_the_device_with_more_activations_and_its_layers(small):
    model, batch = small
    two = mpedu.Placement.parse("embed,lstm0:vgpu0 | lstm1,decode:vgpu1", model)
    with mpedu.Pipeline(model, two, "naive", micro_batches=1) as pipe:
        report = memory_report(pipe, pipe.train_step(batch).timeline)
    model.zero_grad(set_to_none=True)
    costs = mpedu.profile(model, batch, "vgpu:0", micro_batches=1, warmup=0, repeats=1)
    given = dict(report=report, costs=costs, placement=two)
    says(answer("02.3", ("vgpu:1", ["lstm1", "decode"]), **given), "correct: vgpu:1 holds", "decode and lstm1 keep",
         ok=True)
    says(answer("02.3", ("vgpu:0", ["lstm0"]), **given), "vgpu:0 holds", "the report's 'activations (peak)' column")
    says(answer("02.3", ("vgpu:1", "decode"), **given), "vgpu:1 is right, but lstm1 keeps")
    says(answer("02.3", ("vgpu:1", ["lstm0", "decode"]), **given), "lstm0 is not on vgpu:1: it is on vgpu:0")
    says(answer("02.3", "vgpu:1", **given), "give a pair")


# ---- notebook 6 ------------------------------------------------------------------------------------------------

def test_the_sentences_drop_last_skips(corpus):
    full = list(mpedu.BucketIterator(corpus.train, batch_size=32))
    kept = sum(b.inputs.shape[1] for b in mpedu.BucketIterator(corpus.train, batch_size=32, drop_last=True))
    skipped = sum(b.inputs.shape[1] for b in full) - kept
    given = dict(sentences=corpus.train)
    says(answer("06.2", skipped, **given), f"correct: {skipped} of", "each bucket's last batch", ok=True)
    batches = len(full) - len(mpedu.BucketIterator(corpus.train, batch_size=32, drop_last=True))
    says(answer("06.2", batches, **given), "counts the batches drop_last skips")
    says(answer("06.2", 31 * len({b.bucket for b in full}), **given), "the most it could skip, 31 per bucket")
    says(answer("06.2", 0, **given), "drop_last skips each bucket's last batch")
