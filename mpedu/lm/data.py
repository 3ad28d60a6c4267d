"""Token ids for train/valid/test: the Vocabulary, the Corpus, and load_corpus (read once, then cached)."""
from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ..runtime.values import check_number, format_size
from . import synthetic
from .corpus_cache import CorpusCache, file_digest
from .reading import (EOS_ID, MAX_LINE_TOKENS, PAD, PAD_ID, SPECIALS, UNK_ID, CorpusError, LineReader, _reserved,
                      encode, renumber, vocab_order)
from .sentences import Sentences

SPLITS = ("train", "valid", "test")
FILE_NAMES = tuple(f"ptb.{split}.txt" for split in SPLITS)
SHOW_PROGRESS_BYTES = 16 << 20      # load_corpus(progress=None) reports on corpora larger than this


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
    """Each split's sentences, [w1, ..., wn, <eos>] each (see Sentences); a model reads [<eos>, w1, ..., wn].

    `cache` says where the ids came from: "built" (read, and cached beside the text), "read" (from that
    cache), or None (read without a cache, or the embedded corpus)."""

    vocab: Vocabulary
    train: Sentences
    valid: Sentences
    test: Sentences
    name: str
    blank_lines: dict[str, int] = field(default_factory=dict)  # skipped blank lines per split
    cache: str | None = None

    def __post_init__(self):
        for split in SPLITS:                    # a list of tensors is welcome too
            if not isinstance(getattr(self, split), Sentences):
                setattr(self, split, Sentences.from_tensors(getattr(self, split)))

    def sentences(self, split: str) -> Sentences:
        """The sentences of "train", "valid" or "test"."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        return getattr(self, split)

    def tokens(self, split: str) -> int:
        """Number of tokens in a split, each <eos> included: the number of predictions per epoch."""
        return self.sentences(split).tokens

    def unigram_perplexity(self, split: str = "test") -> float:
        """Perplexity of the add-one smoothed train unigram distribution on `split`: the baseline to beat."""
        V = len(self.vocab)
        counts = torch.bincount(self.train.cat(), minlength=V).double() + 1
        counts[self.vocab.pad_id] = 0  # <pad> is never a target
        logp = (counts / counts.sum()).log()
        return math.exp(-logp[self.sentences(split).cat()].mean().item())

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s} {len(self.sentences(s)):,} sentences / {self.tokens(s):,} tokens" for s in SPLITS)
        return f"Corpus({self.name}: vocab {len(self.vocab):,}; {sizes})"


def read_sentences(path, max_line_tokens: int = MAX_LINE_TOKENS) -> list[list[str]]:
    """Read a PTB-format file as word lists: one sentence per line, tokens separated by whitespace.

    Blank lines are skipped (see Corpus.blank_lines for the count); <eos> is not in the file."""
    path = Path(path)
    if not path.is_file():
        raise CorpusNotFoundError(f"no such corpus file: {path}")
    sentences = []
    for lineno, words in LineReader(path, max_line_tokens):
        if PAD in words:
            raise _reserved(path, lineno)
        sentences.append(words)
    return sentences


_EMBEDDED: dict[int, tuple] = {}  # seed -> (vocabulary's words, split -> Sentences): repeated calls are instant


def load_corpus(path=None, *, seed: int = 0, max_line_tokens: int = MAX_LINE_TOKENS, cache: bool = True,
                progress: bool | None = None) -> Corpus:
    """The embedded corpus (path=None, generated from `seed`) or a folder with ptb.{train,valid,test}.txt.

    The vocabulary comes from the training split only; unseen valid/test words become <unk>. A folder is
    read in one streaming pass into int32 ids and, with cache=True, cached in its .mpedu-cache folder (read
    again only when a file changes; shared by every process that loads it). progress: report on stderr
    while reading (None: for corpora over 16 MB)."""
    check_number("seed", seed, integer=True)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: give a folder (a str or Path) holding {', '.join(FILE_NAMES)}, or None "
                        "for the embedded corpus")
    if path is None:
        if seed not in _EMBEDDED:
            words = synthetic.generate(seed)
            _EMBEDDED[seed] = _encode_splits({s: enumerate(words[s], 1) for s in SPLITS},
                                             dict.fromkeys(SPLITS, "the embedded corpus"))
        itos, splits = _EMBEDDED[seed]
        return Corpus(Vocabulary(itos), **splits, name=f"embedded(seed={seed})",
                      blank_lines=dict.fromkeys(SPLITS, 0))
    folder = _corpus_folder(path)
    files = {split: folder / name for split, name in zip(SPLITS, FILE_NAMES)}
    size = sum(f.stat().st_size for f in files.values())
    show = _Progress(size) if (size > SHOW_PROGRESS_BYTES if progress is None else progress) else None
    store = CorpusCache(folder, SPLITS) if cache else None
    if store is None or not store.usable:
        if store is not None and show is not None:
            show.say(f"note: {store.problem}; reading {folder} without a cache")
        return _read_folder(folder, files, max_line_tokens, show)[0]
    waiting = (lambda: show.say(f"another process is reading {folder}; waiting for its cache")) if show else None
    with store.locked(waiting):
        found = _cached(store, files, max_line_tokens, show)
        if found is not None:
            return found
        corpus, source = _read_folder(folder, files, max_line_tokens, show)
        try:
            store.save(source, {s: corpus.sentences(s) for s in SPLITS}, corpus.vocab.itos)
        except OSError as e:            # a full disk or a quota: the corpus is read all the same
            print(f"mpedu: note: could not write the cache in {store.folder} ({e.strerror or e}); the corpus was "
                  "read, and will be read again next time", file=sys.stderr)
            return corpus
        corpus.cache = "built"
        return corpus


def _corpus_folder(path) -> Path:
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
        raise CorpusNotFoundError(f"corpus folder {folder} lacks {', '.join(missing)}; it should hold {expected}")
    return folder


def _encode_splits(lines: dict, where: dict) -> tuple[list[str], dict[str, Sentences]]:
    """(the vocabulary's words, split -> Sentences) of each split's (line number, words) pairs: train first,
    giving words ids as they come, sorted into the vocabulary's order afterwards; then valid and test.
    where[split] names the split's text in messages."""
    train, first_seen = encode(lines["train"], None, where["train"])
    itos, new_id = vocab_order(train, first_seen)
    renumber(train.ids, new_id)
    if len(itos) == len(SPECIALS):     # a model needs at least one word besides <pad>, <unk> and <eos>
        raise CorpusError(f"{where['train']} holds no words besides {', '.join(SPECIALS[1:])} "
                          f"({train.tokens - len(train):,} tokens), so there is nothing to learn; check that it is "
                          "the right file")
    stoi = {w: i for i, w in enumerate(itos)}
    splits = {"train": train}
    for split in SPLITS[1:]:
        splits[split] = encode(lines[split], stoi, where[split])[0]
    return itos, splits


def _read_folder(folder: Path, files: dict, max_line_tokens: int, show) -> tuple[Corpus, dict]:
    """The corpus, and what it was read from (for the cache's meta.json)."""
    readers = {}
    for split, path in files.items():
        before = sum(p.stat().st_size for s, p in files.items() if s in readers)
        step = (lambda done, before=before, name=path.name: show(before + done, f"reading {name}")) if show else None
        readers[split] = LineReader(path, max_line_tokens, step)
    itos, splits = _encode_splits(readers, {s: str(p) for s, p in files.items()})
    if show is not None:
        show.done(f"read {folder}: {sum(s.tokens for s in splits.values()):,} tokens")
    corpus = Corpus(Vocabulary(itos), **splits, name=str(folder),
                    blank_lines={s: r.blank for s, r in readers.items()})
    source = {"max_line_tokens": max_line_tokens, "blank_lines": corpus.blank_lines,
              "files": {p.name: {"bytes": readers[s].bytes, "sha256": readers[s].sha256} for s, p in files.items()}}
    return corpus, source


def _cached(store: CorpusCache, files: dict, max_line_tokens: int, show) -> Corpus | None:
    """The corpus from its cache, if the cache was built from these very files with these limits."""
    meta = store.meta()
    if meta is None or meta.get("max_line_tokens") != max_line_tokens:
        return None
    recorded = meta.get("files", {})
    if any(recorded.get(p.name, {}).get("bytes") != p.stat().st_size for p in files.values()):
        return None
    done = 0
    for path in files.values():
        step = (lambda n, before=done, name=path.name: show(before + n, f"checking {name}")) if show else None
        if file_digest(path, step) != recorded[path.name].get("sha256"):
            return None
        done += path.stat().st_size
    loaded = store.load()
    if loaded is None:
        return None
    splits, itos, meta = loaded
    if show is not None:
        show.done(f"read the cache in {store.folder}: {sum(s.tokens for s in splits.values()):,} tokens")
    return Corpus(Vocabulary(itos), **splits, name=str(store.folder.parent), blank_lines=meta["blank_lines"],
                  cache="read")


class _Progress:
    """One line on stderr while a big corpus is read: redrawn in place on a terminal, else every 10 s."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = max(total, 1), stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.drawn = False

    def __call__(self, done: int, what: str) -> None:
        now = time.perf_counter()
        if now - self.last < (0.5 if self.tty else 10):
            return
        self.last = now
        line = (f"mpedu: {what}: {100 * done / self.total:3.0f}% of {format_size(self.total)} "
                f"({now - self.start:.0f} s)")
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        self.stream.flush()
        self.drawn = self.tty

    def say(self, line: str) -> None:
        self.stream.write(("\n" if self.drawn else "") + f"mpedu: {line}\n")
        self.stream.flush()
        self.drawn = False

    def done(self, line: str) -> None:
        self.say(f"{line} in {time.perf_counter() - self.start:.1f} s")
