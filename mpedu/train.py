"""Training loop, perplexity, and the single-device runner every pipeline must match."""
from __future__ import annotations

import bisect
import json
import math
import numbers
import random
import time
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

# Checkpoints live in mpedu.checkpoint; these names stay importable from here for older code.
from .checkpoint import (CHECKPOINT_FORMAT, MODEL_FORMAT, CheckpointError, load_checkpoint,  # noqa: F401
                         load_model, remove_stale_temp, save_checkpoint, save_model, set_rng_state)
from .files import WriteFailed, why
from .faults import NumericFault, all_finite, find_fault  # noqa: F401  (NumericFault: raised by train)
from . import dropout
from .model import LSTMLM, detach_state, nll_sum
# the defaults are the tiny recipe's (mpedu.recipes explains them and the learning-rate convention)
from .recipes import BATCH_SIZE, CLIP, EPOCHS, LR

CONFIG = "tiny"
CHECKPOINT_EVERY = 200       # steps (batches) within an epoch; every epoch end too


@dataclass
class StepResult:
    """What one training or evaluation step reports; gradients stay in the model."""

    loss: float                  # nll_sum / tokens for this batch
    nll_sum: float
    tokens: int
    timeline: object | None = None


class SingleDevice:
    """The reference runner: the whole model on one torch device.

    `train_step` accumulates gradients into `.grad` (the trainer zeroes and steps).
    Hidden state starts at zero for every batch, unless `batch.carry_state` (stream
    mode): then it is carried, detached, from the previous batch of the same width.
    Dropout masks are those of Position(dropout_seed, dropout_step) (mpedu.dropout), the
    same a Pipeline draws; each train_step counts dropout_step up.
    """

    def __init__(self, model: LSTMLM, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.dropout_seed, self.dropout_step = 0, 0
        self.reset_state()

    def reset_state(self) -> None:
        self._state, self._width = None, None

    def close(self) -> None:
        pass

    def _nll(self, batch) -> torch.Tensor:
        check_batch(batch, self.model.vocab_size)
        inputs, targets = batch.inputs.to(self.device), batch.targets.to(self.device)  # (T, B)
        width = inputs.shape[1]
        carried = self._state if batch.carry_state and width == self._width else None
        logits, state = self.model(inputs, carried)                                     # (T, B, V)
        if batch.carry_state:
            self._state, self._width = detach_state(state), width
        else:
            self.reset_state()
        return nll_sum(logits, targets)

    def train_step(self, batch) -> StepResult:
        self.model.train()
        with dropout.at(dropout.Position(self.dropout_seed, self.dropout_step)):   # the whole batch: (b0, t0) = (0, 0)
            nll = self._nll(batch)
        (nll / batch.tokens).backward()
        self.dropout_step += 1
        return StepResult(nll.item() / batch.tokens, nll.item(), batch.tokens)

    @torch.no_grad()
    def eval_step(self, batch) -> StepResult:
        self.model.eval()
        nll = self._nll(batch).item()
        return StepResult(nll / batch.tokens, nll, batch.tokens)


def check_batch(batch, vocab_size: int) -> None:
    """Refuse a batch the model cannot read, naming what is wrong, before torch fails deep inside.

    Two min/max reductions per step: cheap next to the step itself.
    """
    inputs, targets, mask = (getattr(batch, k, None) for k in ("inputs", "targets", "mask"))
    if not all(torch.is_tensor(t) for t in (inputs, targets, mask)):
        raise TypeError(f"expected a Batch with tensors inputs, targets and mask, got {type(batch).__name__}; "
                        "make batches with BucketIterator or StreamIterator")
    if inputs.dim() != 2 or inputs.shape != targets.shape or mask.shape != targets.shape or inputs.numel() == 0:
        raise ValueError(f"a batch needs inputs, targets and mask of one (T, B) shape with T, B >= 1; got "
                         f"{tuple(inputs.shape)}, {tuple(targets.shape)} and {tuple(mask.shape)}")
    for what, t in (("inputs", inputs), ("targets", targets)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"batch {what} must be integer token ids, got dtype {t.dtype}")
    lo, hi = min(int(inputs.min()), int(targets.min())), max(int(inputs.max()), int(targets.max()))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"the batch holds token id {bad}, but the model's vocabulary has ids 0..{vocab_size - 1}; "
                         "were the batches made with another vocabulary?")
    if int(mask.sum()) == 0:
        raise ValueError("the batch has no real (non-padding) target tokens")


