"""Bucketed and streamed batches: nothing lost, nothing duplicated, masks and shifts right."""
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import FUZZ
from mpedu.lm import Batch, BucketIterator, StreamIterator, default_buckets, padding_fraction


EOS_ID = 2


def expected_pieces(sentences, cap):
    """What the iterator should produce: (inputs, targets) of each piece, cut at the largest bucket."""
    out = Counter()
    for s in sentences:
        inputs = [EOS_ID] + s.tolist()[:-1]
        for start in range(0, len(s), cap):
            out[tuple(inputs[start:start + cap]), tuple(s.tolist()[start:start + cap])] += 1
    return out


def produced_pieces(batches):
    out = Counter()
    for b in batches:
        for j in range(b.inputs.shape[1]):
            n = int(b.mask[:, j].sum())
            out[tuple(b.inputs[:n, j].tolist()), tuple(b.targets[:n, j].tolist())] += 1
    return out


def check_batch(b: Batch, batch_size: int):
    T, B = b.inputs.shape
    assert b.targets.shape == b.mask.shape == (T, B) and 1 <= B <= batch_size
    assert b.inputs.dtype == b.targets.dtype == torch.int64 and b.mask.dtype == torch.bool
    assert torch.equal(b.mask, b.targets != 0)
    # Each column is a prefix of real tokens, then only padding: the mask never has holes.
    n = b.mask.sum(0)
    assert torch.equal(b.mask, torch.arange(T)[:, None] < n[None, :])
    assert (b.inputs[~b.mask] == 0).all(), "padding positions must hold <pad> in the inputs too"
    # Inputs are the targets shifted down by one step (the first input comes from before the column).
    assert torch.equal(b.inputs[1:][b.mask[1:]], b.targets[:-1][b.mask[1:]])
    assert b.tokens == int(n.sum())


# ---- BucketIterator on the embedded corpus ----------------------------------------------------

def test_every_token_is_a_target_exactly_once_per_epoch(corpus):
    it = BucketIterator(corpus.train, batch_size=32, seed=3)
    batches = list(it)
    assert len(batches) == len(it)
    assert produced_pieces(batches) == expected_pieces(corpus.train, it.buckets[-1])
    assert sum(b.tokens for b in batches) == corpus.tokens("train")
    assert it.stats().split_sentences == sum(len(s) > it.buckets[-1] for s in corpus.train) > 0


def test_batches_are_time_major_padded_to_their_bucket(corpus):
    it = BucketIterator(corpus.valid, batch_size=16)
    partial = Counter()
    for b in it:
        check_batch(b, 16)
        assert b.inputs.shape[0] == b.bucket and b.bucket in it.buckets and not b.carry_state
        partial[b.bucket] += b.inputs.shape[1] < 16
    assert max(partial.values()) <= 1, "only the last batch of a bucket may be smaller"
    # A whole sentence (first input <eos>) sits in the smallest bucket that holds it.
    for b in it:
        n = b.mask.sum(0)
        whole = b.inputs[0] == EOS_ID
        smaller = [x for x in it.buckets if x < b.bucket]
        if smaller and whole.any():
            assert (n[whole] > smaller[-1]).all()


def test_split_pieces_continue_the_sentence():
    s = torch.arange(10, 30)  # 20 tokens, distinct so the order is visible
    batches = list(BucketIterator([s], batch_size=4, buckets=[8], shuffle=False))
    cols = [(b.inputs[:, j], b.targets[:, j], b.mask[:, j]) for b in batches for j in range(b.inputs.shape[1])]
    cols.sort(key=lambda c: int(c[1][0]))
    assert [c[1][c[2]].tolist() for c in cols] == [list(range(10, 18)), list(range(18, 26)), list(range(26, 30))]
    assert [int(c[0][0]) for c in cols] == [EOS_ID, 17, 25]  # each piece starts from the last target before it


def test_same_seed_and_epoch_repeat_and_another_epoch_reshuffles(corpus):
    def order(seed, epoch):
        it = BucketIterator(corpus.valid, batch_size=8, seed=seed)
        it.set_epoch(epoch)
        return [b.targets.tolist() for b in it]
    assert order(0, 1) == order(0, 1)
    assert order(0, 1) != order(0, 2)
    assert order(0, 1) != order(1, 1)
    unshuffled = BucketIterator(corpus.valid, batch_size=8, shuffle=False)
    assert [b.bucket for b in unshuffled] == sorted(b.bucket for b in unshuffled)


