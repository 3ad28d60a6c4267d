"""The training loop: train(), evaluate(), and the one SGD step they, the command line and the explorer take."""
from __future__ import annotations

import math
import random
import time
from itertools import islice

import torch
from tqdm.auto import tqdm

from ..core.runner import StepResult, fitted
from ..core.single import SingleDevice
from ..lm.model import LSTMLM
from .checkpoint import CheckpointError
from .checkpointer import Checkpointer, holding_out
from .faults import NumericFault, all_finite, find_fault
from .history import History, perplexity
# the defaults are the tiny recipe's (mpedu.training.recipes explains them and the learning-rate convention)
from .recipes import BATCH_SIZE, CLIP, EPOCHS, LR  # noqa: F401 (LR: the default lr, for readers of this module)
from .resume import fresh_totals, restore
from .settings import batch_every_split, check_corpus, check_runner, check_settings

CHECKPOINT_EVERY = 200       # steps (batches) within an epoch; every epoch end too


def next_lr(lr: float, valid_ppls: list[float], *, min_gain: float = 1.0, factor: float = 0.5) -> float:
    """MXNet's rule: halve the learning rate when validation perplexity improved by less than 1.0."""
    if len(valid_ppls) >= 2 and valid_ppls[-2] - valid_ppls[-1] < min_gain:
        return lr * factor
    return lr


def scheduled_lr(lr: float, epoch: int, first: int, factor: float) -> float:
    """Zaremba et al.'s rule: after epoch `first` (1-based) and every epoch after it, divide lr by `factor`."""
    return lr / factor if epoch >= first else lr


def make_batches(sentences, batch_size: int, *, bptt: int | None = None, buckets=None,
                 shuffle: bool = False, seed: int = 0, whole: bool = False):
    """A BucketIterator over sentences, or a StreamIterator (carried state) when `bptt` is given.
    whole=True (evaluation): one more bucket, as long as the longest sentence, where the buckets would cut
    it into pieces that each start from a fresh state: a perplexity is the whole sentences'."""
    from ..lm.bucketing import BucketIterator, StreamIterator
    if bptt:
        return StreamIterator(sentences, batch_size, bptt)
    batches = BucketIterator(sentences, batch_size, buckets, shuffle=shuffle, seed=seed)
    if whole and batches.split_sentences:
        batches = BucketIterator(sentences, batch_size, batches.buckets + [int(batches.lengths.max())], shuffle=shuffle,
                                 seed=seed)
    return batches


def stream_columns(state: dict, batch_size: int) -> dict:
    """A carried state's first batch_size columns: the stream's own (a runner's batch may have been widened by
    empty columns, mpedu.core.runner.fitted)."""
    return {name: tuple(t[:, :batch_size] for t in ts) for name, ts in state.items()}


def evaluate(runner, sentences, batch_size: int, *, bptt: int | None = None, buckets=None,
             limit: int | None = None) -> float:
    """Perplexity over all real tokens of `sentences`: exp(total NLL / total tokens), each sentence whole
    (from a fresh state; make_batches(whole=True)), or in stream mode the stream with its state carried.

    `runner` is a SingleDevice or Pipeline (a bare LSTMLM is wrapped in SingleDevice).
    `limit` evaluates only the first batches (for smoke tests).
    """
    if isinstance(runner, torch.nn.Module):
        runner = SingleDevice(runner, next(runner.parameters()).device)
    nll, tokens = 0.0, 0
    runner.reset_state()
    for batch in islice(make_batches(sentences, batch_size, bptt=bptt, buckets=buckets, whole=True), limit):
        result = runner.eval_step(fitted(runner, batch))
        nll, tokens = nll + result.nll_sum, tokens + result.tokens
    runner.reset_state()
    if tokens == 0:
        raise ValueError(f"evaluate() found no tokens in {len(sentences)} sentences; pass a non-empty split")
    return perplexity(nll, tokens)


