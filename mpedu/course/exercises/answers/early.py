"""The exercises of notebooks 0, 1, 2 and 6: devices, the language model, naive model parallelism, bucketing."""
from __future__ import annotations

import math

from ....lm import CONFIGS, BucketIterator
from ....predict import simulate
from ....runtime import Link
from ..base import Check
from .common import Exercise, _choice, _device_name, _layers_by_device, _near, _number, _ok, _wrong

# ---- notebook 0 --------------------------------------------------------------------------------------------

def _three_on_two(value) -> Check:
    ratio = _number(value, "three_on_two")
    if isinstance(ratio, Check):
        return ratio
    if 1.4 <= ratio <= 1.6:
        return _ok(f"{ratio:g}: three devices' work is 3/2 of two devices', and the same two cores share it, so each "
                   "device computes at 2/3 of full speed and the step takes about 1.5 times as long")
    if 0.9 <= ratio <= 1.1:
        return _wrong(f"{ratio:g} would mean three devices run at full speed, but only two can compute at any moment "
                      "on two cores", "hint: how much work is there, against two devices', and how many cores share it?")
    if 1.8 <= ratio <= 2.2:
        return _wrong(f"{ratio:g}: twice as long is four devices on two cores (the verdict above): four devices' work "
                      "is twice two devices'", "hint: and three devices' work is how many times two devices'?")
    if ratio < 0.9:
        return _wrong(f"{ratio:g} would be faster than two devices: more devices cannot do more at once than the cores "
                      "allow", "hint: two cores compute at most two devices' work at a time")
    return _wrong(f"{ratio:g} is not it", "hint: count the work (three devices' worth against two) and the cores "
                  "that share it (two in both cases)")


# ---- notebook 1 --------------------------------------------------------------------------------------------

def _perplexity_10k(value) -> Check:
    ppl = _number(value, "perplexity_10k")
    if isinstance(ppl, Check):
        return ppl
    V = 10_000
    if _near(ppl, V, 0.1):
        return _ok(f"about {V:,}: nearly equal logits give each of the V words probability about 1/V; the loss is "
                   "then -ln(1/V) = ln V, and the perplexity exp(ln V) = V")
    if _near(ppl, math.log(V), 0.15):
        return _wrong(f"{ppl:g} is about ln {V:,} = {math.log(V):.2f}: that is the loss, in nats per token",
                      "hint: the perplexity is exp(loss)")
    if 0 < ppl < 0.01:
        return _wrong(f"{ppl:g} is about 1/{V:,}, the probability the untrained model gives each word",
                      "hint: perplexity is the number of equally likely words the model picks among: 1 / that "
                      "probability")
    if _near(ppl, 3289, 0.1):
        return _wrong(f"{ppl:g} is about this corpus's vocabulary (3,289 words); the question is for {V:,} words",
                      "hint: what does the untrained model's perplexity follow?")
    return _wrong(f"{ppl:g} is not it", f"hint: an untrained model spreads its bets evenly: what probability does "
                  f"each of {V:,} words get, and what is exp(-ln(that))?")


def _padding_at_corpus_max(value, lengths, bucket, random) -> Check:
    share = _number(value, "padding_at_corpus_max")
    if isinstance(share, Check):
        return share
    lengths = [int(n) for n in lengths]
    longest, mean = max(lengths), sum(lengths) / len(lengths)
    want = 1 - mean / longest
    in_bucket = 1 - float(bucket.float().mean()) if hasattr(bucket, "float") else 1 - float(bucket.mean())
    in_random = 1 - float(random.mean())
    if abs(share - want) <= 0.01:
        return _ok(f"{want:.1%}: padded to the corpus's longest sentence ({longest} tokens), a sentence fills "
                   f"{mean:.1f} of its {longest} slots on average; the pictures' batches: {in_random:.0%} padding for "
                   f"random sentences, {in_bucket:.0%} in one bucket")
    if 1 < share <= 100:
        return _wrong(f"{share:g}: give a share between 0 and 1 (0.5 for half), not a percentage")
    if abs(share - in_random) <= 0.01:
        return _wrong(f"{share:.1%} is the left picture's padding: random sentences padded to the longest of *their "
                      "batch*", "hint: the corpus's longest sentence is longer than most batches' longest; use "
                      "`lengths`")
    if abs(share - in_bucket) <= 0.01:
        return _wrong(f"{share:.1%} is one bucket's padding (the right picture), not all batches padded to the "
                      "corpus's longest sentence", "hint: use `lengths`: every sentence would take lengths.max() slots")
    if abs(share - mean / longest) <= 0.01:
        return _wrong(f"{share:.1%} is the share of real tokens, not of padding", "hint: padding is the rest")
    return _wrong(f"{share:.1%} is not it", "hint: padded to the corpus's longest sentence, every sentence takes "
                  "lengths.max() slots and fills len(sentence) of them (its <eos> included)")


