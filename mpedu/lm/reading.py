"""Reading a PTB-format file in one streaming pass: a block of bytes at a time, straight into token ids.

    file --1 MiB blocks--> whole lines --decode, split--> words --ids--> int32 array (+ sentence offsets)

Only one block and the ids are ever in memory, never the file's words as strings (which take ~30x the
file's size). Every check happens while reading, with the line it concerns: bad UTF-8, NUL bytes (a
UTF-16 file), the reserved <pad>, and a line longer than max_line_tokens, refused before it is split.
"""
from __future__ import annotations

import hashlib
import mmap
import re
from array import array
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .sentences import Sentences

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIALS = (PAD, UNK, EOS)
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2  # fixed in every vocabulary, so batching code needs no vocabulary
MAX_LINE_TOKENS = 10_000     # a longer line is more likely a file without line ends than a sentence
BLOCK = 1 << 20             # bytes read at a time
CHUNK = 1 << 20             # ids counted or renumbered at a time (numpy makes int64 copies of what it indexes)


class CorpusError(ValueError):
    """A corpus file is missing, empty or malformed; the message names the file (and line)."""


class LineReader:
    """The non-blank lines of a PTB-format file as word lists; afterwards `blank` and `sha256` are known.

    progress(bytes read so far) is called after each block."""

    def __init__(self, path: Path, max_line_tokens: int = MAX_LINE_TOKENS,
                 progress: Callable[[int], None] | None = None):
        self.path, self.max_line_tokens, self.progress = Path(path), max_line_tokens, progress
        self.blank, self.sentences, self.bytes, self.sha256 = 0, 0, 0, None

    def __iter__(self):
        digest, done, lineno = hashlib.sha256(), 0, 0   # lineno: lines before the block, as an editor counts
        partial, partial_tokens = [], 0                  # a line still waiting for its end
        with open(self.path, "rb") as f:
            while True:
                block = f.read(BLOCK)
                digest.update(block)
                done += len(block)
                if block:
                    # whole lines only: a block ends after its last line end (a CR at the very end may
                    # be the first half of a CRLF, so it waits for the next block)
                    cut = max(block.rfind(b"\n"), block.rfind(b"\r", 0, len(block) - 1))
                    if cut < 0:
                        partial.append(block)
                        partial_tokens += _count_tokens(block)       # (one too many per block at most)
                        if partial_tokens > self.max_line_tokens:
                            exact = _count_tokens(b"".join(partial))
                            if exact > self.max_line_tokens:
                                raise self._too_long(lineno + 1, exact + _rest_of_line(f, partial[-1]))
                        continue
                    lines = b"".join(partial + [block[:cut + 1]])
                    partial, partial_tokens = [block[cut + 1:]], _count_tokens(block[cut + 1:])
                else:
                    lines, partial = b"".join(partial), []
                if lines:
                    yield from self._lines(lines, lineno)
                    lineno += _line_ends(lines, len(lines)) + (not lines.endswith((b"\n", b"\r")))
                if self.progress is not None:
                    self.progress(done)
                if not block:
                    break
        self.bytes, self.sha256 = done, digest.hexdigest()
        if not self.sentences:
            raise CorpusError(f"{self.path} contains no sentences ({self.blank} blank lines); "
                              f"expected one whitespace-tokenised sentence per line")

    def _lines(self, data: bytes, lineno: int):
        if b"\0" in data:       # valid UTF-8, but no text has them: UTF-16 or UTF-32 without a byte-order mark
            line, column = _where(data, data.index(b"\0"), lineno)
            raise CorpusError(f"{self.path}:{line}: holds NUL bytes (the first at column {column}): a UTF-16 or "
                              "UTF-32 file? Save it as UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line, column = _where(data, e.start, lineno)
            raise CorpusError(f"{self.path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at column "
                              f"{column}); the reader expects UTF-8 text") from None
        if "\r" in text:        # a bare CR (old Mac line ends) ends a sentence too; a CRLF is one line end
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\ufeff" in text:    # a UTF-8 byte-order mark is not a word
            text = _BOM.sub("", text)
        lines = text.split("\n")
        if lines[-1] == "":     # the text ends with a line end: nothing after it
            lines.pop()
        limit = self.max_line_tokens
        for line in lines:
            lineno += 1
            words = line.split()
            if not words:
                self.blank += 1
            elif len(words) > limit:
                raise self._too_long(lineno, len(words))
            else:
                self.sentences += 1
                yield lineno, words

    def _too_long(self, lineno: int, tokens: int) -> CorpusError:
        return CorpusError(f"{self.path}:{lineno}: a line of {tokens:,} tokens is longer than max_line_tokens="
                           f"{self.max_line_tokens:,}; the format is one sentence per line, so the file's line "
                           "ends may be missing. If this is intended, pass a larger max_line_tokens to "
                           f"mpedu.load_corpus (the command line reads at most {MAX_LINE_TOKENS:,} tokens per line)")


_BOM = re.compile("^\ufeff+", re.MULTILINE)


_SPACE_OR_WORD = bytes(32 if chr(b) in " \t\n\r\x0b\x0c" else 120 for b in range(256))  # b" " or b"x"


def _count_tokens(raw: bytes) -> int:
    """The whitespace-separated tokens of some bytes, as bytes.split finds them (ASCII whitespace: never more
    than str.split), counted without making them: a token starts wherever a space is followed by a word byte."""
    marks = raw.translate(_SPACE_OR_WORD)
    return marks.count(b" x") + marks.startswith(b"x")


def _rest_of_line(f, last: bytes) -> int:
    """The tokens left in a line whose start ended with `last`: counted block by block, none kept."""
    tokens, inside = 0, last[-1:].strip() != b""        # inside: the line so far ends in a token
    while block := f.read(BLOCK):
        end = min((i for i in (block.find(b"\n"), block.find(b"\r")) if i >= 0), default=len(block))
        part = block[:end]
        tokens += _count_tokens(part) - (inside and part[:1].strip() != b"")   # a token cut by the block
        if end < len(block):
            break
        inside = part[-1:].strip() != b""
    return tokens


def _reserved(where, lineno: int) -> CorpusError:
    return CorpusError(f"{where}:{lineno}: the token {PAD} is reserved for padding and may not appear in the text")


def _line_ends(data: bytes, stop: int) -> int:
    """Line ends in data[:stop]: LF, CRLF and a bare CR each count once."""
    return data.count(b"\n", 0, stop) + data.count(b"\r", 0, stop) - data.count(b"\r\n", 0, stop)


def _where(data: bytes, pos: int, lineno: int) -> tuple[int, int]:
    """(line, column) of byte `pos` of a block that starts after `lineno` lines, both counted from 1."""
    start = max(data.rfind(b"\n", 0, pos), data.rfind(b"\r", 0, pos)) + 1
    return lineno + _line_ends(data, pos) + 1, pos - start + 1


class _NewIds(dict):
    """word -> id, giving each new word the next id as it is first seen (the training split's words)."""

    def __missing__(self, word: str) -> int:
        self[word] = id_ = len(self)
        return id_


def encode(lines: Iterable[tuple[int, list[str]]], stoi: dict | None, where: str) -> tuple[Sentences, dict]:
    """Token ids of (line number, words) pairs, each sentence followed by <eos>.

    With stoi=None, words get ids in order of first appearance (returned, to be sorted by vocab_order);
    with a vocabulary's stoi, unknown words become <unk>. `where` names the text in messages."""
    ids, offsets = _Ids(), array("q", [0])
    new = stoi is None
    if new:
        # id 0 is <pad>'s, held by "" (never a word) so that a <pad> in the text is new: caught in one lookup
        stoi = _NewIds({"": PAD_ID, UNK: UNK_ID, EOS: EOS_ID})
        lookup = stoi.__getitem__
    else:
        lookup = lambda w, get=stoi.get: get(w, UNK_ID)  # noqa: E731
    pending = array("i")                  # the ids of the last lines, added to `ids` a chunk at a time
    for lineno, words in lines:
        pending.extend(map(lookup, words))
        if new and PAD in stoi or not new and PAD in words:
            raise _reserved(where, lineno)
        pending.append(EOS_ID)
        offsets.append(ids.count + len(pending))
        if len(pending) >= CHUNK:
            ids.add(pending)
            del pending[:]
    ids.add(pending)
    return Sentences(ids.array(), np.frombuffer(offsets, dtype=np.int64)), stoi


class _Ids:
    """A growing int32 buffer in an anonymous memory map, enlarged in place (mremap on Linux): never copied,
    so never two of it, and handed back to the system whole when its array is dropped. Where a map cannot
    grow (macOS, Windows), a plain array, which copies itself as it grows."""

    def __init__(self):
        self.used, self.plain = 0, None
        try:
            self.map = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (AttributeError, OSError):
            self.map, self.plain = None, array("i")

    def add(self, part: array) -> None:
        need = self.used + 4 * len(part)
        if self.map is not None and need > len(self.map):
            try:
                self.map.resize(max(need, 2 * len(self.map)))   # pages not written to cost no memory
            except (OSError, SystemError, ValueError):
                self.plain = array("i", self.map[:self.used])
                self.map = None
        if self.map is None:
            self.plain.extend(part)
        else:
            self.map[self.used:need] = part.tobytes()
        self.used = need

    @property
    def count(self) -> int:
        return self.used // 4

    def array(self) -> np.ndarray:
        return np.frombuffer(self.map if self.map is not None else self.plain, dtype=np.int32, count=self.count)


def vocab_order(sentences: Sentences, first_seen: dict) -> tuple[list[str], np.ndarray]:
    """The vocabulary's words (specials first, then by count, ties by word) and the map old id -> new id.

    Sorting afterwards gives the same vocabulary as counting first: the ids are the same as ever."""
    words = list(first_seen)            # in id order: "" (<pad>'s place), <unk>, <eos>, then the words
    words[PAD_ID] = PAD
    counts = np.zeros(len(words), dtype=np.int64)
    for start in range(0, len(sentences.ids), CHUNK):   # (bincount of all ids at once makes an int64 copy)
        counts += np.bincount(sentences.ids[start:start + CHUNK], minlength=len(words))
    order = sorted(range(len(SPECIALS), len(words)), key=lambda i: (-counts[i], words[i]))
    new_id = np.arange(len(words), dtype=np.int32)
    new_id[order] = np.arange(len(SPECIALS), len(words), dtype=np.int32)
    return list(SPECIALS) + [words[i] for i in order], new_id


def renumber(ids: np.ndarray, new_id: np.ndarray) -> None:
    """ids[:] = new_id[ids], in place, a chunk at a time (so no second array of the corpus's size)."""
    for start in range(0, len(ids), CHUNK):
        part = ids[start:start + CHUNK]
        part[:] = new_id[part]