def test_default_buckets_keep_padding_low_and_pad_to_longest_costs_much_more(corpus):
    it = BucketIterator(corpus.train, batch_size=32)
    stats = it.stats()
    summary = f"buckets {stats.buckets}\n{stats}"
    assert stats.padding_fraction < 0.10, summary
    assert stats.longest_padding_fraction > 3 * stats.padding_fraction, summary
    assert stats.max_padding_fraction > stats.longest_padding_fraction, summary
    assert stats.max_padded_slots > stats.longest_padded_slots > stats.padded_slots, summary
    assert stats.tokens == corpus.tokens("train") and sum(stats.batches.values()) == len(it)
    mxnet = BucketIterator(corpus.train, batch_size=32, buckets=[8, 16, 24, 32, 60]).stats()
    assert mxnet.padding_fraction > stats.padding_fraction, summary


def test_default_buckets_rule():
    lengths = [5] * 50 + [10] * 40 + [30] * 9 + [100]
    b = default_buckets(lengths)
    assert b == sorted(b) and b[-1] == 30  # the 99th percentile: the one 100-token sentence is split
    assert padding_fraction(lengths, b) <= 0.08
    assert default_buckets([7, 7, 7]) == [7]
    with pytest.raises(ValueError, match="at least one"):
        default_buckets([])


def test_drop_last_keeps_every_batch_full(corpus):
    it = BucketIterator(corpus.valid, batch_size=16, drop_last=True)
    batches = list(it)
    assert len(batches) == len(it) and all(b.inputs.shape[1] == 16 for b in batches)


@pytest.mark.parametrize("buckets, message", [
    ([], "buckets is empty"),
    ([8, 0, 16], "every bucket length must be a positive integer, got 0"),
    ([8, -4], "got -4"),
    ([8, 8, 16], r"lists a length twice"),
    ([8, 2.5], "got 2.5"),
])
def test_bad_bucket_lists_are_clear_errors(buckets, message):
    with pytest.raises(ValueError, match=message):
        BucketIterator([torch.tensor([3, 4, 2])], batch_size=2, buckets=buckets)


def test_unsorted_buckets_are_sorted_and_numpy_integers_accepted():
    assert BucketIterator([torch.tensor([3, 4, 2])], batch_size=2, buckets=[16, 4, 8]).buckets == [4, 8, 16]
    assert BucketIterator([torch.tensor([3, 2])], batch_size=np.int64(2), buckets=np.array([4, 2])).buckets == [2, 4]


@pytest.mark.parametrize("batch_size", [0, -1, 2.0])
def test_bad_batch_size_is_a_clear_error(batch_size):
    with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {batch_size}"):
        BucketIterator([torch.tensor([3, 2])], batch_size=batch_size)


def test_bad_sentences_are_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        BucketIterator([], batch_size=2)
    with pytest.raises(ValueError, match="sentence 1 must be a non-empty 1-D tensor"):
        BucketIterator([torch.tensor([3, 2]), torch.tensor([], dtype=torch.int64)], batch_size=2)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
       buckets=st.lists(st.integers(1, 25), min_size=1, max_size=5, unique=True),
       batch_size=st.integers(1, 7), seed=st.integers(0, 3))
def test_exactly_once_for_any_sentences_and_buckets(lengths, buckets, batch_size, seed):
    # Every token id is distinct (>= 3), so each target and its input can be traced back to its place.
    ids = iter(range(3, 3 + sum(lengths)))
    sentences = [torch.tensor([next(ids) for _ in range(n)]) for n in lengths]
    previous = {int(s[i]): (int(s[i - 1]) if i else EOS_ID) for s in sentences for i in range(len(s))}
    targets = []
    for b in BucketIterator(sentences, batch_size, buckets, seed=seed):
        check_batch(b, batch_size)
        assert b.inputs.shape[0] == b.bucket
        targets += b.targets[b.mask].tolist()
        assert [previous[t] for t in b.targets[b.mask].tolist()] == b.inputs[b.mask].tolist()
    assert sorted(targets) == list(range(3, 3 + sum(lengths)))


