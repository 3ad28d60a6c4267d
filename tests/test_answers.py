"""The checked exercises of notebooks 0, 1, 2 and 4 to 9 (`exercises.answer`): each accepts the right answer, names
typical wrong ones in words with a hint, and says "not done yet" to a placeholder. What depends on the machine
(a timeline, a memory report) comes from a run here, and the check is judged against that run."""
import math

import numpy as np
import pytest

import torch

import mpedu
from mpedu.core import schedules
from mpedu.course import exercises
from mpedu.predict import balance_by_time, device_footprints, memory_report, simulate

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
         "02.3": dict(report=None, costs=None, placement=None), "06.2": dict(sentences=None),
         "04.3": dict(costs=None, costs32=None, one_device=None, placement=None), "09.2": dict(ranks=None),
         "05.1": dict(model=None, batch=None, costs=None, micro_batches=4),
         "05.2": dict(model=None, batch=None, costs=None, micro_batches=4)}


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


# ---- notebooks 4, 5, 7, 8 and 9 --------------------------------------------------------------------------------

@pytest.mark.parametrize("exercise, right, wrong", [
    ("04.2", "b", {"a": "device 0 waits until the batch has come back", "c": "each GPU holds only some layers"}),
    ("07.2", "a", {"b": "in the steady state a 1F1B device is never idle", "c": "freeing memory saves no compute"}),
    ("07.4", "a", {"b": "the planner says so instead of returning it", "c": "recomputation is already among"}),
    ("08.2", "a", {"b": "the previous step is t + 1", "c": "memory is not what stops it"}),
    ("08.3", "a", {"b": "stage s's layers have states of their own", "c": "reads the layer below's output"}),
    ("09.1", "a", {"b": "the optimizer steps once per batch", "c": "in the order 0, 1, 2, 3"}),
])
def test_the_later_notebooks_choices(exercise, right, wrong):
    test_a_choice_accepts_its_answer_and_explains_each_wrong_one(exercise, right, wrong)


def test_gpipe_s_bubble_for_four_devices():
    says(answer("04.1", (3 / 7, 28)), "correct: bubble 3/7 = 42.9%", "under 10% from m = 28", ok=True)
    says(answer("04.1", (0.75, 28)), "is (p - 1)/m, the papers' bubble", "hint: (p - 1)/(m + p - 1)")
    says(answer("04.1", (0.2, 28)), "the bubble for p = 2 devices")
    says(answer("04.1", (42.9, 28)), "not a percentage")
    says(answer("04.1", (0.43, 27)), "10% exactly, not under 10%")
    says(answer("04.1", (0.43, 31)), "solves (p - 1)/m <= 0.1, the papers' ratio")
    says(answer("04.1", 0.43), "give a pair")


@pytest.fixture(scope="module")
def nb04(corpus):
    torch.manual_seed(0)
    model = mpedu.LSTMLM.from_config("small", vocab_size=len(corpus.vocab), num_layers=4)
    batch = next(b for b in mpedu.BucketIterator(corpus.train, batch_size=32, shuffle=False)
                 if b.bucket == 32 and b.inputs.shape[1] == 32)
    costs = {m: mpedu.profile(model, batch, "vgpu:0", micro_batches=m, warmup=0, repeats=1) for m in (4, 8)}
    costs32 = mpedu.profile(model, batch, "vgpu:0", micro_batches=32, warmup=0, repeats=1)
    return dict(costs=costs, costs32=costs32, one_device=mpedu.Placement.parse("embed,lstm0-3,decode:vgpu0", model),
                placement=mpedu.Placement.parse("embed,lstm0-2:vgpu0 | lstm3,decode:vgpu1", model))


def test_the_speed_up_at_32_micro_batches_is_judged_against_this_profile(nb04):
    speedup, step = {}, {}
    for m, c in ((8, nb04["costs"][8]), (32, nb04["costs32"])):
        step[m] = simulate("gpipe", c, nb04["placement"], micro_batches=m).makespan
        speedup[m] = simulate("gpipe", c, nb04["one_device"], micro_batches=m).makespan / step[m]
    step[4] = simulate("gpipe", nb04["costs"][4], nb04["placement"], micro_batches=4).makespan
    grows, faster = speedup[32] > speedup[8], step[32] < step[4]
    says(answer("04.3", (grows, faster), **nb04), "correct: predicted speed-up", ok=True)
    says(answer("04.3", (not grows, faster), **nb04), "the speed-up " + ("grew" if grows else "did not grow"),
         "hint: the bubble shrinks with m")
    says(answer("04.3", (grows, not faster), **nb04), "a ratio is not a step time")
    says(answer("04.3", (not grows, not faster), **nb04), "the speed-up ")
    says(answer("04.3", ("yes", "no"), **nb04), "give two answers True or False")