def _largest_output(value, vocab_size) -> Check:
    small = CONFIGS["small"]
    names = ["embed", *(f"lstm{k}" for k in range(small.num_layers)), "decode"]
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return _wrong(f"largest = {value!r}: give a pair, (layer name, how many times larger), e.g. ('lstm0', 2.5)")
    layer, times = value
    if layer not in names:
        return _wrong(f"{layer!r}: small's layers are {', '.join(names)}")
    if layer != "decode":
        shape = f"(T, B, {small.embed_size if layer == 'embed' else small.hidden_size})"
        return _wrong(f"{layer}'s output is {shape}, no larger than an LSTM layer's (T, B, {small.hidden_size})",
                      "hint: which layer gives a score for every word of the vocabulary at every position?")
    times = _number(times, "how many times larger")
    if isinstance(times, Check):
        return times
    want = vocab_size / small.hidden_size
    if _near(times, want, 0.05):
        return _ok(f"decode's output, (T, B, {vocab_size}), is {want:.1f} times an LSTM layer's (T, B, "
                   f"{small.hidden_size}): a score per word of the vocabulary, against {small.hidden_size} features",
                   "every logit costs a multiply-add per hidden unit, which is why decode dominates the compute")
    if _near(times, 1 / want, 0.05):
        return _wrong(f"{times:g} is upside down: decode's output is the larger one",
                      "hint: divide decode's size by an LSTM layer's")
    tiny = vocab_size / CONFIGS["tiny"].hidden_size
    if _near(times, tiny, 0.05):
        return _wrong(f"{times:g} is the tiny model's ratio (hidden size {CONFIGS['tiny'].hidden_size}); small's "
                      f"LSTM layers have {small.hidden_size} features", "hint: walk the batch through `small`")
    return _wrong(f"decode is right; {times:g} times is not", f"hint: the two outputs are (T, B, {vocab_size}) and "
                  f"(T, B, {small.hidden_size}): T and B are the same, so compare the last dimensions")


# ---- notebook 2 --------------------------------------------------------------------------------------------

STAGE_COSTS = [[1.0, 1.0], [1.0, 3.0], [1.0, 1.0, 1.0], [4.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.5, 2.0, 1.0, 3.0]]