# ---- Batch.split ------------------------------------------------------------------------------

def test_split_into_micro_batches_keeps_columns_in_order(corpus):
    batch = next(b for b in BucketIterator(corpus.valid, batch_size=12) if b.inputs.shape[1] == 12)
    for m in (1, 2, 3, 4, 6, 12):
        parts = batch.split(m)
        assert len(parts) == m and all(p.bucket == batch.bucket and p.carry_state == batch.carry_state for p in parts)
        assert torch.equal(torch.cat([p.inputs for p in parts], 1), batch.inputs)
        assert torch.equal(torch.cat([p.mask for p in parts], 1), batch.mask)
        assert sum(p.tokens for p in parts) == batch.tokens


@pytest.mark.parametrize("m, message", [
    (3, r"micro_batches=3 does not divide the batch size 32; pick a divisor of 32 such as 1, 2, 4, 8, 16, 32"),
    (0, r"micro_batches=0 is not a positive integer"),
    (2.0, r"micro_batches=2.0 is not a positive integer"),
    (64, r"micro_batches=64 is more than the batch size 32"),
])
def test_split_errors_name_the_values(m, message):
    batch = Batch(torch.ones(5, 32, dtype=torch.int64), torch.ones(5, 32, dtype=torch.int64),
                  torch.ones(5, 32, dtype=torch.bool), bucket=5, carry_state=False)
    with pytest.raises(ValueError, match=message):
        batch.split(m)


# ---- StreamIterator ---------------------------------------------------------------------------

def test_stream_reads_every_token_once_in_order(corpus):
    it = StreamIterator(corpus.valid, batch_size=7, bptt=35)
    batches = list(it)
    assert len(batches) == len(it)
    for b in batches:
        check_batch(b, 7)
        assert b.carry_state and b.bucket == 35 and b.inputs.shape[1] == 7
    assert all(b.inputs.shape[0] == 35 for b in batches[:-1]) and 1 <= batches[-1].inputs.shape[0] <= 35
    # Stream j, read window after window, is the j-th piece of the corpus: together, the corpus once.
    stream_targets = torch.cat([b.targets for b in batches])  # (n, B)
    stream_inputs = torch.cat([b.inputs for b in batches])
    flat = corpus.valid.cat()
    mask = stream_targets != 0
    assert torch.equal(stream_targets.t()[mask.t()], flat)
    assert torch.equal(stream_inputs.t()[mask.t()], torch.cat([torch.tensor([EOS_ID]), flat[:-1]]))
    # The state carries over: each window's first input is the previous window's last target.
    for prev, nxt in zip(batches, batches[1:]):
        assert torch.equal(nxt.inputs[0][nxt.mask[0]], prev.targets[-1][nxt.mask[0]])


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=15), batch_size=st.integers(1, 6),
       bptt=st.integers(1, 12))
def test_stream_exactly_once_property(lengths, batch_size, bptt):
    total = sum(lengths)
    if total < batch_size:
        with pytest.raises(ValueError, match="is more than the [0-9]+ tokens there are to cut into"):
            StreamIterator([torch.arange(3, 3 + n) for n in lengths], batch_size, bptt)
        return
    ids = iter(range(3, 3 + total))
    sentences = [torch.tensor([next(ids) for _ in range(n)]) for n in lengths]
    targets = [t for b in StreamIterator(sentences, batch_size, bptt) for t in b.targets[b.mask].tolist()]
    assert sorted(targets) == list(range(3, 3 + total))


def test_stream_bad_arguments():
    with pytest.raises(ValueError, match="bptt must be a positive integer, got 0"):
        StreamIterator([torch.tensor([3, 2])], batch_size=1, bptt=0)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        StreamIterator([torch.tensor([3, 2])], batch_size=0, bptt=5)


# ---------------------------------------------------------------- bad bucket lists, fuzzed

@given(st.lists(st.one_of(st.integers(-2, 40), st.floats(0, 40), st.sampled_from(["8", None])), max_size=5))
@FUZZ
def test_bucket_lists_work_or_name_the_bad_value(little, buckets):
    try:
        batches = BucketIterator(little.train[:30], 4, buckets)
    except ValueError as e:
        assert "bucket" in str(e)
    else:
        assert sum(b.tokens for b in batches) == sum(len(s) for s in little.train[:30])
