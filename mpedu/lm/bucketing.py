"""Time-major (T, B) batches with a mask: sentences grouped into length buckets, or one long stream."""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .reading import EOS_ID, PAD_ID
from .sentences import Sentences


@dataclass
class Batch:
    """One step's data; the model reads `inputs` and is scored on `targets` where `mask` is True."""

    inputs: torch.Tensor   # (T, B) int64; column b is [<eos>, w1, ..., wn] for a sentence [w1, ..., wn, <eos>]
    targets: torch.Tensor  # (T, B) int64; the inputs shifted by one, <pad> (0) below the end of the sentence
    mask: torch.Tensor     # (T, B) bool; True exactly where a target is a real token (targets != 0)
    bucket: int            # the bucket length T (StreamIterator: bptt)
    carry_state: bool      # True: this batch continues the previous one, keep the LSTM state (stream mode)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device) -> "Batch":
        move = lambda x: x.to(device)  # noqa: E731
        return Batch(move(self.inputs), move(self.targets), move(self.mask), self.bucket, self.carry_state)

    def steps(self, start: int, end: int) -> "Batch":
        """Time steps start..end-1 of every sequence: a time chunk, or (from 0) a shorter bucket of the same
        sentences; its bucket length is its own."""
        return Batch(self.inputs[start:end], self.targets[start:end], self.mask[start:end], end - start,
                     self.carry_state)

    def split(self, m) -> list["Batch"]:
        """The pipeline's unit of work, in order: m micro-batches of B/m columns each, or, for a list of
        sizes (check_sizes), micro-batches of those widths, side by side:

            split(4)             on B = 8: columns 0-1 | 2-3 | 4-5 | 6-7
            split([1, 3, 2, 2])  on B = 8: columns 0 | 1-3 | 4-5 | 6-7
        """
        B = self.inputs.shape[1]
        if isinstance(m, (list, tuple)):
            sizes = check_sizes(m, B)
            # one copy per micro-batch and tensor: each is a contiguous (T, b_i) block, as the equal split's
            edges = list(itertools.accumulate(sizes, initial=0))
            cut = lambda x: [x[:, lo:hi].contiguous() for lo, hi in zip(edges, edges[1:])]  # noqa: E731
            return [Batch(*parts, self.bucket, self.carry_state)
                    for parts in zip(cut(self.inputs), cut(self.targets), cut(self.mask))]
        bad_type = isinstance(m, bool) or not isinstance(m, numbers.Integral)
        if bad_type or m < 1 or m > B or B % m:
            divisors = ", ".join(str(d) for d in range(1, B + 1) if B % d == 0)
            why = "is not a positive integer" if bad_type or m < 1 else (
                f"is more than the batch size {B}" if m > B else f"does not divide the batch size {B}")
            unequal = f", or unequal sizes adding up to {B} (a list such as [{B - B // 2}, {B // 2}])" if B > 1 else ""
            raise ValueError(f"micro_batches={m} {why}; pick a divisor of {B} such as {divisors}{unequal}. "
                             f"(The last batch of a bucket can be smaller than batch_size; "
                             f"BucketIterator(drop_last=True) keeps every batch full.)")
        m, T = int(m), self.inputs.shape[0]
        # One copy per tensor, (T, B) -> (m, T, B/m), then views: micro-batch i is the contiguous block i,
        # columns i*B/m .. (i+1)*B/m - 1. The pipeline splits every batch it runs, so this is on its hot path.
        cut = lambda x: x.reshape(T, m, B // m).transpose(0, 1).contiguous().unbind(0)  # noqa: E731
        return [Batch(*parts, self.bucket, self.carry_state)
                for parts in zip(cut(self.inputs), cut(self.targets), cut(self.mask))]


def check_sizes(sizes, width: int | None = None) -> tuple[int, ...]:
    """Unequal micro-batches: `sizes`, sentence counts (batch columns) side by side, each a whole number
    >= 1, adding up to the batch width `width` when it is given. Returned as a tuple; ValueError naming
    the values (and the width) otherwise. Micro-batch i is columns sum(sizes[:i]) .. sum(sizes[:i+1]) - 1."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple)):
        raise ValueError(f"micro-batch sizes must be a list of sentence counts such as [8, 16, 24, 16], "
                         f"got {sizes!r}")
    values = list(sizes)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1]
    if not values or bad:
        why = "is empty" if not values else f"holds {bad[0]!r}"
        raise ValueError(f"micro-batch sizes {values} {why}: each micro-batch is a whole number >= 1 of "
                         "sentences (batch columns), e.g. [8, 16, 24, 16]")
    values = [int(v) for v in values]
    if width is not None and sum(values) != width:
        raise ValueError(f"micro-batch sizes {values} add up to {sum(values)} sentences, but the batch is "
                         f"{width} wide; give sizes that add up to the batch width {width} (the last batch of a "
                         "bucket can be narrower: mpedu.core.fit_width pads it to the sizes' sum)")
    return tuple(values)


@dataclass
class BucketStats:
    """One epoch's batches; a "slot" is one (t, b) position of a batch, a token or padding."""

    buckets: list[int]
    batches: dict[int, int]      # bucket length -> batches in the epoch
    pieces: dict[int, int]       # bucket length -> sentences (or pieces of split sentences) in it
    tokens: int                  # real target tokens
    padded_slots: int            # slots holding <pad>
    split_sentences: int         # sentences longer than the largest bucket, cut into pieces
    longest_padded_slots: int    # padding if batches of random sentences were padded to their longest
    max_padded_slots: int        # padding if every sentence were padded to the longest in the corpus

    @staticmethod
    def _fraction(padded: int, tokens: int) -> float:
        return padded / (padded + tokens)

    @property
    def padding_fraction(self) -> float:
        return self._fraction(self.padded_slots, self.tokens)

    @property
    def longest_padding_fraction(self) -> float:
        return self._fraction(self.longest_padded_slots, self.tokens)

    @property
    def max_padding_fraction(self) -> float:
        return self._fraction(self.max_padded_slots, self.tokens)

    def __str__(self) -> str:
        rows = [f"{'bucket':>6} {'batches':>7} {'pieces':>7}"]
        rows += [f"{b:>6} {self.batches[b]:>7} {self.pieces[b]:>7}" for b in self.buckets]
        rows.append(f"{self.tokens:,} tokens, {self.split_sentences} sentences split; padding: "
                    f"buckets {self.padding_fraction:.1%}, "
                    f"pad to batch longest {self.longest_padding_fraction:.1%}, "
                    f"pad to corpus max {self.max_padding_fraction:.1%}")
        return "\n".join(rows)


def padding_fraction(lengths, buckets) -> float:
    """Fraction of slots that are padding when these lengths are bucketed (longer ones split)."""
    lengths, buckets = np.asarray(lengths), np.sort(buckets)
    cap = buckets[-1]
    rest = np.where(lengths % cap == 0, cap, lengths % cap)  # the last (or only) piece of each sentence
    padded = int((buckets[np.searchsorted(buckets, rest)] - rest).sum())  # full pieces need no padding
    return padded / (padded + int(lengths.sum()))


def default_buckets(lengths, max_padding: float = 0.08, cover: float = 0.99, max_buckets: int = 16) -> list[int]:
    """Bucket lengths from the length distribution (lengths include <eos>).

    Rule: k equal-count buckets, i.e. the length quantiles 1/k, ..., (k-1)/k, then the largest bucket at
    the `cover` quantile (the 1% longest sentences are split); k is the smallest that keeps padding at
    or under `max_padding`. Fewer buckets mean fewer distinct shapes (MXNet: one unrolled graph each)
    but more padding; MXNet's PTB example used [8, 16, 24, 32, 60], about 21% padding.
    """
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        raise ValueError("default_buckets needs at least one sentence length")
    # "inverted_cdf": the q-quantile is the shortest length that at least a fraction q of sentences fit in.
    quantile = lambda q: np.quantile(lengths, q, method="inverted_cdf").astype(int).tolist()  # noqa: E731
    cap = quantile(cover)
    for k in range(1, max_buckets + 1):
        buckets = sorted({b for b in quantile(np.arange(1, k) / k) if b < cap} | {cap})
        if padding_fraction(lengths, buckets) <= max_padding:
            break
    return buckets


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _as_sentences(sentences) -> Sentences:
    """A split's Sentences as they are; a list of 1-D int64 tensors checked, then made one."""
    if hasattr(sentences, "train") and hasattr(sentences, "vocab"):
        raise TypeError("batch one split of the corpus, e.g. BucketIterator(corpus.train, batch_size), not the "
                        "whole corpus")
    if len(sentences) == 0:
        raise ValueError("no sentences to batch: the list is empty")
    if isinstance(sentences, Sentences):
        empty = np.flatnonzero(sentences.lengths() == 0)
        if len(empty):
            raise ValueError(f"sentence {int(empty[0])} is empty: each needs at least its <eos>")
        return sentences
    for i, s in enumerate(sentences):
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or len(s) == 0 or s.dtype != torch.int64:
            raise ValueError(f"sentence {i} must be a non-empty 1-D tensor of int64 token ids, got {s!r}")
    return Sentences.from_tensors(sentences)


def _pieces(sentences: Sentences, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every sentence cut into pieces of at most `cap` tokens, in corpus order: where each starts in the ids,
    its length, and its first input (<eos> at a sentence's start, else the previous piece's last target).

        sentence of 7, cap 3:   [a b c | d e f | g]   ->  starts s, s+3, s+6; lengths 3, 3, 1"""
    offsets, lengths = sentences.offsets[:-1], sentences.lengths()
    if len(lengths) == 0 or lengths.max() <= cap:                   # no sentence is cut: one piece each
        return offsets, lengths.astype(np.int32), np.full(len(lengths), EOS_ID, dtype=np.int32)
    count = -(-lengths // cap)                                      # pieces per sentence
    before = np.repeat(np.cumsum(count) - count, count)             # the sentence's first piece's index
    into = cap * (np.arange(int(count.sum())) - before)             # tokens of the sentence before the piece
    starts = np.repeat(offsets, count) + into
    piece_lengths = np.minimum(cap, np.repeat(lengths, count) - into).astype(np.int32)
    first = np.full(len(starts), EOS_ID, dtype=np.int32)
    later = into > 0
    first[later] = sentences.ids[starts[later] - 1]
    return starts, piece_lengths, first


def _inputs_and_targets(ids: np.ndarray, starts, lengths, first, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, n) int64 inputs and targets of n pieces, one per column, <pad> below each one's end. A piece's
    inputs are its targets one step later, after the token before it (`first`)."""
    t = np.arange(T)[:, None]
    inside = t < lengths[None, :]                                   # (T, n)
    targets = np.where(inside, ids[np.where(inside, starts[None, :] + t, 0)], PAD_ID).astype(np.int64)
    inputs = np.empty_like(targets)
    inputs[0], inputs[1:] = first, targets[:-1]
    inputs[~inside] = PAD_ID                                        # no input after a piece's last target
    return torch.from_numpy(inputs), torch.from_numpy(targets)


class BucketIterator:
    """Batches of similar-length sentences, padded to their bucket length; the LSTM state is reset each batch.

    A sentence goes to the smallest bucket that holds it. A sentence longer than the largest bucket is cut
    into pieces of that length (never dropped); a piece's first input is the previous piece's last target,
    so every token is still a target exactly once per epoch. Each bucket's last batch may hold fewer than
    batch_size sentences (drop_last=False); the batch dimension is never padded. Buckets may be given in
    any order (they are sorted); an empty list, a duplicate or a non-positive length is an error.
    With shuffle=False batches come bucket by bucket (shortest first), sentences in corpus order.
    """

    def __init__(self, sentences, batch_size: int, buckets: list[int] | None = None, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        sentences = _as_sentences(sentences)
        self.batch_size = _check_positive("batch_size", batch_size)
        self.lengths = sentences.lengths()                       # (sentences,) int64
        if buckets is None:
            buckets = default_buckets(self.lengths)
        if isinstance(buckets, int):
            raise TypeError(f"buckets={buckets}: give a list of bucket lengths, e.g. [{buckets}], or None for "
                            "default_buckets")
        if len(buckets) == 0:
            raise ValueError("buckets is empty; give at least one bucket length, or None for default_buckets")
        buckets = [_check_positive("every bucket length", b) for b in buckets]
        if len(set(buckets)) != len(buckets):
            raise ValueError(f"buckets {buckets} lists a length twice")
        self.buckets = sorted(buckets)
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self._ids = sentences.ids
        self.split_sentences = int((self.lengths > self.buckets[-1]).sum())
        # Each bucket's pieces as three arrays (where each starts in ids, its length, the input before it);
        # a batch is a choice of pieces, made into tensors only when it is read.
        starts, lengths, first = _pieces(sentences, self.buckets[-1])
        bucket = np.searchsorted(self.buckets, lengths)          # the smallest bucket that holds each piece
        self._pieces = {}
        for k, b in enumerate(self.buckets):
            chosen = np.flatnonzero(bucket == k)
            if len(chosen):
                self._pieces[b] = (starts[chosen], lengths[chosen], first[chosen])
        if drop_last and len(self) == 0:
            raise ValueError(f"drop_last=True leaves no batch: no bucket holds {self.batch_size} sentences; use a "
                             "smaller batch_size, fewer buckets, or drop_last=False")

    @property
    def used_buckets(self) -> list[int]:
        """The buckets that hold at least one piece."""
        return list(self._pieces)

    def set_epoch(self, epoch: int) -> None:
        """The shuffle depends only on (seed, epoch), so a run can be repeated or resumed."""
        self.epoch = epoch

    def _plan(self) -> list[tuple[int, np.ndarray]]:
        """(bucket, column indices) of each batch of this epoch, in order."""
        rng = np.random.default_rng([self.seed, self.epoch])
        plan = []
        for b, (starts, _, _) in self._pieces.items():
            n = len(starts)
            order = rng.permutation(n) if self.shuffle else np.arange(n)
            stop = n - n % self.batch_size if self.drop_last else n
            plan += [(b, order[i:i + self.batch_size]) for i in range(0, stop, self.batch_size)]
        if self.shuffle:  # mix the buckets, so consecutive batches have different lengths
            plan = [plan[i] for i in rng.permutation(len(plan))]
        return plan

    def __len__(self) -> int:
        per_bucket = math.floor if self.drop_last else math.ceil
        return sum(per_bucket(len(starts) / self.batch_size) for starts, _, _ in self._pieces.values())

    def __iter__(self):
        for b, cols in self._plan():
            starts, lengths, first = (a[cols] for a in self._pieces[b])
            inputs, targets = _inputs_and_targets(self._ids, starts, lengths, first, b)   # (T, B) each
            yield Batch(inputs, targets, targets != PAD_ID, bucket=b, carry_state=False)

    def stats(self) -> BucketStats:
        batches, pieces, tokens, padded = dict.fromkeys(self.buckets, 0), dict.fromkeys(self.buckets, 0), 0, 0
        for batch in self:
            batches[batch.bucket] += 1
            pieces[batch.bucket] += batch.inputs.shape[1]
            tokens += batch.tokens
            padded += batch.mask.numel() - batch.tokens
        # The alternatives, on whole sentences: random batches padded to their longest, or all to the longest.
        lengths = np.random.default_rng([self.seed, self.epoch]).permutation(self.lengths)
        chunks = [lengths[i:i + self.batch_size] for i in range(0, len(lengths), self.batch_size)]
        longest = sum(int(c.max()) * len(c) for c in chunks) - int(lengths.sum())
        most = int(lengths.max()) * len(lengths) - int(lengths.sum())
        return BucketStats(self.buckets, batches, pieces, tokens, padded, self.split_sentences, longest, most)


class StreamIterator:
    """Zaremba et al. (2014): the corpus as B parallel streams, read in (bptt, B) windows; state is carried.

    The concatenated corpus (inputs [<eos>, ...] and targets, as for sentences) is cut into B equal streams,
    padded at the very end rather than trimmed, so no token is dropped; the last window may be shorter
    than bptt. Every batch has all B columns, so a micro-batch split is the same every step.
    Every epoch reads the same windows in the same order (the state must flow from one to the next).
    """

    def __init__(self, sentences, batch_size: int, bptt: int):
        sentences = _as_sentences(sentences)
        self.batch_size, self.bptt = _check_positive("batch_size", batch_size), _check_positive("bptt", bptt)
        self._ids = sentences.ids[sentences.offsets[0]:sentences.offsets[-1]]   # (N,) the targets, in order
        N = len(self._ids)
        if N < batch_size:
            raise ValueError(f"batch_size={batch_size} is more than the {N} tokens there are to cut into "
                             f"{batch_size} streams; use a smaller batch")
        self.steps = math.ceil(N / batch_size)   # stream length: stream b is tokens [b * steps, (b + 1) * steps)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do (no shuffle); here so that both iterators can be driven the same way."""

    def __len__(self) -> int:
        return math.ceil(self.steps / self.bptt)

    def __iter__(self):
        N, streams = len(self._ids), np.arange(self.batch_size) * self.steps   # where each stream starts
        for t in range(0, self.steps, self.bptt):
            T = min(self.bptt, self.steps - t)                         # bptt, except perhaps the last window
            starts = streams + t                                       # each stream's window: a piece of it
            lengths = np.clip(N - starts, 0, T)                        # the end of the last stream is padding
            first = np.where(starts > 0, self._ids[np.clip(starts - 1, 0, N - 1)], EOS_ID)  # the corpus follows <eos>
            inputs, targets = _inputs_and_targets(self._ids, starts, lengths, first, T)
            yield Batch(inputs, targets, targets != PAD_ID, bucket=self.bptt, carry_state=True)