def _naive_bubble(value) -> Check:
    if not callable(value):
        return _wrong(f"naive_bubble = {value!r}: write a function of the stage costs, def naive_bubble(costs): ...")
    free = Link(latency_s=0.0)                      # hand-offs that take no time: the bubble of the schedule alone
    tried = []
    for costs in STAGE_COSTS:
        want = simulate("naive", costs, micro_batches=1, link=free).bubble_fraction
        try:
            got = value(list(costs))
        except NotImplementedError:
            raise
        except Exception as e:
            return _wrong(f"naive_bubble({costs}) raised {type(e).__name__}: {e}")
        got = _number(got, f"naive_bubble({costs})")
        if isinstance(got, Check):
            return got
        tried.append((costs, got, want))
    bad = [(c, g, w) for c, g, w in tried if abs(g - w) > 1e-6]
    if not bad:
        return _ok("the naive bubble is 1 - 1/p = (p - 1)/p for every split of the costs, as the simulator's naive "
                   f"step shows for stage costs {', '.join(str(c) for c in STAGE_COSTS)}",
                   "a chain lasts as long as all its busy times added up: the p devices are busy one step's worth in "
                   "total and idle p - 1 steps' worth, however the layers are split")
    equal = [(c, g, w) for c, g, w in bad if len(set(c)) == 1]
    costs, got, want = equal[0] if equal else bad[0]
    said = f"naive_bubble({costs}) gives {got:.3g} where the simulator's naive step idles {want:.3g} of the time"
    if equal and abs(got) < 1e-9:
        return _wrong(f"{said}: equal stages still leave a bubble in the naive schedule",
                      "hint: 0F0 -> 1F0 -> 1B0 -> 0B0 is a chain: how many devices work at any moment?")
    if equal and abs(got - 1 / len(costs)) < 1e-6:
        return _wrong(f"{said}: 1/p is the share of the step each device works (with equal costs); the bubble is "
                      "the idle share", "hint: bubble = 1 - busy time / (p x step)")
    if equal:
        return _wrong(f"{said}: the bubble grows with the number of devices p",
                      "hint: with p equal stages, each device works 1/p of the step")
    return _wrong(f"{said}: with unequal costs the bubble does not change",
                  "hint: in a chain the step lasts as long as all the busy times added up; bubble = 1 - busy / "
                  "(p x step)")


def _busiest(value, timeline, placement) -> Check:
    device = _device_name(value)
    busy = {d: timeline.busy(d) for d in timeline.devices}
    if device not in busy:
        return _wrong(f"{value!r}: this step ran on {', '.join(busy)}; name one of them")
    held, top = _layers_by_device(placement), max(busy, key=busy.get)
    line = {d: f"{d} ({', '.join(held.get(d, []))}) was busy {busy[d] * 1e3:.1f} ms" for d in busy}
    step = f"of the {timeline.makespan * 1e3:.1f} ms step"
    if device == top:
        why = ("decode gives a score to each of the vocabulary's words at every position: more arithmetic than an "
               "LSTM layer, and a softmax over all of them") if "decode" in held.get(top, []) else \
            "in this run; the profile above found decode the dearest layer, so look again after a rerun"
        return _ok(f"{line[top]} {step}, the most", why)
    return _wrong(f"{line[device]} {step}; {line[top]}",
                  "hint: the busiest device is the one with the longest boxes; which layer did the profile above "
                  "find the dearest?")


def _more_activations(value, report, costs, placement) -> Check:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return _wrong(f"more_activations = {value!r}: give a pair, (device, [its layers that keep them]), e.g. "
                      "('vgpu:0', ['embed'])")
    device, layers = _device_name(value[0]), value[1]
    layers = {layers} if isinstance(layers, str) else set(layers)
    peak = {d.device: d.peak_activations for d in report.devices}
    if device not in peak:
        return _wrong(f"{value[0]!r}: the report's devices are {', '.join(peak)}")
    top = max(peak, key=peak.get)
    mb = {d: f"{b / 1e6:.1f} MB" for d, b in peak.items()}
    if device != top:
        return _wrong(f"{device} holds {mb[device]} of activations, {top} {mb[top]} (the report's 'activations "
                      "(peak)' column)", "hint: count the layers on each device that keep a large tensor for the "
                      "backward")
    held = _layers_by_device(placement)
    act = dict(zip(costs.names, costs.activation_bytes))
    keep = {n for n in held[top] if act[n] >= 0.25 * max(act[k] for k in held[top])}
    kept = ", ".join(f"{n} {act[n] / 1e6:.1f} MB" for n in held[top])
    for n in sorted(layers - set(held[top])):
        where = next((d for d, names in held.items() if n in names), None)
        return _wrong(f"{n} is not on {top}" + (f": it is on {where}" if where else f"; {top} holds {kept}"))
    if layers - keep:
        n = sorted(layers - keep)[0]
        return _wrong(f"{n} keeps only {act[n] / 1e6:.2f} MB for its backward (the profile's act MB column)",
                      "hint: which of the device's layers keep a large tensor?")
    if keep - layers:
        n = sorted(keep - layers)[0]
        return _wrong(f"{top} is right, but {n} keeps {act[n] / 1e6:.1f} MB too (the profile's act MB column: "
                      f"{kept})", "hint: how many of its layers keep about as much as an LSTM layer?")
    low = min(peak, key=peak.get)
    return _ok(f"{top} holds {mb[top]} of activations against {low}'s {mb[low]}: "
               f"{' and '.join(sorted(keep))} keep their tensors for the backward ({kept})",
               "an LSTM layer keeps its gates at every time step, the decoder its (T, B, V) logits for the softmax's "
               f"backward: about as much each, so {top} holds {peak[top] / max(peak[low], 1):.1f} times as much")