@dataclass
class History:
    """Per-epoch records (epoch, lr, train_ppl, valid_ppl, tokens_per_s, seconds, ...) and test_ppl."""

    epochs: list[dict] = field(default_factory=list)
    test_ppl: float | None = None

    @property
    def valid_ppls(self) -> list[float]:
        return [e["valid_ppl"] for e in self.epochs]

    def to_dict(self) -> dict:
        return {"epochs": [dict(e) for e in self.epochs], "test_ppl": self.test_ppl}

    @classmethod
    def from_dict(cls, d: dict) -> "History":
        return cls([dict(e) for e in d["epochs"]], d.get("test_ppl"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> dict:
        """Last epoch's perplexities, test perplexity, and whole-run throughput and bubble."""
        if not self.epochs:
            return {"epochs": 0, "test_ppl": self.test_ppl}
        last, steps = self.epochs[-1], sum(e["steps"] for e in self.epochs)
        seconds = sum(e["train_seconds"] for e in self.epochs)
        bubbles = [(e["bubble_fraction"], e["steps"]) for e in self.epochs if e.get("bubble_fraction") is not None]
        return {
            "epochs": len(self.epochs), "train_ppl": last["train_ppl"], "valid_ppl": last["valid_ppl"],
            "test_ppl": self.test_ppl, "lr": last["lr"],
            "tokens_per_s": sum(e["tokens"] for e in self.epochs) / seconds if seconds else None,
            "seconds": sum(e["seconds"] for e in self.epochs),
            # mean over all training steps of the run (each step weighs the same)
            "bubble_fraction": sum(b * n for b, n in bubbles) / sum(n for _, n in bubbles) if bubbles else None,
            "steps": steps, "skipped_batches": sum(e.get("skipped_batches", 0) for e in self.epochs),
        }


def next_lr(lr: float, valid_ppls: list[float], *, min_gain: float = 1.0, factor: float = 0.5) -> float:
    """MXNet's rule: halve the learning rate when validation perplexity improved by less than 1.0."""
    if len(valid_ppls) >= 2 and valid_ppls[-2] - valid_ppls[-1] < min_gain:
        return lr * factor
    return lr


def scheduled_lr(lr: float, epoch: int, first: int, factor: float) -> float:
    """Zaremba et al.'s rule: after epoch `first` (1-based) and every epoch after it, divide lr by `factor`."""
    return lr / factor if epoch >= first else lr


def perplexity(nll: float, tokens: int) -> float:
    """exp(mean NLL per token); inf once that overflows (a diverged model)."""
    try:
        return math.exp(nll / tokens)
    except OverflowError:
        return math.inf


def make_batches(sentences, batch_size: int, *, bptt: int | None = None, buckets=None,
                 shuffle: bool = False, seed: int = 0):
    """A BucketIterator over sentences, or a StreamIterator (carried state) when `bptt` is given."""
    from .bucketing import BucketIterator, StreamIterator
    if bptt:
        return StreamIterator(sentences, batch_size, bptt)
    return BucketIterator(sentences, batch_size, buckets, shuffle=shuffle, seed=seed)


def fit_width(batch, micro_batches: int):
    """Pad the batch dimension with empty columns (all <pad>, no targets) up to a multiple of m.

    A pipeline splits a (T, B) batch into m micro-batches of B/m columns, but a bucket's last
    batch can be narrower. Empty columns add no tokens, no loss and no gradient (columns are
    independent), so the step's result is that of the narrow batch; they only cost compute.
    """
    extra = -batch.inputs.shape[1] % micro_batches
    if not extra:
        return batch
    pad = batch.inputs.new_zeros((batch.inputs.shape[0], extra))  # (T, extra) of <pad> (id 0)
    return replace(batch, inputs=torch.cat([batch.inputs, pad], 1), targets=torch.cat([batch.targets, pad], 1),
                   mask=torch.cat([batch.mask, pad.bool()], 1))


def _fitted(runner, batch):
    m = getattr(runner, "micro_batches", 1)
    return fit_width(batch, m) if m > 1 else batch


def evaluate(runner, sentences, batch_size: int, *, bptt: int | None = None, buckets=None,
             limit: int | None = None) -> float:
    """Perplexity over all real tokens of `sentences`: exp(total NLL / total tokens).

    `runner` is a SingleDevice or Pipeline (a bare LSTMLM is wrapped in SingleDevice).
    `limit` evaluates only the first batches (for smoke tests).
    """
    if isinstance(runner, torch.nn.Module):
        runner = SingleDevice(runner, next(runner.parameters()).device)
    nll, tokens = 0.0, 0
    runner.reset_state()
    for batch in islice(make_batches(sentences, batch_size, bptt=bptt, buckets=buckets), limit):
        result = runner.eval_step(_fitted(runner, batch))
        nll, tokens = nll + result.nll_sum, tokens + result.tokens
    runner.reset_state()
    if tokens == 0:
        raise ValueError(f"evaluate() found no tokens in {len(sentences)} sentences; pass a non-empty split")
    return perplexity(nll, tokens)


def _fresh_totals() -> dict:
    # running sums for the epoch in progress; saved in mid-epoch checkpoints
    return {"nll": 0.0, "tokens": 0, "steps": 0, "train_seconds": 0.0, "bubble_sum": 0.0, "bubble_steps": 0,
            "skipped": 0}


def _format_epoch(r: dict, epochs: int) -> str:
    skipped = f"  ({r['skipped_batches']} bad batches skipped)" if r.get("skipped_batches") else ""
    return (f"epoch {r['epoch']:>3}/{epochs}  train ppl {r['train_ppl']:9.2f}  valid ppl {r['valid_ppl']:9.2f}  "
            f"lr {r['lr']:<8.4g} {r['tokens_per_s']:>9,.0f} tok/s  {r['seconds']:6.1f} s{skipped}")


# ---------------------------------------------------------------- checking arguments

def _check_number(name: str, value, *, integer: bool = False, minimum: float = 0, above: bool = False,
                  maximum: float = math.inf, none_ok: bool = False):
    """A finite number (a whole one if `integer`) at least `minimum` (more than it if `above`), below `maximum`."""
    if value is None and none_ok:
        return None
    kind = numbers.Integral if integer else numbers.Real
    bad = isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) \
        or value < minimum or (above and value == minimum) or value >= maximum
    if bad:
        need = "a whole number" if integer else "a finite number"
        bound = (f"> {minimum:g}" if above else f">= {minimum:g}") + (f" and < {maximum:g}" if maximum < math.inf else "")
        raise ValueError(f"{name}={value!r}: expected {need} {bound}" + (" or None" if none_ok else ""))
    return value


def _shortest_time_steps(batches) -> int:
    """The fewest time steps any batch of this iterator can have (a wavefront needs chunks <= T)."""
    bptt = getattr(batches, "bptt", None)
    if bptt is not None:                          # StreamIterator: full windows, the last one shorter
        n = batches.inputs.shape[0]
        return min(bptt, n % bptt or bptt)
    cap, buckets = batches.buckets[-1], batches.buckets
    # a sentence's last piece (the only one unless it is longer than the largest bucket) sets its bucket
    return min(buckets[bisect.bisect_left(buckets, n - cap * ((n - 1) // cap))] for n in batches.lengths)


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:      # e.g. a tensor where a setting should be: it differs
        return True


# what every epoch record of a History holds (and summary() reads)
_EPOCH_KEYS = ("epoch", "lr", "train_ppl", "valid_ppl", "tokens_per_s", "seconds", "tokens", "steps", "train_seconds")


def _resume(path: Path, model, optimizer, vocab, settings: dict, options: dict, lr_given: bool, epochs: int,
            placement: str | None, log):
    """Load a checkpoint into model, optimizer and RNGs; return (history, epoch, batch, totals).

    Options (lr, clip, lr_decay) that differ from those the interrupted run was given win, and
    are named; the same values (the same command again) continue exactly, with the lr as the
    schedule left it. A checkpoint already past `epochs` is refused before anything changes.
    """
    ckpt = load_checkpoint(path, model=model, vocab=vocab)
    try:
        # weights are stored per layer name, so they load onto any placement or device count
        model.load_state_dict(ckpt["model"])          # copies into the live (possibly moved) Parameters
        optimizer.load_state_dict(ckpt["optimizer"])  # includes the lr, perhaps halved already
        set_rng_state(ckpt["rng"])
        history = History.from_dict(ckpt["history"])
        pos = ckpt["position"]
        totals = {**_fresh_totals(), **pos.get("totals", {})}
        # what the loop will do arithmetic with must be numbers, or it fails mid-epoch
        for where, values in [("totals", totals), *((f"history epoch {k + 1}", e) for k, e in enumerate(history.epochs))]:
            for key in _EPOCH_KEYS if where != "totals" else _fresh_totals():
                if isinstance(values[key], bool) or not isinstance(values[key], numbers.Real):
                    raise TypeError(f"{where}: {key}={values[key]!r} is not a number")
        _check_number("the learning rate", optimizer.param_groups[0]["lr"], above=True)
    except Exception as e:  # whatever part torch or we trip over, the cause is the file: say so
        raise CheckpointError(f"checkpoint {path} is damaged: {e.__class__.__name__}: {e}; delete it, or pick "
                              "another --out to start afresh") from None
    if not all_finite([p.detach() for p in model.parameters()]):
        raise CheckpointError(f"checkpoint {path} holds NaN or inf weights; mpedu never writes those, so the file "
                              "was changed or comes from elsewhere: delete it, or pick another --out")
    if pos["epoch"] > epochs or (pos["epoch"] == epochs and pos["batch"] > 0):
        done = f"{pos['epoch']} epochs" + (f" and {pos['batch']} batches of epoch {pos['epoch'] + 1}"
                                           if pos["batch"] else "")
        raise CheckpointError(f"checkpoint {path} has already trained {done}, more than the {epochs} epochs asked "
                              f"for; a run cannot go back, and the checkpoint was left as it is. Pass --epochs "
                              f"{pos['epoch'] + 1} or more to train further, or another --out to start afresh")
    saved = ckpt.get("options") if isinstance(ckpt.get("options"), dict) else {}
    old_lr = optimizer.param_groups[0]["lr"]
    if not lr_given:               # the run goes on with its own lr (and keeps its first one on record)
        options["lr"] = saved["lr"] if isinstance(saved.get("lr"), float) else old_lr
    elif _differs(saved.get("lr"), options["lr"]) and _differs(old_lr, options["lr"]):
        for group in optimizer.param_groups:
            group["lr"] = options["lr"]
        log(f"note: lr {options['lr']:g} (given) replaces the checkpoint's lr {old_lr:g}"
            + (f" (its run was started with lr {saved['lr']:g})" if isinstance(saved.get("lr"), float) else ""))
    for key in ("clip", "lr_decay"):
        if key in saved and _differs(saved[key], options[key]):
            log(f"note: the checkpoint's run used {key}={saved[key]}; this run uses {key}={options[key]} (given)")
    changed = {k: (ckpt["settings"].get(k), v) for k, v in settings.items() if _differs(ckpt["settings"].get(k), v)}
    if changed:
        log("note: the checkpoint used " + ", ".join(f"{k}={a}" for k, (a, _) in changed.items())
            + "; this run uses " + ", ".join(f"{k}={b}" for k, (_, b) in changed.items())
            + ", so the data order differs from the interrupted run")
    if ckpt.get("placement") != placement:
        log(f"note: the checkpoint was written on {ckpt.get('placement') or 'one device'}; this run uses "
            f"{placement or 'one device'} (weights are stored per layer, so they load; float rounding may differ)")
    log(f"resumed from {path} at epoch {pos['epoch'] + 1}, batch {pos['batch']} "
        f"(lr {optimizer.param_groups[0]['lr']:g})")
    return history, pos["epoch"], pos["batch"], totals


def train(model: LSTMLM, corpus, *, runner=None, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
          lr: float | None = None, clip: float | None = CLIP, seed: int = 0, out=None, resume: bool = False,
          bptt: int | None = None, buckets=None, checkpoint_every: int = CHECKPOINT_EVERY,
          limit_batches: int | None = None, skip_bad_batches: bool = False, log=print,
          progress: bool = True, lr_decay: tuple[int, float] | None = None) -> History:
    """Train with SGD and gradient-norm clipping; return the History.

    runner: SingleDevice(model) by default, or a Pipeline built on `model`.
    lr halves after an epoch whose validation perplexity improved by less than 1.0; or, with
      lr_decay=(k, f), is divided by f after every epoch from epoch k on (Zaremba et al.'s rule).
    out: folder for `checkpoint.pt` (every `checkpoint_every` batches and each epoch end)
      and `model.pt` (final weights + config + vocabulary). resume=True continues from
      out/checkpoint.pt exactly, even mid-epoch (stream mode restarts the carried state);
      the lr then comes from the checkpoint, unless `lr` is given and differs from the lr the
      checkpoint's run was given (then `lr` wins, and the run says so). lr=None: LR (10), or
      the checkpoint's on resume. The checkpoint loads onto any placement.
      A checkpoint past `epochs` is refused (CheckpointError); one at exactly `epochs` trains
      nothing and is left as it is.
    bptt: stream mode (StreamIterator, state carried across batches) instead of buckets.
    limit_batches: use only the first N batches of every split each epoch (smoke tests).
    A NaN or inf loss or gradient raises NumericFault naming the step, the layer and (in a
      pipeline) its stage and device, before the optimizer steps; the last good checkpoint
      stays as it was. skip_bad_batches=True skips such a batch instead (its gradients are
      dropped), counts it in the history ("skipped_batches") and carries on.
    Seeds torch and `random` from `seed`; the data order depends only on (seed, epoch).
    """
    epochs = _check_number("epochs", epochs, integer=True)
    batch_size = _check_number("batch_size", batch_size, integer=True, minimum=1)
    given_lr = _check_number("lr", lr, above=True, maximum=torch.finfo(torch.float32).max, none_ok=True)  # SGD: float
    lr = LR if given_lr is None else given_lr
    clip = _check_number("clip", clip, none_ok=True) or None        # 0 means no clipping
    seed = _check_number("seed", seed, integer=True, maximum=2**63)   # what every generator accepts
    bptt = _check_number("bptt", bptt, integer=True, minimum=1, none_ok=True)
    checkpoint_every = _check_number("checkpoint_every", checkpoint_every, integer=True, none_ok=True)
    limit_batches = _check_number("limit_batches", limit_batches, integer=True, minimum=1, none_ok=True)
    if lr_decay is not None:
        if not isinstance(lr_decay, (tuple, list)) or len(lr_decay) != 2:
            raise ValueError(f"lr_decay={lr_decay!r}: expected (first epoch, factor), e.g. (5, 2.0), or None")
        lr_decay = (_check_number("lr_decay's first epoch", lr_decay[0], integer=True, minimum=1),
                    _check_number("lr_decay's factor", lr_decay[1], above=True))
    runner = runner or SingleDevice(model)
    # built after the runner: the Pipeline moves layers in place, so these are the live Parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = Path(out) if out is not None else None
    ckpt_path = out / "checkpoint.pt" if out else None
    settings = {"batch_size": batch_size, "seed": seed, "bptt": bptt, "buckets": list(buckets) if buckets else None,
                "limit_batches": limit_batches}
    options = {"lr": float(lr), "clip": clip, "lr_decay": list(lr_decay) if lr_decay else None}  # a resume may change
    placement = str(runner.placement) if hasattr(runner, "placement") else None
    # Every split is batched before anything is trained, so a setting the data cannot meet
    # (a bad bucket list, time chunks longer than a bucket) fails now, not after an hour.
    train_batches = make_batches(corpus.train, batch_size, bptt=bptt, buckets=buckets, shuffle=True, seed=seed)
    chunks = getattr(runner, "chunks", 1)
    for split in ("train", "valid", "test"):
        batches = train_batches if split == "train" else make_batches(corpus.sentences(split), batch_size,
                                                                      bptt=bptt, buckets=buckets)
        if chunks > 1 and chunks > (shortest := _shortest_time_steps(batches)):
            raise ValueError(f"chunks={chunks}, but some {split} batches have only {shortest} time steps; "
                             f"use at most {shortest} chunks, or buckets (or bptt) of at least {chunks} steps")
    history, first_epoch, first_batch, totals = History(), 0, 0, _fresh_totals()
    torch.manual_seed(seed)
    random.seed(seed)
    runner.dropout_seed = seed       # dropout masks: a function of (seed, global step, position); mpedu.dropout

    if resume and ckpt_path is None:
        raise ValueError("resume=True needs out=<folder holding checkpoint.pt>")
    if ckpt_path is not None:
        for stale in remove_stale_temp(ckpt_path) + remove_stale_temp(out / "model.pt"):
            log(f"removed {stale}, a file an interrupted run was writing (never read)")
    if resume and ckpt_path.exists():
        history, first_epoch, first_batch, totals = _resume(ckpt_path, model, optimizer, corpus.vocab, settings,
                                                            options, given_lr is not None, epochs, placement,
                                                            log)
    elif ckpt_path is not None and ckpt_path.exists():
        log(f"starting afresh; {ckpt_path} will be overwritten (pass resume=True / --resume to continue it)")
    elif resume:
        log(f"no checkpoint at {ckpt_path}; starting afresh")
    lr = optimizer.param_groups[0]["lr"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    last_saved = None      # (epoch, batch) of the newest checkpoint this run wrote

    def checkpoint(epoch: int, batch: int, totals: dict) -> None:
        nonlocal last_saved
        if ckpt_path is None:
            return
        if not all_finite([p.detach() for p in params]):   # never replace a good checkpoint by a broken model
            found = find_fault(model, runner)
            raise NumericFault(f"the weights became non-finite before the checkpoint at epoch {epoch + 1}, "
                               f"batch {batch}: {found}; {ckpt_path} keeps the last good state. Lower the "
                               f"learning rate (now {lr:g}) and resume", layer=found.layer,
                               stage=found.stage, device=found.device)
        try:
            save_checkpoint(ckpt_path, model=model, optimizer=optimizer, vocab=corpus.vocab, history=history,
                            epoch=epoch, batch=batch, totals=totals, placement=placement, settings=settings,
                            options=options)
        except OSError as e:      # disk full, a file-size limit, ...: the old checkpoint is untouched
            raise WriteFailed(f"cannot write the checkpoint at epoch {epoch + 1}, batch {batch} to {ckpt_path}: "
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
        if start == 0:
            totals = _fresh_totals()
        earlier = totals["train_seconds"]  # time spent on this epoch before a resume
        runner.reset_state()
        # The order is a function of (seed, epoch), so skipping `start` batches lands where we stopped.
        todo = islice(iter(train_batches), start, n_batches)
        bar = tqdm(todo, total=n_batches, initial=start, desc=f"epoch {epoch + 1}/{epochs}", unit="batch",
                   leave=False, disable=not progress)
        for i, batch in enumerate(bar, start):
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            runner.dropout_step = epoch * n_batches + i     # from the position alone: a resume draws the same masks
            result = runner.train_step(_fitted(runner, batch))
            grads = [p.grad for p in params if p.grad is not None]
            if math.isfinite(result.loss) and all_finite(grads):
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                optimizer.step()
                totals["nll"] += result.nll_sum
                totals["tokens"] += result.tokens
                totals["steps"] += 1
                bubble = getattr(result.timeline, "bubble_fraction", None)
                if bubble is not None:
                    totals["bubble_sum"] += float(bubble)
                    totals["bubble_steps"] += 1
            else:
                step = epoch * n_batches + i + 1
                found = find_fault(model, runner, batch)
                what = f"loss {result.loss}" if not math.isfinite(result.loss) else \
                    f"a non-finite gradient (loss {result.loss:.4g})"
                if not skip_bad_batches or found.in_weights:
                    advice = ("the weights themselves are broken, so skipping batches cannot help: resume from "
                              "the last good checkpoint with a lower learning rate" if found.in_weights else
                              "or skip such batches with skip_bad_batches=True (--skip-bad-batches)")
                    raise NumericFault(
                        f"training diverged at step {step}: {what} at epoch {epoch + 1}, batch {i}; lower the "
                        f"learning rate (now {lr:g}) or the clip (now {clip}), {advice}. First non-finite: "
                        f"{found}. The optimizer did not step; {kept()}",
                        step=step, layer=found.layer, stage=found.stage, device=found.device)
                optimizer.zero_grad(set_to_none=True)   # the bad gradients never reach the weights
                runner.reset_state()                    # nor does a carried state that saw them
                totals["skipped"] += 1
                log(f"skipped batch {i} of epoch {epoch + 1} (step {step}): {what}; first non-finite: {found}")
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
        checkpoint(epoch + 1, 0, _fresh_totals())

    if first_epoch == epochs and history.test_ppl is not None:
        # resumed from a finished run with the same --epochs: nothing to train, nothing rewritten
        log(f"nothing to train: {ckpt_path} has finished all {epochs} epochs (test ppl {history.test_ppl:.2f}); "
            f"pass --epochs {epochs + 1} or more to train further")
        if not (out / "model.pt").exists():      # the run was stopped between its last two writes
            _save_model(out / "model.pt", model, corpus.vocab, placement)
        return history
    history.test_ppl = evaluate(runner, corpus.test, batch_size, bptt=bptt, buckets=buckets, limit=limit_batches)
    log(f"test ppl {history.test_ppl:.2f}" + (f"  (saved {out / 'model.pt'})" if out else ""))
    if out is not None:
        checkpoint(epochs, 0, _fresh_totals())
        _save_model(out / "model.pt", model, corpus.vocab, placement)
    return history


def _save_model(path: Path, model, vocab, placement) -> None:
    try:
        save_model(path, model, vocab, placement=placement)
    except OSError as e:
        raise WriteFailed(f"cannot write {path}: {why(e)}; the checkpoint beside it holds the same weights "
                          "(resume to write model.pt again)") from e
