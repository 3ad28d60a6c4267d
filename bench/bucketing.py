"""Bucketing through a pipeline: padding and real tokens per second against padding to the longest.

    python bench/bucketing.py [--batches 12] [--config small]

Three ways to batch the same training sentences, each run through the same 2-device
GPipe pipeline (m = 4) for the same number of batches:
  buckets         BucketIterator's default length buckets (each batch padded to its bucket)
  batch longest   random batches, each padded to its own longest sentence
  corpus longest  every batch padded to the longest sentence in the corpus (one bucket)
Real tokens are targets that are not padding; padding costs compute but teaches nothing.
Runs on the embedded corpus, and on the Penn Treebank's validation and test files when
../shared/data/ptb holds them (the project's machines have them; mpedu ships no PTB text): the vocabulary
and the training sentences are ptb.valid.txt's, the full training file not being there.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine  # noqa: E402

from mpedu.lm import BucketIterator, LSTMLM, load_corpus  # noqa: E402
from mpedu.core import Pipeline  # noqa: E402

PTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "ptb"
B, M = 32, 4


def trimmed(batches):
    """Random batches padded only to their own longest sentence: drop all-padding time steps."""
    for batch in batches:
        T = int(batch.mask.any(dim=1).nonzero().max()) + 1
        yield type(batch)(batch.inputs[:T], batch.targets[:T], batch.mask[:T], T, batch.carry_state)


def run(corpus, config: str, n_batches: int) -> list[dict]:
    torch.manual_seed(0)
    model = LSTMLM.from_config(config, vocab_size=len(corpus.vocab))
    longest = int(corpus.train.lengths().max())
    ways = {
        "buckets": BucketIterator(corpus.train, B, shuffle=True, seed=0, drop_last=True),
        "batch longest": trimmed(BucketIterator(corpus.train, B, [longest], shuffle=True, seed=0, drop_last=True)),
        "corpus longest": BucketIterator(corpus.train, B, [longest], shuffle=True, seed=0, drop_last=True),
    }
    rows = []
    with Pipeline(model, 2, "gpipe", micro_batches=M) as pipe:
        warm = next(iter(ways["buckets"]))
        pipe.train_step(warm)
        for name, batches in ways.items():
            tokens = slots = 0
            seconds = 0.0
            for k, batch in zip(range(n_batches), batches):
                model.zero_grad()
                start = time.perf_counter()
                pipe.train_step(batch)
                seconds += time.perf_counter() - start
                tokens += batch.tokens
                slots += batch.targets.numel()
            rows.append({"corpus": corpus.name, "batching": name, "padding_fraction": 1 - tokens / slots,
                         "real_tokens_per_s": tokens / seconds, "batches": n_batches,
                         "shapes": len(pipe.bucket_cache)})
            pipe.bucket_cache.clear()
    stats = ways["buckets"].stats()
    rows[0]["epoch_padding_fraction"] = stats.padding_fraction
    return rows


def ptb_corpus(folder: Path):
    """PTB with valid as training text and test as held-out (the full train file is not shipped)."""
    tmp = Path(tempfile.mkdtemp(prefix="mpedu-ptb-"))
    shutil.copy(folder / "ptb.valid.txt", tmp / "ptb.train.txt")
    shutil.copy(folder / "ptb.test.txt", tmp / "ptb.valid.txt")
    shutil.copy(folder / "ptb.test.txt", tmp / "ptb.test.txt")
    try:
        corpus = load_corpus(tmp)
    finally:
        shutil.rmtree(tmp)
    corpus.name = "PTB (valid as train)"
    return corpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--config", default="small")
    args = parser.parse_args(argv)
    corpora = [load_corpus()]
    if PTB.is_dir():
        corpora.append(ptb_corpus(PTB))
    rows = [row for corpus in corpora for row in run(corpus, args.config, args.batches)]
    print(f"{args.config} model, 2 virtual devices, GPipe m={M}, batch {B}, {args.batches} batches per way")
    print(f"{'corpus':<24}{'batching':<16}{'padding':>9}{'real tokens/s':>15}{'vs buckets':>12}")
    summary = {}
    for row in rows:
        base = next(r for r in rows if r["corpus"] == row["corpus"] and r["batching"] == "buckets")
        row["vs_buckets"] = row["real_tokens_per_s"] / base["real_tokens_per_s"]
        print(f"{row['corpus']:<24}{row['batching']:<16}{row['padding_fraction']:>9.1%}"
              f"{row['real_tokens_per_s']:>15.0f}{row['vs_buckets']:>11.2f}x")
        summary[f"{row['corpus']}: {row['batching']}"] = row
    embedded = [r for r in rows if r["corpus"] == corpora[0].name]
    finish("bucketing", {"benchmark": "bucketing", "runs": summary,
                         "padding_buckets": embedded[0]["padding_fraction"],
                         "padding_batch_longest": embedded[1]["padding_fraction"],
                         "speedup_over_batch_longest": 1 / embedded[1]["vs_buckets"],
                         "speedup_over_corpus_longest": 1 / embedded[2]["vs_buckets"],
                         "machine": machine()})


if __name__ == "__main__":
    main()