# ---- notebook 6 --------------------------------------------------------------------------------------------

def _skipped(value, sentences, batch_size: int = 32) -> Check:
    n = _number(value, "skipped")
    if isinstance(n, Check):
        return n
    every = list(BucketIterator(sentences, batch_size=batch_size))
    kept = sum(b.inputs.shape[1] for b in BucketIterator(sentences, batch_size=batch_size, drop_last=True))
    total = sum(b.inputs.shape[1] for b in every)
    skipped, dropped = total - kept, sum(1 for b in every if b.inputs.shape[1] < batch_size)
    buckets = len({b.bucket for b in every})
    if n == skipped:
        return _ok(f"{skipped} of {total:,} sentence pieces ({skipped / total:.1%}): each bucket's last batch, "
                   f"smaller than {batch_size}", "train() pads those batches with empty columns instead of "
                   "dropping them, so every sentence is trained on")
    if n == dropped:
        return _wrong(f"{n:g} counts the batches drop_last skips (len(...) is a number of batches)",
                      "hint: add up how many sentences each skipped batch holds (b.inputs.shape[1])")
    if n == buckets * (batch_size - 1):
        return _wrong(f"{n:g} is the most it could skip, {batch_size - 1} per bucket",
                      "hint: count the real widths: b.inputs.shape[1], with and without drop_last")
    if n == 0:
        return _wrong("drop_last skips each bucket's last batch when it holds fewer than "
                      f"{batch_size} sentences", "hint: count the sentences with and without it")
    return _wrong(f"{n:g} is not it", "hint: add up b.inputs.shape[1] over BucketIterator(corpus.train, "
                  "batch_size=32, drop_last=True), and again without drop_last, and subtract")


