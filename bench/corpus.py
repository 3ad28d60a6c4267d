"""Loading a big corpus: seconds to the first training step and peak memory, at 20 MB, 200 MB and 1 GB.

    python bench/corpus.py [--sizes 20,200,1000] [--dir /tmp]

Each corpus is PTB-format text: the embedded corpus's training sentences repeated to the size asked for
(so every size has the same vocabulary and model), with the embedded valid and test splits. Every load
runs in a fresh process that reads the folder, batches the training split (BucketIterator, shuffled) and
takes one training step of the tiny model on one device; os.wait4 gives the process's peak RSS.
  cold    no cache yet: the text is read, encoded and the cache written (.mpedu-cache beside the text)
  cached  the same folder again: the checksums are verified and the ids memory-mapped
Memory: the process's peak RSS, and what the corpus costs in it (the growth of the peak from after the
imports to after the first batch is made: the step's own memory depends on that batch's length, not on the
corpus), compared with the token array (4 bytes a token). The target: at most ~3x at every size, and
seconds per MB that do not grow with the size (linear time). A 1x run (the embedded text written out
once) gives the peak RSS of a corpus that costs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import finish, machine  # noqa: E402

from mpedu.lm import synthetic  # noqa: E402

CHILD = r"""
import json, resource, sys, time
start = time.perf_counter()
import torch
from mpedu.core import SingleDevice
from mpedu.lm import BucketIterator, LSTMLM, load_corpus
torch.manual_seed(0)
ready, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corpus = load_corpus(sys.argv[1], progress=False)
loaded = time.perf_counter()
model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
batch = next(iter(BucketIterator(corpus.train, 32, shuffle=True, seed=0)))
batched = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss = SingleDevice(model).train_step(batch).loss
stepped = time.perf_counter()
print(json.dumps({"cache": corpus.cache, "tokens": sum(corpus.tokens(s) for s in ("train", "valid", "test")),
                  "sentences": sum(len(corpus.sentences(s)) for s in ("train", "valid", "test")),
                  "load_s": loaded - ready, "first_step_s": stepped - ready, "imports_s": ready - start,
                  "loss": float(loss), "corpus_rss": (batched - before) * 1024}))
"""


def ptb_text(sentences) -> bytes:
    return "".join(" " + " ".join(words) + " \n" for words in sentences).encode()


def make_corpus(folder: Path, megabytes: float, splits: dict) -> int:
    """A PTB-format folder whose ptb.train.txt is the embedded train text repeated to `megabytes` (at least
    once); returns its size in bytes."""
    folder.mkdir(parents=True)
    block = ptb_text(splits["train"])
    repeats = max(1, round(megabytes * 1e6 / len(block)))
    with open(folder / "ptb.train.txt", "wb") as f:
        for _ in range(repeats):
            f.write(block)
    for split in ("valid", "test"):
        (folder / f"ptb.{split}.txt").write_bytes(ptb_text(splits[split]))
    return repeats * len(block)


def load_in_a_fresh_process(folder: Path) -> dict:
    """The child's timings, and its peak RSS in bytes (ru_maxrss is in kB on Linux)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder)], stdout=subprocess.PIPE, env=env)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"loading {folder} failed with exit status {child.returncode}")
    return dict(json.loads(out), wall_s=time.perf_counter() - start, peak_rss=usage.ru_maxrss * 1024)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,1000", help="train file sizes in MB, comma-separated")
    parser.add_argument("--dir", default=None, help="where to write the corpora (default: a temporary folder)")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    splits = synthetic.generate(0)
    work = Path(tempfile.mkdtemp(prefix="mpedu-corpus-", dir=args.dir))
    rows = []
    try:
        base_folder = work / "1x"
        make_corpus(base_folder, 0, splits)
        load_in_a_fresh_process(base_folder)                          # builds its cache
        base = load_in_a_fresh_process(base_folder)                   # the 1x run, cached
        print(f"1x corpus ({base['tokens']:,} tokens): peak RSS {base['peak_rss'] / 1e6:.0f} MB, "
              f"first step {base['first_step_s']:.2f} s after imports")
        print(f"{'size':>8} {'tokens':>13} {'token array':>12} {'load':>12} {'first step':>11} {'s/MB':>7} "
              f"{'peak RSS':>9} {'corpus':>9} {'/ array':>8}")
        for mb in sizes:
            folder = work / f"{mb:g}MB"
            size = make_corpus(folder, mb, splits)
            for load in ("cold", "cached"):
                run = load_in_a_fresh_process(folder)
                assert run["cache"] == ("built" if load == "cold" else "read"), run
                array = 4 * run["tokens"]
                row = dict(run, load=load, megabytes=size / 1e6, token_array_bytes=array,
                           corpus_per_array=run["corpus_rss"] / array,
                           seconds_per_mb=run["first_step_s"] / (size / 1e6))
                rows.append(row)
                print(f"{size / 1e6:>6.0f}MB {run['tokens']:>13,} {array / 1e6:>9.0f} MB {load:>6} "
                      f"{run['load_s']:>4.1f}s {run['first_step_s']:>9.2f}s {row['seconds_per_mb']:>7.4f} "
                      f"{run['peak_rss'] / 1e6:>6.0f} MB {run['corpus_rss'] / 1e6:>6.0f} MB "
                      f"{row['corpus_per_array']:>7.2f}x")
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold = [r for r in rows if r["load"] == "cold"]
    summary = {"benchmark": "corpus", "runs": rows, "baseline_peak_rss": base["peak_rss"],
               "worst_corpus_per_array": max(r["corpus_per_array"] for r in rows),
               "cold_seconds_per_mb_largest_vs_smallest": cold[-1]["seconds_per_mb"] / cold[0]["seconds_per_mb"],
               "machine": machine()}
    print(f"the corpus's memory per byte of token array: at most {summary['worst_corpus_per_array']:.2f}x; "
          f"cold seconds per MB, largest size over smallest: {summary['cold_seconds_per_mb_largest_vs_smallest']:.2f}")
    finish("corpus", summary)


if __name__ == "__main__":
    main()
