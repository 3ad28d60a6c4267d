"""The training loop: train(), evaluate(), and the one SGD step they, the command line and the explorer take."""
from __future__ import annotations

import bisect
import functools
import math
import random
import time
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import CheckpointError, load_model, remove_stale_temp, save_checkpoint, save_model
from ..runtime.files import OutLock, WriteFailed, prepare_out, why
from .faults import NumericFault, all_finite, find_fault
from .history import History, perplexity
from ..lm.model import LSTMLM
from ..runtime.values import check_number
# the defaults are the tiny recipe's (mpedu.training.recipes explains them and the learning-rate convention)
from .recipes import BATCH_SIZE, CLIP, EPOCHS, LR
from .resume import fresh_totals, restore
from ..core.runner import Runner, StepResult, fitted
from ..core.pipeline import Pipeline
from ..core.single import SingleDevice
from ..predict.capacity import cap_memory

CHECKPOINT_EVERY = 200       # steps (batches) within an epoch; every epoch end too


def next_lr(lr: float, valid_ppls: list[float], *, min_gain: float = 1.0, factor: float = 0.5) -> float:
    """MXNet's rule: halve the learning rate when validation perplexity improved by less than 1.0."""
    if len(valid_ppls) >= 2 and valid_ppls[-2] - valid_ppls[-1] < min_gain:
        return lr * factor
    return lr


def scheduled_lr(lr: float, epoch: int, first: int, factor: float) -> float:
    """Zaremba et al.'s rule: after epoch `first` (1-based) and every epoch after it, divide lr by `factor`."""
    return lr / factor if epoch >= first else lr