@pytest.fixture(scope="module")
def nb05(corpus):
    torch.manual_seed(0)
    model = mpedu.LSTMLM.from_config("small", vocab_size=len(corpus.vocab), num_layers=4)
    batch = next(iter(mpedu.StreamIterator(corpus.train, batch_size=32, bptt=35)))
    costs = mpedu.profile(model, batch, "vgpu:0", micro_batches=4, warmup=0, repeats=1)
    return dict(model=model, batch=batch, costs=costs, micro_batches=4)


def _footprint(nb05, placement):
    gpipe = schedules.make("gpipe", placement.stage_devices, 4)
    return {f.device: f.total for f in device_footprints(nb05["costs"], placement, gpipe)}


def test_the_device_that_needs_the_most_memory(nb05):
    balanced = balance_by_time(nb05["model"], nb05["batch"], 3, micro_batches=4, costs=nb05["costs"])
    need = _footprint(nb05, balanced)
    top = max(need, key=need.get)
    says(answer("05.1", top, **nb05), f"correct: {top} (", "the most of the balanced split", ok=True)
    says(answer("05.1", int(top[-1]), **nb05), "correct: ", ok=True)
    decode = next(str(d) for d, names in balanced.stages if "decode" in names)
    if decode != top:
        says(answer("05.1", decode, **nb05), "decode costs the most *time*")
    other = next(d for d in need if d not in (top, decode))
    says(answer("05.1", other, **nb05), f"not yet: {other} (", f"; {top} (")
    says(answer("05.1", "vgpu:5", **nb05), "the balanced 3-device split runs on vgpu:0, vgpu:1, vgpu:2")


def test_what_the_memory_cap_costs(nb05):
    model, batch, costs = nb05["model"], nb05["batch"], nb05["costs"]
    balanced = balance_by_time(model, batch, 3, micro_batches=4, costs=costs)
    capped = balance_by_time(model, batch, 3, micro_batches=4, memory_cap=40e6, costs=costs)
    assert max(_footprint(nb05, capped).values()) <= 40e6 < max(_footprint(nb05, balanced).values())
    step, capped_step = (simulate("gpipe", costs, p, micro_batches=4).makespan * 1e3 for p in (balanced, capped))
    extra = capped_step - step
    says(answer("05.2", (True, extra), **nb05), f"correct: yes, at {extra:.1f} ms more per step", ok=True)
    says(answer("05.2", (False, extra), **nb05), "balance_by_time(..., memory_cap=40e6) returns")
    says(answer("05.2", (True, capped_step), **nb05), "is the capped step itself")
    says(answer("05.2", (True, -extra), **nb05), "upside down")
    says(answer("05.2", (True, 0), **nb05), "the cap is not free")
    says(answer("05.2", ("yes", extra), **nb05), "with True or False")


def test_the_micro_batches_stage_2_holds_in_1f1b():
    says(answer("07.1", 2), "correct: 2: p - s = 4 - 2", "holds 4 3 2 1", ok=True)
    says(answer("07.1", 1), "stage 2's warm-up forwards")
    says(answer("07.1", 3), "stage 1's: stages count from 0")
    says(answer("07.1", 4), "stage 0's")
    says(answer("07.1", 8), "what GPipe holds")


def test_the_micro_batches_1f1b_needs_on_eight_devices():
    says(answer("07.3", (64, 64)), "correct: m = 64 (9.9%)", ok=True)
    says(answer("07.3", (32, 32)), "m = 32: 17.9%", "hint: the same as GPipe's")
    says(answer("07.3", (64, 8)), "what 1F1B holds")
    says(answer("07.3", (64, 512)), "all 8 devices together")


def test_the_wavefront_s_bubble():
    says(answer("08.1", (3 / 11, 3 / 19)), "correct: 27.3% = 3/11 with m = 1 and 15.8% = 3/19", ok=True)
    says(answer("08.1", (3 / 8, 3 / 19)), "(p - 1)/c, the papers' ratio")
    says(answer("08.1", (3 / 11, 3 / 11)), "16 units of work")
    says(answer("08.1", (3 / 11, 3 / 13)), "multiply, m x c, they do not add")
    says(answer("08.1", (27.3, 15.8)), "not percentages")


def test_the_hand_off_between_two_nodes(corpus):
    from mpedu.distributed import rank_placement
    eight = rank_placement(mpedu.LSTMLM.from_config("mxnet8", vocab_size=len(corpus.vocab)), None, world_size=8)
    says(answer("09.2", ((3, 4), False), ranks=eight), "correct: ", "from rank 3 to rank 4 crosses the network",
         "interleaved is refused", ok=True)
    says(answer("09.2", ((0, 4), False), ranks=eight), "ranks 0 and 4 exchange nothing")
    says(answer("09.2", ((7, 0), False), ranks=eight), "nothing goes from the last rank back to the first")
    says(answer("09.2", ((4, 3), False), ranks=eight), "the forward goes from rank 3 to rank 4")
    says(answer("09.2", ((3, 4), True), ranks=eight), "the hand-off (3, 4) is right; interleaved is refused")
