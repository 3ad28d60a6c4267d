"""train()'s settings, checked before anything trains: numbers, the corpus, the runner, and every split's
batches (a setting the data cannot meet fails now, not after an hour)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.pipeline import Pipeline
from ..core.runner import Runner
from ..core.single import SingleDevice
from ..predict.capacity import cap_memory
from ..runtime.values import check_number
from .recipes import LR


@dataclass
class Settings:
    """train()'s arguments, checked. `given_lr` is the lr the caller gave (None: LR, or a checkpoint's)."""

    epochs: int
    batch_size: int
    lr: float
    given_lr: float | None
    clip: float | None
    seed: int
    bptt: int | None
    buckets: list | None
    checkpoint_every: int | None
    limit_batches: int | None
    lr_decay: tuple[int, float] | None

    @property
    def kept(self) -> dict:
        """What a checkpoint keeps and a resume must match."""
        return {"batch_size": self.batch_size, "seed": self.seed, "bptt": self.bptt,
                "buckets": list(self.buckets) if self.buckets else None, "limit_batches": self.limit_batches}


def check_settings(epochs, batch_size, lr, clip, seed, bptt, buckets, checkpoint_every, limit_batches,
                   lr_decay) -> Settings:
    epochs = check_number("epochs", epochs, integer=True)
    batch_size = check_number("batch_size", batch_size, integer=True, minimum=1)
    given_lr = check_number("lr", lr, above=True, maximum=torch.finfo(torch.float32).max, none_ok=True)  # SGD: float
    clip = check_number("clip", clip, none_ok=True) or None        # 0 means no clipping
    seed = check_number("seed", seed, integer=True, maximum=2**63)   # what every generator accepts
    bptt = check_number("bptt", bptt, integer=True, minimum=1, none_ok=True)
    checkpoint_every = check_number("checkpoint_every", checkpoint_every, integer=True, none_ok=True)
    limit_batches = check_number("limit_batches", limit_batches, integer=True, minimum=1, none_ok=True)
    if lr_decay is not None:
        if not isinstance(lr_decay, (tuple, list)) or len(lr_decay) != 2:
            raise ValueError(f"lr_decay={lr_decay!r}: expected (first epoch, factor), e.g. (5, 2.0), or None")
        lr_decay = (check_number("lr_decay's first epoch", lr_decay[0], integer=True, minimum=1),
                    check_number("lr_decay's factor", lr_decay[1], above=True))
    return Settings(epochs, batch_size, LR if given_lr is None else given_lr, given_lr, clip, seed, bptt, buckets,
                    checkpoint_every, limit_batches, lr_decay)


def check_corpus(corpus) -> None:
    if not all(hasattr(corpus, k) for k in ("train", "vocab", "sentences")):
        raise TypeError(f"train needs a Corpus (mpedu.load_corpus()), got {type(corpus).__name__}; pass the whole "
                        "corpus, not one split: its training, validation and test sentences are all used")


def check_runner(runner, model, clip, memory_cap, log):
    """The runner train() steps (SingleDevice by default), with the memory cap installed on a Pipeline."""
    runner = runner or SingleDevice(model)
    if not isinstance(runner, Runner):
        raise TypeError(f"runner={runner!r} is not a runner; give a Pipeline or SingleDevice built on this model, "
                        "e.g. runner=mpedu.Pipeline(model, placement, 'gpipe')")
    if runner.model is not model:
        raise ValueError("the runner was built on another model than the one given to train (the optimizer "
                         "would update weights whose gradients never come); build it on this model: "
                         "Pipeline(model, ...)")
    if memory_cap is not None:
        if not isinstance(runner, Pipeline):
            raise ValueError(f"memory_cap applies to a Pipeline's devices, but the runner is {type(runner).__name__}; "
                             "give runner=mpedu.Pipeline(model, placement, schedule)")
        cap_memory(runner, memory_cap)
    own_clip = runner.clip                                # a DistributedPipeline built with clip= clips each step
    if own_clip and clip and own_clip != clip:
        log(f"note: the runner clips each step's gradients at {own_clip:g} itself, and train's clip={clip:g} clips "
            f"them again (to the smaller); pass clip=None to train, or build the runner without clip=")
    return runner


def batch_every_split(corpus, s: Settings, chunks: int, make_batches, log):
    """The training batches, after batching every split once: a setting the data cannot meet (a bad
    bucket list, time chunks longer than a bucket) fails now. Returns (train batches, {split: its
    batch count} for the splits limit_batches evaluates only in part)."""
    cut = {}
    for split in ("train", "valid", "test"):
        try:
            batches = make_batches(corpus.sentences(split), s.batch_size, bptt=s.bptt, buckets=s.buckets,
                                   shuffle=split == "train", seed=s.seed, whole=split != "train")
        except ValueError as e:             # a stream the data cannot fill: say which split
            if s.bptt:
                raise ValueError(f"{corpus.name}'s {split} split: {e}") from None
            raise
        if split == "train":
            train_batches = batches
        elif s.limit_batches is not None and s.limit_batches < len(batches):
            cut[split] = len(batches)
        if chunks > 1 and chunks > (shortest := _shortest_time_steps(batches)):
            raise ValueError(f"chunks={chunks}, but some {split} batches have only {shortest} time steps; "
                             f"use at most {shortest} chunks, or buckets (or bptt) of at least {chunks} steps")
    if cut:         # said once, up front: the numbers below are not the splits' perplexities
        order = "the first windows of the stream" if s.bptt else "in length order, shortest sentences first"
        log(f"note: limit_batches={s.limit_batches} (--limit-batches): the valid and test perplexities cover only "
            f"their first batches ({', '.join(f'{k} {s.limit_batches} of {n}' for k, n in cut.items())}; {order}), "
            "not the whole splits")
    return train_batches, cut


def _shortest_time_steps(batches) -> int:
    """The fewest time steps any batch of this iterator can have (a wavefront needs chunks <= T)."""
    bptt = getattr(batches, "bptt", None)
    if bptt is not None:                          # StreamIterator: full windows, the last one shorter
        return min(bptt, batches.steps % bptt or bptt)
    # every piece but a sentence's last fills the largest bucket, so the smallest bucket in use has the fewest
    return min(batches.used_buckets)
