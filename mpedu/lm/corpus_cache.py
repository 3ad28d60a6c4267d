"""A corpus read once: its token ids cached beside the text, memory-mapped, shared by every process.

    <corpus folder>/.mpedu-cache/
        meta.json                  what it was built from: each file's size and SHA-256, the reader's limits
        vocab.json                 the vocabulary's words, in id order
        train.ids.npy ...          each split's int32 ids and int64 sentence offsets (see sentences.py)

The cache is used while every file's size and SHA-256 match meta.json, so an edited corpus is read again.
It is built under a lock on the folder and written to temporary names that are renamed, meta.json last:
no process sees half a cache, and the ranks of one machine wait for one builder, then map the same pages
(one copy of the ids in memory, however many ranks).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .sentences import Sentences

try:
    import fcntl
except ImportError:         # (Windows: no advisory locks; each process builds its own copy, unshared)
    fcntl = None

FOLDER = ".mpedu-cache"
FORMAT = 1                  # bumped whenever the files' layout or the reader's ids change


def file_digest(path: Path, progress=None) -> str:
    """SHA-256 of a file, read in blocks; progress(bytes) after each."""
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            done += len(block)
            if progress is not None:
                progress(done)
    return digest.hexdigest()


class CorpusCache:
    """The cache folder of one corpus folder; `usable` is False where it cannot be written (read-only)."""

    def __init__(self, corpus_folder: Path, splits: tuple[str, ...]):
        self.folder, self.splits = Path(corpus_folder) / FOLDER, splits
        self.problem = None
        try:
            self.folder.mkdir(exist_ok=True)
        except OSError as e:
            self.problem = f"cannot make {self.folder} ({e.strerror or e})"

    @property
    def usable(self) -> bool:
        return self.problem is None

    @contextlib.contextmanager
    def locked(self, waiting=None):
        """Hold the folder's lock (another process may be building); waiting() is called if one is."""
        if fcntl is None:
            yield
            return
        with open(self.folder / "lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def meta(self) -> dict | None:
        """meta.json, or None if there is none or it is not this format's."""
        try:
            meta = json.loads((self.folder / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None

    def load(self) -> tuple[dict[str, Sentences], list[str], dict] | None:
        """(split -> Sentences memory-mapped read-only, the vocabulary's words, meta), or None if a file is
        missing or does not agree with meta.json (then the corpus is read again)."""
        meta = self.meta()
        if meta is None:
            return None
        try:
            itos = json.loads((self.folder / "vocab.json").read_text())
            splits = {}
            for split in self.splits:
                ids = np.load(self.folder / f"{split}.ids.npy", mmap_mode="r")
                offsets = np.load(self.folder / f"{split}.offsets.npy", mmap_mode="r")
                if (len(ids), len(offsets) - 1) != tuple(meta["sizes"][split]):
                    return None
                splits[split] = Sentences(ids, offsets)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return splits, itos, meta

    def save(self, meta: dict, splits: dict[str, Sentences], itos: list[str]) -> None:
        """Write every file under a temporary name, then rename; meta.json last, so it vouches for the rest."""
        meta = dict(meta, format=FORMAT, sizes={s: [len(v.ids), len(v)] for s, v in splits.items()})
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.folder / "meta.json")                 # the old files stop counting first
        for split, sentences in splits.items():
            self._write(f"{split}.ids.npy", lambda f, a=sentences.ids: np.save(f, a))
            self._write(f"{split}.offsets.npy", lambda f, a=sentences.offsets: np.save(f, a))
        self._write("vocab.json", lambda f: f.write(json.dumps(itos).encode()))
        self._write("meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))

    def _write(self, name: str, write) -> None:
        temp = self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.folder / name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
