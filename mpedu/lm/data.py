"""Token ids for train/valid/test: the Vocabulary, the Corpus, and the PTB-format reader."""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ..runtime.values import check_number
from . import synthetic

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIALS = (PAD, UNK, EOS)
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2  # fixed in every vocabulary, so batching code needs no vocabulary
SPLITS = ("train", "valid", "test")
FILE_NAMES = tuple(f"ptb.{split}.txt" for split in SPLITS)


class CorpusError(ValueError):
    """A corpus file is missing, empty or malformed; the message names the file (and line)."""


class CorpusNotFoundError(CorpusError, FileNotFoundError):
    """The corpus folder or one of its three files does not exist."""


class Vocabulary:
    """Words <-> ids. Ids 0, 1, 2 are <pad>, <unk>, <eos>; then words by count (desc), ties by word."""

    def __init__(self, itos: list[str]):
        if list(itos[:3]) != list(SPECIALS):
            raise ValueError(f"a vocabulary must start with {list(SPECIALS)}, got {list(itos[:3])}")
        if len(set(itos)) != len(itos):
            raise ValueError("a vocabulary must not list a word twice")
        self.itos = list(itos)
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def build(cls, sentences: Iterable[list[str]], min_count: int = 1, max_size: int | None = None) -> "Vocabulary":
        """Count the words of the training sentences; keep those seen >= min_count times, at most
        max_size of them (not counting the 3 specials). Everything else will encode to <unk>."""
        counts = Counter(w for words in sentences for w in words)
        for special in SPECIALS:  # PTB writes <unk> in its text; it is already id 1
            counts.pop(special, None)
        words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls(list(SPECIALS) + words[:max_size])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: list[str]) -> list[int]:
        unk = self.unk_id
        return [self.stoi.get(w, unk) for w in words]

    def decode(self, ids) -> list[str]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [self.itos[i] for i in ids]

    def to_dict(self) -> dict:
        return {"itos": list(self.itos)}  # plain list of str: JSON and torch.load(weights_only=True) safe

    @classmethod
    def from_dict(cls, d: dict) -> "Vocabulary":
        return cls(d["itos"])

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} ids: {', '.join(self.itos[:6])}, ...)"


