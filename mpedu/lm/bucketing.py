"""Time-major (T, B) batches with a mask: sentences grouped into length buckets, or one long stream."""
from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .data import EOS_ID, PAD_ID


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

    def split(self, m: int) -> list["Batch"]:
        """m micro-batches of B/m columns each, in order: the pipeline's unit of work."""
        B = self.inputs.shape[1]
        bad_type = isinstance(m, bool) or not isinstance(m, numbers.Integral)
        if bad_type or m < 1 or m > B or B % m:
            divisors = ", ".join(str(d) for d in range(1, B + 1) if B % d == 0)
            why = "is not a positive integer" if bad_type or m < 1 else (
                f"is more than the batch size {B}" if m > B else f"does not divide the batch size {B}")
            raise ValueError(f"micro_batches={m} {why}; pick a divisor of {B} such as {divisors}. "
                             f"(The last batch of a bucket can be smaller than batch_size; "
                             f"BucketIterator(drop_last=True) keeps every batch full.)")
        m, T = int(m), self.inputs.shape[0]
        # One copy per tensor, (T, B) -> (m, T, B/m), then views: micro-batch i is the contiguous block i,
        # columns i*B/m .. (i+1)*B/m - 1. The pipeline splits every batch it runs, so this is on its hot path.
        cut = lambda x: x.reshape(T, m, B // m).transpose(0, 1).contiguous().unbind(0)  # noqa: E731
        return [Batch(*parts, self.bucket, self.carry_state)
                for parts in zip(cut(self.inputs), cut(self.targets), cut(self.mask))]


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


def _check_sentences(sentences) -> None:
    if hasattr(sentences, "train") and hasattr(sentences, "vocab"):
        raise TypeError("batch one split of the corpus, e.g. BucketIterator(corpus.train, batch_size), not the "
                        "whole corpus")
    if len(sentences) == 0:
        raise ValueError("no sentences to batch: the list is empty")
    for i, s in enumerate(sentences):
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or len(s) == 0 or s.dtype != torch.int64:
            raise ValueError(f"sentence {i} must be a non-empty 1-D tensor of int64 token ids, got {s!r}")


def _pad_columns(seqs: list[torch.Tensor], T: int) -> torch.Tensor:
    """(T, n): the sequences as columns, <pad> below each one's end."""
    out = torch.nn.utils.rnn.pad_sequence(seqs, padding_value=PAD_ID)  # (longest, n), time-major
    return torch.nn.functional.pad(out, (0, 0, 0, T - out.shape[0]), value=PAD_ID)


def _inputs_and_targets(pieces: list[tuple[torch.Tensor, int, int]], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, n) inputs and targets of n pieces (sentence, start, length), one per column, <pad> below each end.
    A piece's inputs are its targets one step later, after the token before it: <eos> at a sentence's start,
    else the previous piece's last target. Built per bucket, not per sentence: a corpus has tens of thousands."""
    targets = _pad_columns([s[start:start + n] for s, start, n in pieces], T)
    inputs = torch.full_like(targets, PAD_ID)
    inputs[0] = torch.tensor([EOS_ID if start == 0 else s[start - 1] for s, start, _ in pieces], dtype=targets.dtype)
    inputs[1:] = targets[:-1]
    lengths = torch.tensor([n for _, _, n in pieces])
    inputs[torch.arange(T)[:, None] >= lengths[None, :]] = PAD_ID      # no input after a piece's last target
    return inputs, targets


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
        _check_sentences(sentences)
        self.batch_size = _check_positive("batch_size", batch_size)
        self.lengths = [len(s) for s in sentences]
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

        cap, pieces = self.buckets[-1], {b: [] for b in self.buckets}
        self.split_sentences = 0
        for s, length in zip(sentences, self.lengths):
            self.split_sentences += length > cap
            for start in range(0, length, cap):
                n = min(cap, length - start)
                bucket = self.buckets[bisect.bisect_left(self.buckets, n)]  # the smallest that holds n
                pieces[bucket].append((s, start, n))
        # One padded (b, n_b) tensor pair per bucket; a batch is a choice of columns.
        self._data = {b: _inputs_and_targets(items, b) for b, items in pieces.items() if items}
        if drop_last and len(self) == 0:
            raise ValueError(f"drop_last=True leaves no batch: no bucket holds {self.batch_size} sentences; use a "
                             "smaller batch_size, fewer buckets, or drop_last=False")

    def set_epoch(self, epoch: int) -> None:
        """The shuffle depends only on (seed, epoch), so a run can be repeated or resumed."""
        self.epoch = epoch

    def _plan(self) -> list[tuple[int, torch.Tensor]]:
        """(bucket, column indices) of each batch of this epoch, in order."""
        rng = np.random.default_rng([self.seed, self.epoch])
        plan = []
        for b, (x, _) in self._data.items():
            n = x.shape[1]
            order = rng.permutation(n) if self.shuffle else np.arange(n)
            stop = n - n % self.batch_size if self.drop_last else n
            plan += [(b, torch.from_numpy(order[i:i + self.batch_size].copy()))
                     for i in range(0, stop, self.batch_size)]
        if self.shuffle:  # mix the buckets, so consecutive batches have different lengths
            plan = [plan[i] for i in rng.permutation(len(plan))]
        return plan

    def __len__(self) -> int:
        per_bucket = math.floor if self.drop_last else math.ceil
        return sum(per_bucket(x.shape[1] / self.batch_size) for x, _ in self._data.values())

    def __iter__(self):
        for b, cols in self._plan():
            x, y = self._data[b]
            targets = y[:, cols]  # (T, B)
            yield Batch(x[:, cols], targets, targets != PAD_ID, bucket=b, carry_state=False)

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
        _check_sentences(sentences)
        self.batch_size, self.bptt = _check_positive("batch_size", batch_size), _check_positive("bptt", bptt)
        targets = torch.cat(list(sentences))  # (N,)
        N = len(targets)
        if N < batch_size:
            raise ValueError(f"batch_size={batch_size} is more than the {N} tokens there are to cut into "
                             f"{batch_size} streams; use a smaller batch")
        inputs = torch.cat([targets.new_tensor([EOS_ID]), targets[:-1]])
        n = math.ceil(N / batch_size)  # stream length
        pad = targets.new_full((n * batch_size - N,), PAD_ID)
        self.inputs = torch.cat([inputs, pad]).view(batch_size, n).t().contiguous()    # (n, B): column b is stream b
        self.targets = torch.cat([targets, pad]).view(batch_size, n).t().contiguous()  # (n, B)

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do (no shuffle); here so that both iterators can be driven the same way."""

    def __len__(self) -> int:
        return math.ceil(self.inputs.shape[0] / self.bptt)

    def __iter__(self):
        for t in range(0, self.inputs.shape[0], self.bptt):
            targets = self.targets[t:t + self.bptt]  # (T, B), T = bptt except perhaps the last window
            yield Batch(self.inputs[t:t + self.bptt], targets, targets != PAD_ID,
                        bucket=self.bptt, carry_state=True)
