"""The embedded corpus: deterministic, PTB-like in size and shape, and worth learning."""
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mpedu.lm import load_corpus, synthetic

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"


@pytest.fixture(scope="module")
def corpus():
    return synthetic.generate(0)


def test_generation_is_deterministic_and_fast():
    start = time.perf_counter()
    a = synthetic.generate(0)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"generating the corpus took {elapsed:.2f} s"
    assert a == synthetic.generate(0)
    assert a["train"][:50] != synthetic.generate(1)["train"][:50]


def test_committed_files_match_the_generator_byte_for_byte(tmp_path):
    synthetic.write(tmp_path, seed=0)
    for split in ("train", "valid", "test"):
        name = f"ptb.{split}.txt"
        assert (tmp_path / name).read_bytes() == (EMBEDDED / name).read_bytes(), (
            f"data/embedded/{name} is stale; regenerate it with "
            f"python -c \"from mpedu.lm import synthetic; synthetic.write('data/embedded')\"")


def test_splits_have_their_own_random_stream():
    small = synthetic.generate(0, n_train=10, n_valid=5, n_test=5)
    full = synthetic.generate(0)
    assert small["valid"] == full["valid"][:5] and small["train"] == full["train"][:10]


def test_sizes_and_lengths_are_ptb_like(corpus):
    tokens = {s: sum(len(w) + 1 for w in sents) for s, sents in corpus.items()}  # +1: <eos>
    assert 190_000 <= tokens["train"] <= 210_000, tokens
    assert 18_000 <= tokens["valid"] <= 22_000 and 18_000 <= tokens["test"] <= 22_000, tokens
    lengths = np.array([len(w) + 1 for w in corpus["train"]])
    # PTB valid: mean 21.9, median 21, 99th percentile 48, longest 75.
    assert 19 <= lengths.mean() <= 25, lengths.mean()
    assert 45 <= np.quantile(lengths, 0.99) <= 65
    assert (lengths > 60).sum() >= 10, "no tail of long sentences"
    assert lengths.min() >= 3


def test_vocabulary_is_zipfian_and_a_few_thousand_words(corpus):
    counts = Counter(w for words in corpus["train"] for w in words)
    assert 2_500 <= len(counts) <= 4_000, len(counts)
    freq = np.sort(np.array(list(counts.values())))[::-1]
    top = freq[: len(freq) // 10].sum() / freq.sum()
    assert top > 0.6, f"the 10% most frequent words cover only {top:.0%} of tokens"
    assert (freq <= 3).sum() > 100, "no rare words: real text has a long tail"


def test_words_are_pronounceable_letters(corpus):
    for w in {w for words in corpus["train"][:500] for w in words}:
        assert w.isalpha() and w.islower() and len(w) <= 14, w


def test_subject_pronouns_agree_with_their_verb(corpus):
    """'hi' (he) takes a singular verb ending in -s, 'tey' (they) the bare stem."""
    adverbs = {w for ws in synthetic._Language(0).advs.topic_words for w in ws}
    seen = Counter()
    for words in corpus["train"]:
        for i, w in enumerate(words[:-1]):
            if w in (synthetic.PRON_SG, synthetic.PRON_PL):
                verb = words[i + 2] if words[i + 1] in adverbs else words[i + 1]
                assert verb.endswith("s") == (w == synthetic.PRON_SG), " ".join(words)
                seen[w] += 1
    assert seen[synthetic.PRON_SG] > 100 and seen[synthetic.PRON_PL] > 100


def _bigram_perplexity(train, test, V, d=0.75):
    """Interpolated absolute discounting (Kneser-Ney's simpler cousin) over add-one unigrams."""
    uni = np.bincount(np.concatenate(train), minlength=V) + 1.0
    uni[0] = 0
    uni /= uni.sum()
    pairs, ctx = Counter(), Counter()
    for s in train:
        seq = [2] + s.tolist()  # the model sees <eos> before the first word
        pairs.update(zip(seq, seq[1:]))
        ctx.update(seq[:-1])
    followers = Counter(a for a, _ in pairs)  # distinct words seen after each word
    logp, n = 0.0, 0
    for s in test:
        seq = [2] + s.tolist()
        for a, b in zip(seq, seq[1:]):
            c = ctx[a]
            p = (max(pairs[a, b] - d, 0) + d * followers[a] * uni[b]) / c if c else uni[b]
            logp += math.log(p)
            n += 1
    return math.exp(-logp / n)


def test_corpus_has_structure_a_model_can_learn():
    c = load_corpus()
    unigram = c.unigram_perplexity("test")
    bigram = _bigram_perplexity(c.train, c.test, len(c.vocab))
    assert 200 <= unigram <= 800, f"unigram perplexity {unigram:.1f}"
    assert bigram < 0.55 * unigram, f"bigram {bigram:.1f} vs unigram {unigram:.1f}: too little structure"