@dataclass
class Corpus:
    """Each sentence is a 1-D int64 tensor [w1, ..., wn, <eos>]; a model reads [<eos>, w1, ..., wn]."""

    vocab: Vocabulary
    train: list[torch.Tensor]
    valid: list[torch.Tensor]
    test: list[torch.Tensor]
    name: str
    blank_lines: dict[str, int] = field(default_factory=dict)  # skipped blank lines per split

    def sentences(self, split: str) -> list[torch.Tensor]:
        """The sentences of "train", "valid" or "test"."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        return getattr(self, split)

    def tokens(self, split: str) -> int:
        """Number of tokens in a split, each <eos> included: the number of predictions per epoch."""
        return sum(len(s) for s in self.sentences(split))

    def unigram_perplexity(self, split: str = "test") -> float:
        """Perplexity of the add-one smoothed train unigram distribution on `split`: the baseline to beat."""
        V = len(self.vocab)
        counts = torch.bincount(torch.cat(self.train), minlength=V).double() + 1
        counts[self.vocab.pad_id] = 0  # <pad> is never a target
        logp = (counts / counts.sum()).log()
        return math.exp(-logp[torch.cat(self.sentences(split))].mean().item())

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s} {len(self.sentences(s)):,} sentences / {self.tokens(s):,} tokens" for s in SPLITS)
        return f"Corpus({self.name}: vocab {len(self.vocab):,}; {sizes})"


MAX_LINE_TOKENS = 10_000     # a longer line is more likely a file without line ends than a sentence


def _read(path: Path, max_line_tokens: int) -> tuple[list[list[str]], int]:
    """Read one PTB-format file: (sentences, number of blank lines skipped)."""
    sentences, blank = [], 0
    lineno = 0                   # lines as an editor counts them: a bare CR ends one too
    with open(path, "rb") as f:  # bytes, so that a bad byte can be reported with its line number
        for raw in f:
            lineno += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} "
                                  f"at column {e.start + 1}); the reader expects UTF-8 text") from None
            if b"\0" in raw:        # valid UTF-8, but no text has them: UTF-16 or UTF-32 without a byte-order mark
                raise CorpusError(f"{path}:{lineno}: holds NUL bytes (the first at column {raw.index(0) + 1}): a "
                                  "UTF-16 or UTF-32 file? Save it as UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)")
            # a file without line ends is one line: refused before the split, whose words as strings would
            # take ~10x the file's size in memory only to be refused (a bare CR ends a line too)
            if len(raw) > 16 * max_line_tokens:         # (shorter lines cost little to split)
                parts = raw.split(b"\r") if b"\r" in raw else (raw,)     # (split copies: only if need be)
                longest = max(_count_tokens(part) for part in parts)
                if longest > max_line_tokens:
                    raise _too_long(path, lineno, longest, max_line_tokens)
            # a bare CR (old Mac line ends) ends a sentence too; a CRLF's CR goes with the newline
            for k, part in enumerate(line.rstrip("\r\n").split("\r")):
                lineno += k > 0
                words = part.lstrip("\ufeff").split()  # a UTF-8 byte-order mark is not a word
                if not words:
                    blank += 1
                    continue
                if len(words) > max_line_tokens:
                    raise _too_long(path, lineno, len(words), max_line_tokens)
                if PAD in words:
                    raise CorpusError(f"{path}:{lineno}: the token {PAD} is reserved for padding and may not "
                                      f"appear in the text")
                sentences.append(words)
    if not sentences:
        raise CorpusError(f"{path} contains no sentences ({blank} blank lines); "
                          f"expected one whitespace-tokenised sentence per line")
    return sentences, blank


def _too_long(path, lineno: int, tokens: int, max_line_tokens: int) -> CorpusError:
    return CorpusError(f"{path}:{lineno}: a line of {tokens:,} tokens is longer than max_line_tokens="
                       f"{max_line_tokens:,}; the format is one sentence per line, so the file's line ends may be "
                       "missing. If this is intended, pass a larger max_line_tokens to mpedu.load_corpus (the "
                       f"command line reads at most {MAX_LINE_TOKENS:,} tokens per line)")


def _count_tokens(raw: bytes) -> int:
    """The whitespace-separated tokens of a line, counted without making them (ASCII whitespace: never more
    than str.split finds)."""
    return sum(1 for _ in _TOKEN.finditer(raw))


_TOKEN = re.compile(rb"\S+")


def read_sentences(path, max_line_tokens: int = MAX_LINE_TOKENS) -> list[list[str]]:
    """Read a PTB-format file: one sentence per line, tokens separated by whitespace.

    Blank lines are skipped (see Corpus.blank_lines for the count); <eos> is not in the file."""
    path = Path(path)
    if not path.is_file():
        raise CorpusNotFoundError(f"no such corpus file: {path}")
    return _read(path, max_line_tokens)[0]


_EMBEDDED: dict[int, dict] = {}  # seed -> generated sentences, so repeated load_corpus() calls are instant


def load_corpus(path=None, *, seed: int = 0, max_line_tokens: int = MAX_LINE_TOKENS) -> Corpus:
    """The embedded corpus (path=None, generated from `seed`) or a folder with ptb.{train,valid,test}.txt.

    The vocabulary comes from the training split only; unseen valid/test words become <unk>."""
    blank = dict.fromkeys(SPLITS, 0)
    check_number("seed", seed, integer=True)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: give a folder (a str or Path) holding {', '.join(FILE_NAMES)}, or None "
                        "for the embedded corpus")
    if path is None:
        if seed not in _EMBEDDED:
            _EMBEDDED[seed] = synthetic.generate(seed)
        words, name = _EMBEDDED[seed], f"embedded(seed={seed})"
    else:
        folder = Path(path)
        expected = ", ".join(FILE_NAMES)
        if folder.is_file():
            hint = f" (perhaps its folder, {folder.parent})" if folder.name in FILE_NAMES else ""
            raise CorpusNotFoundError(f"corpus path {folder} is a file, not a folder; give the folder that holds "
                                      f"{expected}{hint}")
        if not folder.is_dir():
            raise CorpusNotFoundError(f"corpus folder {folder} does not exist; it should hold {expected}")
        missing = [n for n in FILE_NAMES if not (folder / n).is_file()]
        if missing:
            raise CorpusNotFoundError(f"corpus folder {folder} lacks {', '.join(missing)}; "
                                      f"it should hold {expected}")
        words, name = {}, str(folder)
        for split, file_name in zip(SPLITS, FILE_NAMES):
            words[split], blank[split] = _read(folder / file_name, max_line_tokens)
    vocab = Vocabulary.build(words["train"])
    if len(vocab) == len(SPECIALS):     # a model needs at least one word besides <pad>, <unk> and <eos>
        where = f"{Path(path) / FILE_NAMES[0]}" if path is not None else "the training split"
        raise CorpusError(f"{where} holds no words besides {', '.join(SPECIALS[1:])} ("
                          f"{sum(map(len, words['train'])):,} tokens), so there is nothing to learn; "
                          "check that it is the right file")
    eos = [vocab.eos_id]
    ids = {split: [torch.tensor(vocab.encode(s) + eos, dtype=torch.int64) for s in words[split]] for split in SPLITS}
    return Corpus(vocab, ids["train"], ids["valid"], ids["test"], name=name, blank_lines=blank)
