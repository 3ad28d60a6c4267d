"""A corpus folder read once: its ids cached beside the text, reused until a file changes, shared by processes,
and read in bounded memory with progress on stderr."""
import io
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from mpedu.lm import load_corpus
from mpedu.lm.data import _Progress

FOLDER = ".mpedu-cache"         # where a corpus folder's cache goes, as data/README.md says

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, lines: int = 400) -> Path:
    """A small PTB-format folder whose words repeat (so valid and test share train's vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = [f"w{i % 97}" for i in range(lines * 7)]
    text = "".join(" " + " ".join(words[k:k + 7]) + " \n" for k in range(0, len(words), 7))
    for split, part in (("train", text), ("valid", text[: len(text) // 3]), ("test", text[len(text) // 3:])):
        (folder / f"ptb.{split}.txt").write_text(part)
    return folder


def same(a, b) -> bool:
    return a.vocab.itos == b.vocab.itos and all(
        np.array_equal(a.sentences(s).ids, b.sentences(s).ids) and
        np.array_equal(a.sentences(s).offsets, b.sentences(s).offsets) for s in ("train", "valid", "test"))


def test_a_folder_is_read_once_then_its_cache_is_mapped(tmp_path):
    folder = write_corpus(tmp_path / "c")
    first = load_corpus(folder)
    again = load_corpus(folder)
    assert (first.cache, again.cache) == ("built", "read")
    assert same(first, again) and again.blank_lines == first.blank_lines
    assert isinstance(again.train.ids, np.memmap) and not again.train.ids.flags.writeable
    assert torch.equal(again.train[3], first.train[3]) and again.train[3].dtype == torch.int64
    meta = json.loads((folder / FOLDER / "meta.json").read_text())
    assert meta["files"]["ptb.train.txt"]["bytes"] == (folder / "ptb.train.txt").stat().st_size
    uncached = load_corpus(folder, cache=False)
    assert uncached.cache is None and same(uncached, first)


def test_a_file_edited_in_place_is_read_again(tmp_path):
    folder = write_corpus(tmp_path / "c")
    load_corpus(folder)
    path = folder / "ptb.valid.txt"
    text = path.read_text()
    path.write_text(text.replace("w5 ", "w6 ", 1))       # same size: only the checksum can tell
    edited = load_corpus(folder)
    assert edited.cache == "built"
    assert same(edited, load_corpus(folder, cache=False))
    assert load_corpus(folder).cache == "read"
    assert load_corpus(folder, max_line_tokens=50).cache == "built"   # another limit: another reading


def test_a_damaged_cache_is_rebuilt_not_trusted(tmp_path):
    folder = write_corpus(tmp_path / "c")
    good = load_corpus(folder)
    ids = folder / FOLDER / "train.ids.npy"
    ids.write_bytes(ids.read_bytes()[:200])               # cut short, as by a full disk
    rebuilt = load_corpus(folder)
    assert rebuilt.cache == "built" and same(rebuilt, good)
    (folder / FOLDER / "meta.json").write_text("{not json")
    assert load_corpus(folder).cache == "built"


def test_a_folder_where_no_cache_can_be_written_is_read_without_one(tmp_path, capsys):
    folder = write_corpus(tmp_path / "c")
    (folder / FOLDER).write_text("")        # a file where the cache folder would go (root ignores chmod)
    corpus = load_corpus(folder, progress=True)
    assert corpus.cache is None and same(corpus, load_corpus(folder, cache=False))
    err = capsys.readouterr().err
    assert f"note: cannot make {folder / FOLDER}" in err and f"reading {folder} without a cache" in err


def test_progress_is_said_on_stderr_and_only_for_big_corpora_by_default(tmp_path, capsys):
    folder = write_corpus(tmp_path / "c")
    load_corpus(folder)
    assert capsys.readouterr().err == ""                 # 16 MB and less: silent unless asked
    tokens = load_corpus(folder, cache=False).tokens
    total = sum(tokens(s) for s in ("train", "valid", "test"))
    load_corpus(folder, progress=True)
    assert f"mpedu: read the cache in {folder / FOLDER}: {total:,} tokens in " in capsys.readouterr().err
    load_corpus(folder, progress=True, cache=False)
    assert f"mpedu: read {folder}: {total:,} tokens in " in capsys.readouterr().err


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("tty,every", [(False, 10), (True, 0.5)])
def test_progress_lines_come_at_a_steady_pace(monkeypatch, tty, every):
    clock, out = Clock(), io.StringIO()
    out.isatty = lambda: tty
    monkeypatch.setattr("mpedu.lm.data.time.perf_counter", clock)
    show = _Progress(1000, out)
    for step in range(1, 41):            # 40 calls, 0.25 s apart: 10 s in all
        clock.now = step * 0.25
        show(step * 25, "reading ptb.train.txt")
    lines = out.getvalue().split("\r" if tty else "\n")
    drawn = [line for line in lines if line]
    assert len(drawn) == int(10 / every)
    assert drawn[-1].startswith("mpedu: reading ptb.train.txt: 100% of 1 kB (10 s)")
    show.done("read it")
    assert out.getvalue().endswith(("\n" if tty else "") + "mpedu: read it in 10.0 s\n")


def test_two_processes_loading_at_once_build_the_cache_once(tmp_path):
    folder = write_corpus(tmp_path / "c", lines=20_000)
    script = ("import hashlib, sys; from mpedu.lm import load_corpus; c = load_corpus(sys.argv[1]); "
              "print(c.cache, hashlib.sha256(c.train.ids.tobytes() + c.test.ids.tobytes()).hexdigest())")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["built", "read", "read"]
    assert len({o[1] for o in outs}) == 1


def test_reading_holds_little_more_than_the_token_ids(tmp_path, monkeypatch):
    """What a bigger corpus adds to the reader's peak is its ids (int32) and sentence offsets (int64), plus
    a little: never the words as strings, nor an int64 copy of the ids (each ~30x or 2x the array)."""
    import tracemalloc
    for name, value in (("BLOCK", 1 << 14), ("CHUNK", 1 << 14)):
        monkeypatch.setattr(f"mpedu.lm.reading.{name}", value)   # small blocks and chunks: these corpora
        # fill many, so what each costs is the same at both sizes
    peaks, arrays = [], []
    for lines in (20_000, 80_000):                      # ~1 MB and ~4 MB of text
        folder = write_corpus(tmp_path / str(lines), lines=lines)
        tracemalloc.start()
        try:
            corpus = load_corpus(folder, cache=False)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        arrays.append(sum(corpus.sentences(s).ids.nbytes + corpus.sentences(s).offsets.nbytes
                          for s in ("train", "valid", "test")))
        del corpus
    assert peaks[1] - peaks[0] < 1.3 * (arrays[1] - arrays[0]), (peaks, arrays)


class MapThatCannotGrow(mmap.mmap):
    tried = 0

    def resize(self, size):
        MapThatCannotGrow.tried += 1
        raise SystemError("mmap: resizing not available--no mremap()")     # as on macOS


@pytest.mark.parametrize("system", ["macOS", "Windows"])
def test_where_a_memory_map_cannot_grow_the_ids_are_the_same(tmp_path, monkeypatch, system):
    folder = write_corpus(tmp_path / "c", lines=50_000)          # 400,000 ids: past the map's first 1 MB
    expected = load_corpus(folder, cache=False)
    fake = (SimpleNamespace(mmap=MapThatCannotGrow, MAP_PRIVATE=mmap.MAP_PRIVATE, MAP_ANONYMOUS=mmap.MAP_ANONYMOUS)
            if system == "macOS" else SimpleNamespace(mmap=mmap.mmap))             # Windows: no such flags
    monkeypatch.setattr("mpedu.lm.reading.mmap", fake)
    monkeypatch.setattr("mpedu.lm.reading.CHUNK", 1 << 12)      # many additions after the map stops growing
    tried = MapThatCannotGrow.tried
    assert same(load_corpus(folder, cache=False), expected)
    assert (MapThatCannotGrow.tried > tried) == (system == "macOS")


@given(st.binary(max_size=64) | st.lists(st.sampled_from([b" ", b"\t", b"\r\n", b"\x0b", b"w", b"\xc3\xa9", b"\x1c"]),
                                        max_size=24).map(b"".join))
def test_tokens_are_counted_as_bytes_split_finds_them(raw):
    from mpedu.lm.reading import _count_tokens
    assert _count_tokens(raw) == len(raw.split())


def test_a_cache_that_cannot_be_written_loses_nothing(tmp_path, monkeypatch, capsys):
    folder = write_corpus(tmp_path / "c")
    expected = load_corpus(folder, cache=False)

    def full_disk(self, *args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("mpedu.lm.corpus_cache.CorpusCache.save", full_disk)
    corpus = load_corpus(folder)
    assert corpus.cache is None and same(corpus, expected)
    assert (f"mpedu: note: could not write the cache in {folder / FOLDER} (No space left on device); the corpus "
            "was read, and will be read again next time") in capsys.readouterr().err
    monkeypatch.undo()
    assert load_corpus(folder).cache == "built"