EARLY: dict[str, Exercise] = {
    "00.1": _choice(
        "set `bigger_work` to the letter of your answer", "what does each job cost besides its arithmetic, and does "
        "that part grow with H?", "a", {
            "a": ("Bigger work comes closer to 2x: what a job costs besides its compute (starting it, Python between "
                  "the kernels, the hand-offs) stays the same, and weighs less against more compute.",
                  "very small work (H = 64) overlaps worse, for the same reason"),
            "b": ("Bigger work overlaps worse: a longer job holds Python's lock (the GIL) longer, so the other device "
                  "waits.",
                  "hint: PyTorch lets go of the GIL while its kernels compute, which is why two threads overlap at "
                  "all; the Python between the kernels is the same for a bigger H, so it weighs less"),
            "c": ("It does not change: the number of idle cores alone sets the speed-up.",
                  "hint: the cores set the most it can be (2x on two); how close a run gets depends on how much of "
                  "each job is compute. Try H = 64"),
        }),
    "00.2": Exercise("set `three_on_two` to how many times as long three devices at once take as two devices at "
                     "once, both on a machine with two idle cores (a number, e.g. 1.2)",
                     "count the work, and the cores that share it", _three_on_two),
    "00.3": _choice(
        "set `same_layer` to the letter of your answer", "what does a backward write, and where?", "b", {
            "a": ("Nothing: each device has its own thread, so the two backwards are independent.",
                  "hint: the threads are separate, but the layer is one: what do both backwards write into?"),
            "b": ("Both backwards add into the same `.grad` tensors from two threads at once: the result depends on "
                  "timing, and one addition can be lost.",
                  "PyTorch's docs call such concurrent accumulation unsafe. In a pipeline a layer lives on one "
                  "device, and only that device's thread touches its parameters"),
            "c": ("They deadlock: each backward waits for the other to finish.",
                  "hint: neither backward waits for anything from the other; the trouble is what both write"),
        }),
    "01.1": Exercise("set `perplexity_10k` to the untrained model's perplexity for a vocabulary of 10,000 words",
                     "an untrained model spreads its bets evenly over the vocabulary", _perplexity_10k),
    "01.2": Exercise("set `padding_at_corpus_max` to the share of a batch that would be padding (0.5 for half) if "
                     "every batch were padded to the corpus's longest sentence",
                     "padding is 1 - real tokens / slots: how many slots does each sentence take?",
                     _padding_at_corpus_max,
                     needs=("lengths", "bucket", "random")),
    "01.3": Exercise("set `largest` to (layer name, how many times larger its output is than an LSTM layer's)",
                     "walk `big.inputs` through `small` and print each output's shape", _largest_output,
                     needs=("vocab_size",)),
    "02.1": Exercise("write `naive_bubble(costs)`: the naive schedule's bubble for one micro-batch, where costs[s] "
                     "is stage s's forward and backward time", "in a chain, how many devices work at any moment?",
                     _naive_bubble),
    "02.2": Exercise("set `busiest` to the name of the busiest device of the three-device step, e.g. \"vgpu:0\"",
                     "look at the timeline's boxes, and at the profile's costs per layer", _busiest,
                     needs=("timeline", "placement")),
    "02.3": Exercise("set `more_activations` to (device, [its layers that keep the activations])",
                     "read the report's 'activations (peak)' column, and the profile's act MB column",
                     _more_activations, needs=("report", "costs", "placement")),
    "06.1": _choice(
        "set `split_by` to the letter of your answer", "which can be computed without the others: a sentence, or a "
        "time step?", "a", {
            "a": ("A batch's columns are independent sentences, so its micro-batches can run in any order, on "
                  "different devices at once; its rows are time steps, and an LSTM's step t needs the state of step "
                  "t - 1.",
                  "notebook 8 does cut along time, and has to respect that dependency"),
            "b": ("Columns are contiguous in memory, so cutting them is cheaper.",
                  "hint: in time-major data each row (time step) is contiguous, not each column (notebook 1); the "
                  "reason is what one piece needs from another"),
            "c": ("Cut by rows, the micro-batches would hold different numbers of tokens.",
                  "hint: columns hold different numbers of tokens too (a bucket's sentences differ in length); what "
                  "matters is whether one piece needs another's result"),
        }),
    "06.2": Exercise("set `skipped` to how many sentences (pieces) one epoch of BucketIterator(corpus.train, "
                     "batch_size=32, drop_last=True) skips", "add up b.inputs.shape[1] over the batches, with and "
                     "without drop_last", _skipped, needs=("sentences",)),
    "06.3": _choice(
        "set `shuffled` to the letter of your answer", "what does a stage keep per micro-batch between windows, and "
        "whose is it?", "a", {
            "a": ("Micro-batch 0's kept state belongs to streams 0-7: after a shuffle, micro-batch 0 would carry on "
                  "other streams from the wrong context.",
                  "the loss would be that of a model with scrambled memory; no error would say so"),
            "b": ("Nothing: each column is an independent sentence, as with buckets.",
                  "hint: in stream mode a column is a stream that goes on in the next window (the stream-mode cell printed "
                  "stream 0's window 0 and window 1)"),
            "c": ("The shapes between stages would stop matching.",
                  "hint: shuffling columns keeps every shape, (bptt, B/m, H) all the way; what changes is which "
                  "stream sits in micro-batch 0"),
        }),
}