def _at(epoch: int, batch: int) -> str:
    """Where a checkpoint stands, as a person counts: position (2, 0) is the end of epoch 2, not epoch 3."""
    return f"after epoch {epoch}" if batch == 0 and epoch > 0 else f"at epoch {epoch + 1}, batch {batch}"


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
        batches = BucketIterator(sentences, batch_size, batches.buckets + [max(batches.lengths)], shuffle=shuffle,
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


def _shortest_time_steps(batches) -> int:
    """The fewest time steps any batch of this iterator can have (a wavefront needs chunks <= T)."""
    bptt = getattr(batches, "bptt", None)
    if bptt is not None:                          # StreamIterator: full windows, the last one shorter
        n = batches.inputs.shape[0]
        return min(bptt, n % bptt or bptt)
    cap, buckets = batches.buckets[-1], batches.buckets
    # a sentence's last piece (the only one unless it is longer than the largest bucket) sets its bucket
    return min(buckets[bisect.bisect_left(buckets, n - cap * ((n - 1) // cap))] for n in batches.lengths)


def _holding_out(train_fn):
    """train() with its `out` folder created if need be and locked for the whole run (mpedu.runtime.files.OutLock):
    another run writing the same checkpoint.pt, in this process or another, is refused, naming the first."""
    @functools.wraps(train_fn)
    def locked(model, corpus, **kwargs):
        if kwargs.get("out") is None:
            return train_fn(model, corpus, **kwargs)
        runner = kwargs.get("runner")
        owned = runner.owned if isinstance(runner, Runner) else None    # a torchrun rank's layers
        if owned is not None and set(owned) != set(model.layer_names):
            raise ValueError(f"out= saves checkpoints of the whole model, but this runner (one torchrun rank) trains "
                             f"only {', '.join(owned)}: the other layers' weights here are their first ones. Leave "
                             "out=None under torchrun and gather the trained weights at the end with "
                             "runner.gather_state_dict(), as python -m mpedu.distributed train does for model.pt")
        if isinstance(runner, Runner) and runner.world > 1:     # data parallel: every rank holds every layer
            raise ValueError(f"out= would have each of the {runner.world} torchrun ranks write the same checkpoint; "
                             "leave out=None under torchrun and save the weights from rank 0 at the end")
        with OutLock(prepare_out(kwargs["out"]), log=kwargs.get("log", print)):
            return train_fn(model, corpus, **kwargs)
    return locked


@_holding_out
def train(model: LSTMLM, corpus, *, runner=None, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
          lr: float | None = None, clip: float | None = CLIP, seed: int = 0, out=None, resume: bool = False,
          bptt: int | None = None, buckets=None, checkpoint_every: int = CHECKPOINT_EVERY,
          limit_batches: int | None = None, skip_bad_batches: bool = False, log=print,
          progress: bool = True, lr_decay: tuple[int, float] | None = None, memory_cap=None) -> History:
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
    """
    epochs = check_number("epochs", epochs, integer=True)
    batch_size = check_number("batch_size", batch_size, integer=True, minimum=1)
    given_lr = check_number("lr", lr, above=True, maximum=torch.finfo(torch.float32).max, none_ok=True)  # SGD: float
    lr = LR if given_lr is None else given_lr
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
    if not all(hasattr(corpus, k) for k in ("train", "vocab", "sentences")):
        raise TypeError(f"train needs a Corpus (mpedu.load_corpus()), got {type(corpus).__name__}; pass the whole "
                        "corpus, not one split: its training, validation and test sentences are all used")
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
    # built after the runner: the Pipeline moves layers in place, so these are the live Parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = Path(out) if out is not None else None
    ckpt_path = out / "checkpoint.pt" if out else None
    settings = {"batch_size": batch_size, "seed": seed, "bptt": bptt, "buckets": list(buckets) if buckets else None,
                "limit_batches": limit_batches}
    options = {"lr": float(lr), "clip": clip, "lr_decay": list(lr_decay) if lr_decay else None,   # a resume may change
               "micro_batches": runner.micro_batches, "chunks": runner.chunks}
    placement = str(runner.placement) if runner.placement is not None else None
    # Every split is batched before anything is trained, so a setting the data cannot meet
    # (a bad bucket list, time chunks longer than a bucket) fails now, not after an hour.
    chunks = runner.chunks
    cut = {}                                # split -> its batches, where limit_batches evaluates only part
    for split in ("train", "valid", "test"):
        try:
            batches = make_batches(corpus.sentences(split), batch_size, bptt=bptt, buckets=buckets,
                                   shuffle=split == "train", seed=seed, whole=split != "train")
        except ValueError as e:             # a stream the data cannot fill: say which split
            if bptt:
                raise ValueError(f"{corpus.name}'s {split} split: {e}") from None
            raise
        if split == "train":
            train_batches = batches
        elif limit_batches is not None and limit_batches < len(batches):
            cut[split] = len(batches)
        if chunks > 1 and chunks > (shortest := _shortest_time_steps(batches)):
            raise ValueError(f"chunks={chunks}, but some {split} batches have only {shortest} time steps; "
                             f"use at most {shortest} chunks, or buckets (or bptt) of at least {chunks} steps")
    if cut:         # said once, up front: the numbers below are not the splits' perplexities
        order = "the first windows of the stream" if bptt else "in length order, shortest sentences first"
        log(f"note: limit_batches={limit_batches} (--limit-batches): the valid and test perplexities cover only "
            f"their first batches ({', '.join(f'{k} {limit_batches} of {n}' for k, n in cut.items())}; {order}), "
            "not the whole splits")
    history, first_epoch, first_batch, totals, carried = History(), 0, 0, fresh_totals(), None
    torch.manual_seed(seed)
    random.seed(seed)
    runner.dropout_seed = seed       # dropout masks: a function of (seed, global step, position); mpedu.lm.dropout

    if resume and ckpt_path is None:
        raise ValueError("resume=True needs out=<folder holding checkpoint.pt>")
    if ckpt_path is not None:
        for stale in remove_stale_temp(ckpt_path) + remove_stale_temp(out / "model.pt"):
            log(f"removed {stale}, a file an interrupted run was writing (never read)")
    if resume and ckpt_path.exists():
        history, first_epoch, first_batch, totals, carried = restore(
            ckpt_path, model, optimizer, corpus.vocab, settings, options, given_lr is not None, epochs, placement, log)
    elif ckpt_path is not None and ckpt_path.exists():
        log(f"starting afresh; {ckpt_path} will be overwritten (pass resume=True / --resume to continue it)")
    elif resume:
        log(f"no checkpoint at {ckpt_path}; starting afresh")
    if first_epoch < epochs:
        history.test_ppl = None         # a run extended past its end: the old test perplexity is not this model's
    lr = optimizer.param_groups[0]["lr"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    last_saved = None      # (epoch, batch) of the newest checkpoint this run wrote

    def checkpoint(epoch: int, batch: int, totals: dict) -> None:
        nonlocal last_saved
        if ckpt_path is None:
            return
        if not all_finite([p.detach() for p in params]):   # never replace a good checkpoint by a broken model
            found = find_fault(model, runner)
            raise NumericFault(f"the weights became non-finite before the checkpoint {_at(epoch, batch)}: {found}; "
                               f"{ckpt_path} keeps the last good state. Lower the "
                               f"learning rate (now {lr:g}) and resume", layer=found.layer,
                               stage=found.stage, device=found.device)
        # mid-epoch in stream mode, the state the next batch starts from (any runner loads it): its first
        # batch_size columns, the stream's; a pipeline's batch was widened by empty columns (fitted) when its
        # micro-batches do not divide batch_size, and another runner's is not
        state = runner.carried_state() if bptt and batch > 0 else None
        if state is not None:
            state = stream_columns(state, batch_size)
        try:
            save_checkpoint(ckpt_path, model=model, optimizer=optimizer, vocab=corpus.vocab, history=history,
                            epoch=epoch, batch=batch, totals=totals, placement=placement, settings=settings,
                            options=options, carried=state)
        except OSError as e:      # disk full, a file-size limit, ...: the old checkpoint is untouched
            raise WriteFailed(f"cannot write the checkpoint {_at(epoch, batch)} to {ckpt_path}: "
                              f"{why(e)}; {kept()}. Free some space (or pick another --out) and resume") from e
        last_saved = (epoch, batch)

    def kept() -> str:
        if ckpt_path is None:
            return "nothing was saved (no out folder)"
        if last_saved is None:
            return (f"{ckpt_path} is as it was before this run" if ckpt_path.exists()
                    else "no checkpoint was written yet")
        return f"the last good checkpoint, {ckpt_path} (epoch {last_saved[0] + 1}, batch {last_saved[1]}), is kept"

    for epoch in range(first_epoch, epochs):
        started = time.perf_counter()
        if hasattr(train_batches, "set_epoch"):
            train_batches.set_epoch(epoch)
        n_batches = min(len(train_batches), limit_batches or len(train_batches))
        start = first_batch if epoch == first_epoch else 0
        if start and start >= n_batches:      # mpedu writes a mid-epoch position below the epoch's length
            raise CheckpointError(f"checkpoint {ckpt_path} says it stopped at batch {start:,} of epoch {epoch + 1}, "
                                  f"but an epoch here has {n_batches:,} batches (batch size {batch_size}"
                                  + (f", --limit-batches {limit_batches}" if limit_batches else "")
                                  + "): it was edited, or the data or batch size changed; delete it, or pick "
                                  "another --out")
        if start == 0:
            totals = fresh_totals()
        earlier = totals["train_seconds"]  # time spent on this epoch before a resume
        runner.reset_state()
        if start > 0 and carried is not None:   # stream mode, resumed mid-epoch: the state the stop left
            if runner.carries_state:                    # (a checkpoint written before the cut may be wider)
                runner.load_carried_state(stream_columns(carried, batch_size))
            else:
                log(f"note: {type(runner).__name__} cannot take the carried state back; it starts afresh")
        # The order is a function of (seed, epoch), so skipping `start` batches lands where we stopped.
        todo = islice(iter(train_batches), start, n_batches)
        bar = tqdm(todo, total=n_batches, initial=start, desc=f"epoch {epoch + 1}/{epochs}", unit="batch",
                   leave=False, disable=not progress)
        for i, batch in enumerate(bar, start):
            t0 = time.perf_counter()
            runner.dropout_step = epoch * n_batches + i     # from the position alone: a resume draws the same masks
            result, stepped = step(runner, optimizer, batch, clip=clip)
            if stepped:
                totals["nll"] += result.nll_sum
                totals["tokens"] += result.tokens
                totals["steps"] += 1
                bubble = getattr(result.timeline, "bubble_fraction", None)
                if bubble is not None:
                    totals["bubble_sum"] += float(bubble)
                    totals["bubble_steps"] += 1
            else:
                step_no = epoch * n_batches + i + 1
                found = find_fault(model, runner, batch)
                what = f"loss {result.loss}" if not math.isfinite(result.loss) else \
                    f"a non-finite gradient (loss {result.loss:.4g})"
                if not skip_bad_batches or found.in_weights:
                    advice = ("the weights themselves are broken, so skipping batches cannot help: resume from "
                              "the last good checkpoint with a lower learning rate" if found.in_weights else
                              "or skip such batches with skip_bad_batches=True (--skip-bad-batches)")
                    raise NumericFault(
                        f"training diverged at step {step_no}: {what} at epoch {epoch + 1}, batch {i}; lower the "
                        f"learning rate (now {lr:g}) or the clip (now {clip}), {advice}. First non-finite: "
                        f"{found}. The optimizer did not step; {kept()}",
                        step=step_no, layer=found.layer, stage=found.stage, device=found.device)
                optimizer.zero_grad(set_to_none=True)   # the bad gradients never reach the weights
                runner.reset_state()                    # nor does a carried state that saw them
                totals["skipped"] += 1
                log(f"skipped batch {i} of epoch {epoch + 1} (step {step_no}): {what}; first non-finite: {found}")
            totals["train_seconds"] += time.perf_counter() - t0
            if totals["steps"] % 20 == 0 and totals["tokens"]:
                bar.set_postfix(ppl=f"{perplexity(totals['nll'], totals['tokens']):.1f}", refresh=False)
            if checkpoint_every and (i + 1) % checkpoint_every == 0 and i + 1 < n_batches:
                checkpoint(epoch, i + 1, totals)
        bar.close()
        if totals["skipped"] and totals["steps"] == 0:
            raise NumericFault(f"every batch of epoch {epoch + 1} was bad and skipped ({totals['skipped']}); "
                               f"lower the learning rate (now {lr:g}); {kept()}", step=(epoch + 1) * n_batches)

        valid_ppl = evaluate(runner, corpus.valid, batch_size, bptt=bptt, buckets=buckets, limit=limit_batches)
        record = {
            "epoch": epoch + 1, "lr": lr,
            "train_ppl": perplexity(totals["nll"], totals["tokens"]), "valid_ppl": valid_ppl,
            "tokens_per_s": totals["tokens"] / totals["train_seconds"] if totals["train_seconds"] else 0.0,
            "seconds": time.perf_counter() - started + earlier,
            "tokens": totals["tokens"], "steps": totals["steps"], "train_seconds": totals["train_seconds"],
            "bubble_fraction": totals["bubble_sum"] / totals["bubble_steps"] if totals["bubble_steps"] else None,
            "skipped_batches": totals["skipped"],
        }
        history.epochs.append(record)
        log(_format_epoch(record, epochs))
        lr = next_lr(lr, history.valid_ppls) if lr_decay is None else scheduled_lr(lr, epoch + 1, *lr_decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        checkpoint(epoch + 1, 0, fresh_totals())

    if first_epoch == epochs and history.test_ppl is not None:
        # resumed from a finished run with the same --epochs: nothing to train, nothing rewritten
        log(f"nothing to train: {ckpt_path} has finished all {epochs} epochs (test ppl {history.test_ppl:.2f}); "
            f"pass --epochs {epochs + 1} or more to train further")
        if not _holds(out / "model.pt", model):     # stopped between its last two writes, or altered since
            log(f"{out / 'model.pt'} did not hold these weights; written again from the checkpoint")
            _save_model(out / "model.pt", model, corpus.vocab, placement)
        return history
    history.test_ppl = evaluate(runner, corpus.test, batch_size, bptt=bptt, buckets=buckets, limit=limit_batches)
    if out is not None:
        checkpoint(epochs, 0, fresh_totals())
        _save_model(out / "model.pt", model, corpus.vocab, placement)
    log(f"test ppl {history.test_ppl:.2f}" + (f" (its first {limit_batches} of {cut['test']} batches)" if "test" in cut else "")
        + (f"  (saved {out / 'model.pt'})" if out else ""))
    return history


def _holds(path: Path, model) -> bool:
    """Whether the model file at `path` holds exactly `model`'s weights."""
    try:
        saved, _ = load_model(path)
    except CheckpointError:
        return False
    mine = model.state_dict()
    return saved.state_dict().keys() == mine.keys() and all(
        torch.equal(t, mine[k].detach().cpu()) for k, t in saved.state_dict().items())


def _save_model(path: Path, model, vocab, placement) -> None:
    try:
        save_model(path, model, vocab, placement=placement)
    except OSError as e:
        raise WriteFailed(f"cannot write {path}: {why(e)}; the checkpoint beside it holds the same weights "
                          "(resume to write model.pt again)") from e