def step(runner, optimizer, batch, *, clip: float | None = CLIP) -> tuple[StepResult, bool]:
    """One training step, the same for train(), the command line and the explorer widget: zero the
    gradients, `runner.train_step` (gradients accumulate in .grad), then, only if the loss and every
    gradient are finite, clip the gradients' norm to `clip` (None or 0: no clipping) and step.

    Returns (the step's result, whether the optimizer stepped). When it did not, the non-finite
    gradients are left in .grad for the caller to diagnose (mpedu.training.faults.find_fault) and drop.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    result = runner.train_step(fitted(runner, batch))
    if not (result.finite and math.isfinite(result.loss)
            and all_finite([p.grad for p in params if p.grad is not None])):
        return result, False
    if clip:
        # a runner holding part of the model (a torchrun rank) clips over every rank's gradients
        runner.clip_grad_norm(clip)
    optimizer.step()
    return result, True


def _format_epoch(r: dict, epochs: int) -> str:
    skipped = f"  ({r['skipped_batches']} bad batches skipped)" if r.get("skipped_batches") else ""
    return (f"epoch {r['epoch']:>3}/{epochs}  train ppl {r['train_ppl']:9.2f}  valid ppl {r['valid_ppl']:9.2f}  "
            f"lr {r['lr']:<8.4g} {r['tokens_per_s']:>9,.0f} tok/s  {r['seconds']:6.1f} s{skipped}")


@holding_out
def train(model: LSTMLM, corpus, *, runner=None, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
          lr: float | None = None, clip: float | None = CLIP, seed: int = 0, out=None, resume: bool = False,
          bptt: int | None = None, buckets=None, checkpoint_every: int = CHECKPOINT_EVERY,
          limit_batches: int | None = None, skip_bad_batches: bool = False, log=print,
          progress: bool = True, lr_decay: tuple[int, float] | None = None, memory_cap=None,
          callbacks: dict | None = None) -> History:
    """Train with SGD and gradient-norm clipping; return the History.

    runner: SingleDevice(model) by default, or a Pipeline built on `model`.
    lr halves after an epoch whose validation perplexity improved by less than 1.0; or, with
      lr_decay=(k, f), is divided by f after every epoch from epoch k on (Zaremba et al.'s rule).
    out: folder for `checkpoint.pt` (every `checkpoint_every` batches and each epoch end)
      and `model.pt` (final weights + config + vocabulary); created if missing, and locked
      while this runs (a second run on it is refused, naming this one). resume=True continues from
      out/checkpoint.pt exactly, even mid-epoch (in stream mode with the state carried into the next batch);
      the lr then comes from the checkpoint, unless `lr` is given and differs from the lr the
      checkpoint's run was given (then `lr` wins, and the run says so). lr=None: LR (10), or
      the checkpoint's on resume. The checkpoint loads onto any placement.
      A checkpoint past `epochs` is refused (CheckpointError); one at exactly `epochs` trains
      nothing and is left as it is.
    bptt: stream mode (StreamIterator, state carried across batches) instead of buckets.
    memory_cap: a cap on each pipeline device's memory ("60MB", or {device: size}), installed on the
      Pipeline runner (mpedu.predict.cap_memory) and checked before the first step on each batch shape.
    limit_batches: use only the first N batches of every split each epoch (smoke tests).
    A NaN or inf loss or gradient raises NumericFault naming the step, the layer and (in a
      pipeline) its stage and device, before the optimizer steps; the last good checkpoint
      stays as it was. skip_bad_batches=True skips such a batch instead (its gradients are
      dropped), counts it in the history ("skipped_batches") and carries on.
    Seeds torch and `random` from `seed`; the data order depends only on (seed, epoch).
    callbacks: {"on_batch_end": f(epoch, batch index, StepResult), "on_epoch_end": f(the epoch's record)},
      called as training goes (as minGPT's trainer does): a notebook can draw its own progress there.
    """
    s = check_settings(epochs, batch_size, lr, clip, seed, bptt, buckets, checkpoint_every, limit_batches, lr_decay)
    check_corpus(corpus)
    runner = check_runner(runner, model, s.clip, memory_cap, log)
    hooks = _hooks(callbacks)
    # built after the runner: the Pipeline moves layers in place, so these are the live Parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=s.lr)
    options = {"lr": float(s.lr), "clip": s.clip, "lr_decay": list(s.lr_decay) if s.lr_decay else None,  # may change
               "micro_batches": runner.micro_batches if runner.micro_batch_sizes is None  # unequal: their sizes
               else list(runner.micro_batch_sizes), "chunks": runner.chunks}
    placement = str(runner.placement) if runner.placement is not None else None
    train_batches, cut = batch_every_split(corpus, s, runner.chunks, make_batches, log)
    torch.manual_seed(s.seed)
    random.seed(s.seed)
    runner.dropout_seed = s.seed       # dropout masks: a function of (seed, global step, position); mpedu.lm.dropout
    if resume and out is None:
        raise ValueError("resume=True needs out=<folder holding checkpoint.pt>")
    files = Checkpointer(out, model, runner, optimizer, corpus.vocab, s, options, placement, log)
    history, first_epoch, first_batch, totals, carried = _start(files, resume, corpus, s, log)
    for epoch in range(first_epoch, s.epochs):
        start = first_batch if epoch == first_epoch else 0
        totals = _train_epoch(runner, optimizer, train_batches, epoch, start, totals, carried if start else None,
                              s, files, history, skip_bad_batches, progress, hooks, log)
        valid_ppl = evaluate(runner, corpus.valid, s.batch_size, bptt=s.bptt, buckets=s.buckets, limit=s.limit_batches)
        record = _epoch_record(epoch, optimizer, totals, valid_ppl)
        history.epochs.append(record)
        log(_format_epoch(record, s.epochs))
        hooks["on_epoch_end"](record)
        lr = optimizer.param_groups[0]["lr"]
        lr = next_lr(lr, history.valid_ppls) if s.lr_decay is None else scheduled_lr(lr, epoch + 1, *s.lr_decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        files.save(epoch + 1, 0, fresh_totals(), history)
    if first_epoch == s.epochs and history.test_ppl is not None:
        # resumed from a finished run with the same --epochs: nothing to train, nothing rewritten
        log(f"nothing to train: {files.path} has finished all {s.epochs} epochs (test ppl {history.test_ppl:.2f}); "
            f"pass --epochs {s.epochs + 1} or more to train further")
        if not files.model_file_holds_the_model():     # stopped between its last two writes, or altered since
            log(f"{files.out / 'model.pt'} did not hold these weights; written again from the checkpoint")
            files.save_model()
        return history
    history.test_ppl = evaluate(runner, corpus.test, s.batch_size, bptt=s.bptt, buckets=s.buckets,
                                limit=s.limit_batches)
    if files.out is not None:
        files.save(s.epochs, 0, fresh_totals(), history)
        files.save_model()
    log(f"test ppl {history.test_ppl:.2f}" + (f" (its first {s.limit_batches} of {cut['test']} batches)"
                                               if "test" in cut else "")
        + (f"  (saved {files.out / 'model.pt'})" if files.out else ""))
    return history


def _hooks(callbacks: dict | None) -> dict:
    known = ("on_batch_end", "on_epoch_end")
    callbacks = dict(callbacks or {})
    unknown = [k for k in callbacks if k not in known]
    if unknown or not all(callable(f) for f in callbacks.values()):
        raise ValueError(f"callbacks={callbacks!r}: give {{event: function}} with events from {', '.join(known)}")
    return {k: callbacks.get(k, lambda *args: None) for k in known}


def _start(files: Checkpointer, resume: bool, corpus, s, log):
    """(history, first epoch, first batch, totals, carried state): afresh, or where the checkpoint stopped."""
    start = History(), 0, 0, fresh_totals(), None
    path = files.path
    if resume and path.exists():
        start = restore(path, files.model, files.optimizer, corpus.vocab, s.kept, files.options,
                        s.given_lr is not None, s.epochs, files.placement, log)
    elif path is not None and path.exists():
        log(f"starting afresh; {path} will be overwritten (pass resume=True / --resume to continue it)")
    elif resume:
        log(f"no checkpoint at {path}; starting afresh")
    if start[1] < s.epochs:
        start[0].test_ppl = None         # a run extended past its end: the old test perplexity is not this model's
    return start


def _train_epoch(runner, optimizer, train_batches, epoch: int, start: int, totals: dict, carried, s,
                 files: Checkpointer, history, skip_bad_batches: bool, progress: bool, hooks: dict, log) -> dict:
    """One epoch's training steps from batch `start` (a resume) on; returns the epoch's totals."""
    started = time.perf_counter()
    if hasattr(train_batches, "set_epoch"):
        train_batches.set_epoch(epoch)
    n_batches = min(len(train_batches), s.limit_batches or len(train_batches))
    if start and start >= n_batches:      # mpedu writes a mid-epoch position below the epoch's length
        raise CheckpointError(f"checkpoint {files.path} says it stopped at batch {start:,} of epoch {epoch + 1}, "
                              f"but an epoch here has {n_batches:,} batches (batch size {s.batch_size}"
                              + (f", --limit-batches {s.limit_batches}" if s.limit_batches else "")
                              + "): it was edited, or the data or batch size changed; delete it, or pick "
                              "another --out")
    if start == 0:
        totals = fresh_totals()
    clock = {"started": started, "earlier": totals["train_seconds"]}   # time before a resume counts too
    runner.reset_state()
    if start > 0 and carried is not None:   # stream mode, resumed mid-epoch: the state the stop left
        if runner.carries_state:                    # (a checkpoint written before the cut may be wider)
            runner.load_carried_state(stream_columns(carried, s.batch_size))
        else:
            log(f"note: {type(runner).__name__} cannot take the carried state back; it starts afresh")
    # The order is a function of (seed, epoch), so skipping `start` batches lands where we stopped.
    todo = islice(iter(train_batches), start, n_batches)
    bar = tqdm(todo, total=n_batches, initial=start, desc=f"epoch {epoch + 1}/{s.epochs}", unit="batch",
               leave=False, disable=not progress)
    for i, batch in enumerate(bar, start):
        t0 = time.perf_counter()
        runner.dropout_step = epoch * n_batches + i     # from the position alone: a resume draws the same masks
        result, stepped = step(runner, optimizer, batch, clip=s.clip)
        if stepped:
            _count(totals, result)
        else:
            _bad_batch(runner, optimizer, batch, result, epoch, i, n_batches, s, files, skip_bad_batches, log)
            totals["skipped"] += 1
        totals["train_seconds"] += time.perf_counter() - t0
        if totals["steps"] % 20 == 0 and totals["tokens"]:
            bar.set_postfix(ppl=f"{perplexity(totals['nll'], totals['tokens']):.1f}", refresh=False)
        hooks["on_batch_end"](epoch, i, result)
        if s.checkpoint_every and (i + 1) % s.checkpoint_every == 0 and i + 1 < n_batches:
            files.save(epoch, i + 1, totals, history)
    bar.close()
    if totals["skipped"] and totals["steps"] == 0:
        raise NumericFault(f"every batch of epoch {epoch + 1} was bad and skipped ({totals['skipped']}); lower the "
                           f"learning rate (now {optimizer.param_groups[0]['lr']:g}); {files.kept()}",
                           step=(epoch + 1) * n_batches)
    totals = dict(totals)
    totals["seconds"] = time.perf_counter() - clock["started"] + clock["earlier"]
    return totals


def _count(totals: dict, result) -> None:
    totals["nll"] += result.nll_sum
    totals["tokens"] += result.tokens
    totals["steps"] += 1
    bubble = getattr(result.timeline, "bubble_fraction", None)
    if bubble is not None:
        totals["bubble_sum"] += float(bubble)
        totals["bubble_steps"] += 1


def _bad_batch(runner, optimizer, batch, result, epoch, i, n_batches, s, files, skip_bad_batches, log) -> None:
    """A step whose loss or gradients were not finite: raise NumericFault naming where, or skip the batch."""
    step_no = epoch * n_batches + i + 1
    found = find_fault(runner.model, runner, batch)
    what = f"loss {result.loss}" if not math.isfinite(result.loss) else \
        f"a non-finite gradient (loss {result.loss:.4g})"
    if not skip_bad_batches or found.in_weights:
        advice = ("the weights themselves are broken, so skipping batches cannot help: resume from "
                  "the last good checkpoint with a lower learning rate" if found.in_weights else
                  "or skip such batches with skip_bad_batches=True (--skip-bad-batches)")
        raise NumericFault(
            f"training diverged at step {step_no}: {what} at epoch {epoch + 1}, batch {i}; lower the "
            f"learning rate (now {optimizer.param_groups[0]['lr']:g}) or the clip (now {s.clip}), {advice}. First "
            f"non-finite: {found}. The optimizer did not step; {files.kept()}",
            step=step_no, layer=found.layer, stage=found.stage, device=found.device)
    optimizer.zero_grad(set_to_none=True)   # the bad gradients never reach the weights
    runner.reset_state()                    # nor does a carried state that saw them
    log(f"skipped batch {i} of epoch {epoch + 1} (step {step_no}): {what}; first non-finite: {found}")


def _epoch_record(epoch: int, optimizer, totals: dict, valid_ppl: float) -> dict:
    return {
        "epoch": epoch + 1, "lr": optimizer.param_groups[0]["lr"],
        "train_ppl": perplexity(totals["nll"], totals["tokens"]), "valid_ppl": valid_ppl,
        "tokens_per_s": totals["tokens"] / totals["train_seconds"] if totals["train_seconds"] else 0.0,
        "seconds": totals["seconds"],
        "tokens": totals["tokens"], "steps": totals["steps"], "train_seconds": totals["train_seconds"],
        "bubble_fraction": totals["bubble_sum"] / totals["bubble_steps"] if totals["bubble_steps"] else None,
        "skipped_batches": totals["skipped"],
    }
