"""A split's sentences as one flat array of token ids, not a tensor per sentence.

    ids      [ w  w  w  e | w  w  e | w  w  w  w  e ]     int32, e = <eos>
    offsets  [ 0,          4,       7,               12 ]  sentence k is ids[offsets[k]:offsets[k + 1]]

A corpus a hundred times PTB has tens of millions of sentences; as tensors each one costs ~150 bytes of
overhead besides its ids, and as lists of Python ints ~30x its ids. Here a token costs 4 bytes and a
sentence 8, and the arrays may be memory-mapped from a cache file that several processes share.
Indexing gives the familiar 1-D int64 tensor [w1, ..., wn, <eos>] (a copy: the arrays are never written).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Sentences(Sequence):
    """The sentences of one split: `len`, `[k]` (an int64 tensor), slices (another Sentences), iteration."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray):
        if ids.dtype != np.int32 or ids.ndim != 1:
            raise ValueError(f"ids must be a 1-D int32 array, got {ids.dtype} with {ids.ndim} dimensions")
        if offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) == 0:
            raise ValueError("offsets must be a non-empty 1-D int64 array (one more than the sentences)")
        self.ids, self.offsets = ids, offsets          # offsets index `ids` directly, so slices share it

    @classmethod
    def from_tensors(cls, sentences) -> "Sentences":
        """From a list of 1-D integer tensors (or lists of ints), one per sentence."""
        pieces = [torch.as_tensor(s).reshape(-1).numpy() for s in sentences]
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=offsets[1:])
        ids = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, dtype=np.int32)
        return cls(ids, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k):
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step == 1:
                return Sentences(self.ids, self.offsets[start:max(start, stop) + 1])
            return Sentences.from_tensors([self[i] for i in range(start, stop, step)])
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"sentence {k} of {n}")
        k %= n
        return torch.from_numpy(self.ids[self.offsets[k]:self.offsets[k + 1]].astype(np.int64))

    def __add__(self, other) -> "Sentences":
        """One split's sentences, then another's (a new pair of arrays), as lists concatenate."""
        if not isinstance(other, Sentences):
            return NotImplemented
        parts = (self, other)
        ids = np.concatenate([p.ids[p.offsets[0]:p.offsets[-1]] for p in parts])
        offsets = np.concatenate([self.offsets - self.offsets[0], other.offsets[1:] - other.offsets[0] + self.tokens])
        return Sentences(ids, offsets)

    def lengths(self) -> np.ndarray:
        """Tokens per sentence, each <eos> included (int64)."""
        return np.diff(self.offsets)

    @property
    def tokens(self) -> int:
        """Every token of every sentence, <eos> included."""
        return int(self.offsets[-1] - self.offsets[0])

    def cat(self) -> torch.Tensor:
        """torch.cat of every sentence (int64), without making them one by one."""
        return torch.from_numpy(self.ids[self.offsets[0]:self.offsets[-1]].astype(np.int64))

    def __repr__(self) -> str:
        return f"Sentences({len(self):,} sentences, {self.tokens:,} tokens)"
