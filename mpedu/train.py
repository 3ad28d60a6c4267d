"""Training loop, perplexity, checkpoints, and the single-device runner every pipeline must match."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .model import CONFIGS, LMConfig, LSTMLM, detach_state, nll_sum

# Defaults, chosen so `python -m mpedu train` (tiny model, embedded corpus) takes about two
# minutes on 2 cores with validation perplexity falling every epoch (measured: 171, 141, 124,
# 98, 92, 89 against a unigram 382). The loss is the mean NLL per token, so the lr is in the
# range of PyTorch's word_language_model example (lr 20, clip 0.25), not Zaremba's lr 1 /
# clip 5, which was for a loss summed over 35 steps. lr 20 learns as fast but overshoots in
# epoch 3 (valid 124 -> 132) before the halving rule catches it; lr 10 falls smoothly.
# Batches of 32 give a 4-micro-batch pipeline 8 columns per micro-batch.
CONFIG = "tiny"
EPOCHS = 6
BATCH_SIZE = 32
LR = 10.0
CLIP = 0.25
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
    """

    def __init__(self, model: LSTMLM, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.reset_state()

    def reset_state(self) -> None:
        self._state, self._width = None, None

    def close(self) -> None:
        pass

    def _nll(self, batch) -> torch.Tensor:
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
        nll = self._nll(batch)
        (nll / batch.tokens).backward()
        return StepResult(nll.item() / batch.tokens, nll.item(), batch.tokens)

    @torch.no_grad()
    def eval_step(self, batch) -> StepResult:
        self.model.eval()
        nll = self._nll(batch).item()
        return StepResult(nll / batch.tokens, nll, batch.tokens)


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
            "steps": steps,
        }


def next_lr(lr: float, valid_ppls: list[float], *, min_gain: float = 1.0, factor: float = 0.5) -> float:
    """MXNet's rule: halve the learning rate when validation perplexity improved by less than 1.0."""
    if len(valid_ppls) >= 2 and valid_ppls[-2] - valid_ppls[-1] < min_gain:
        return lr * factor
    return lr


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
    return {"nll": 0.0, "tokens": 0, "steps": 0, "train_seconds": 0.0, "bubble_sum": 0.0, "bubble_steps": 0}


def _format_epoch(r: dict, epochs: int) -> str:
    return (f"epoch {r['epoch']:>3}/{epochs}  train ppl {r['train_ppl']:9.2f}  valid ppl {r['valid_ppl']:9.2f}  "
            f"lr {r['lr']:<8.4g} {r['tokens_per_s']:>9,.0f} tok/s  {r['seconds']:6.1f} s")


def _resume(path: Path, model, optimizer, vocab, settings: dict, log):
    """Load a checkpoint into model, optimizer and RNGs; return (history, epoch, batch, totals)."""
    ckpt = load_checkpoint(path, model=model, vocab=vocab)
    model.load_state_dict(ckpt["model"])          # copies into the live (possibly moved) Parameters
    optimizer.load_state_dict(ckpt["optimizer"])  # includes the lr, perhaps halved already
    _set_rng_state(ckpt["rng"])
    pos = ckpt["position"]
    changed = {k: (ckpt["settings"].get(k), v) for k, v in settings.items() if ckpt["settings"].get(k) != v}
    if changed:
        log("note: the checkpoint used " + ", ".join(f"{k}={a}" for k, (a, _) in changed.items())
            + "; this run uses " + ", ".join(f"{k}={b}" for k, (_, b) in changed.items())
            + ", so the data order differs from the interrupted run")
    log(f"resumed from {path} at epoch {pos['epoch'] + 1}, batch {pos['batch']}")
    return History.from_dict(ckpt["history"]), pos["epoch"], pos["batch"], dict(pos["totals"])


def train(model: LSTMLM, corpus, *, runner=None, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE,
          lr: float = LR, clip: float | None = CLIP, seed: int = 0, out=None, resume: bool = False,
          bptt: int | None = None, buckets=None, checkpoint_every: int = CHECKPOINT_EVERY,
          limit_batches: int | None = None, log=print, progress: bool = True) -> History:
    """Train with SGD and gradient-norm clipping; return the History.

    runner: SingleDevice(model) by default, or a Pipeline built on `model`.
    lr halves after an epoch whose validation perplexity improved by less than 1.0.
    out: folder for `checkpoint.pt` (every `checkpoint_every` batches and each epoch end)
      and `model.pt` (final weights + config + vocabulary). resume=True continues from
      out/checkpoint.pt exactly, even mid-epoch (stream mode restarts the carried state);
      the lr then comes from the checkpoint.
    bptt: stream mode (StreamIterator, state carried across batches) instead of buckets.
    limit_batches: use only the first N batches of every split each epoch (smoke tests).
    Seeds torch and `random` from `seed`; the data order depends only on (seed, epoch).
    """
    runner = runner or SingleDevice(model)
    # built after the runner: the Pipeline moves layers in place, so these are the live Parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    out = Path(out) if out is not None else None
    ckpt_path = out / "checkpoint.pt" if out else None
    settings = {"batch_size": batch_size, "seed": seed, "bptt": bptt, "buckets": list(buckets) if buckets else None,
                "limit_batches": limit_batches}
    history, first_epoch, first_batch, totals = History(), 0, 0, _fresh_totals()
    torch.manual_seed(seed)
    random.seed(seed)

    if resume and ckpt_path is None:
        raise ValueError("resume=True needs out=<folder holding checkpoint.pt>")
    if resume and ckpt_path.exists():
        history, first_epoch, first_batch, totals = _resume(ckpt_path, model, optimizer, corpus.vocab, settings, log)
    elif ckpt_path is not None and ckpt_path.exists():
        log(f"starting afresh; {ckpt_path} will be overwritten (pass resume=True / --resume to continue it)")
    elif resume:
        log(f"no checkpoint at {ckpt_path}; starting afresh")
    lr = optimizer.param_groups[0]["lr"]
    placement = str(runner.placement) if hasattr(runner, "placement") else None
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def checkpoint(epoch: int, batch: int, totals: dict) -> None:
        if ckpt_path is not None:
            save_checkpoint(ckpt_path, model=model, optimizer=optimizer, vocab=corpus.vocab, history=history,
                            epoch=epoch, batch=batch, totals=totals, placement=placement, settings=settings)

    train_batches = make_batches(corpus.train, batch_size, bptt=bptt, buckets=buckets, shuffle=True, seed=seed)
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
            result = runner.train_step(_fitted(runner, batch))
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"training diverged: loss {result.loss} at epoch {epoch + 1}, batch {i}; "
                                         f"lower the learning rate (now {lr:g}) or the clip (now {clip})")
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            totals["train_seconds"] += time.perf_counter() - t0
            totals["nll"] += result.nll_sum
            totals["tokens"] += result.tokens
            totals["steps"] += 1
            bubble = getattr(result.timeline, "bubble_fraction", None)
            if bubble is not None:
                totals["bubble_sum"] += float(bubble)
                totals["bubble_steps"] += 1
            if totals["steps"] % 20 == 0:
                bar.set_postfix(ppl=f"{perplexity(totals['nll'], totals['tokens']):.1f}", refresh=False)
            if checkpoint_every and (i + 1) % checkpoint_every == 0 and i + 1 < n_batches:
                checkpoint(epoch, i + 1, totals)
        bar.close()

        valid_ppl = evaluate(runner, corpus.valid, batch_size, bptt=bptt, buckets=buckets, limit=limit_batches)
        record = {
            "epoch": epoch + 1, "lr": lr,
            "train_ppl": perplexity(totals["nll"], totals["tokens"]), "valid_ppl": valid_ppl,
            "tokens_per_s": totals["tokens"] / totals["train_seconds"] if totals["train_seconds"] else 0.0,
            "seconds": time.perf_counter() - started + earlier,
            "tokens": totals["tokens"], "steps": totals["steps"], "train_seconds": totals["train_seconds"],
            "bubble_fraction": totals["bubble_sum"] / totals["bubble_steps"] if totals["bubble_steps"] else None,
        }
        history.epochs.append(record)
        log(_format_epoch(record, epochs))
        lr = next_lr(lr, history.valid_ppls)
        for group in optimizer.param_groups:
            group["lr"] = lr
        checkpoint(epoch + 1, 0, _fresh_totals())

    history.test_ppl = evaluate(runner, corpus.test, batch_size, bptt=bptt, buckets=buckets, limit=limit_batches)
    log(f"test ppl {history.test_ppl:.2f}" + (f"  (saved {out / 'model.pt'})" if out else ""))
    if out is not None:
        save_model(out / "model.pt", model, corpus.vocab, placement=placement)
        checkpoint(epochs, 0, _fresh_totals())
    return history


# ---------------------------------------------------------------- checkpoints

class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that belongs to another model."""


CHECKPOINT_FORMAT = "mpedu-checkpoint-1"
MODEL_FORMAT = "mpedu-model-1"


def _config_name(config: LMConfig) -> str:
    """The CONFIGS name of `config`, or "custom" when its sizes match none."""
    return next((name for name, c in CONFIGS.items() if c == config), "custom")


def _describe(config: dict, vocab_size: int) -> str:
    name = _config_name(LMConfig(**config))
    return (f"'{name}' model (embed {config['embed_size']}, hidden {config['hidden_size']}, "
            f"{config['num_layers']} LSTM layers, {vocab_size:,}-word vocabulary)")


def _atomic_save(obj, path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible on Windows)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _load(path, kind: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {kind} at {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, ...: the torch message alone does not name the file
        raise CheckpointError(f"cannot read {kind} {path}: {e.__class__.__name__}: {e}. The file is damaged "
                              f"or is not an mpedu {kind}; delete it, or pick another --out") from e
    expected = CHECKPOINT_FORMAT if kind == "checkpoint" else MODEL_FORMAT
    if not isinstance(obj, dict) or obj.get("format") != expected:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path} is not an mpedu {kind} (format {found!r}, expected {expected!r})")
    return obj


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):  # numpy's global RNG, in case a notebook's code uses it
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def save_checkpoint(path, *, model: LSTMLM, optimizer, vocab, history: History, epoch: int, batch: int = 0,
                    totals: dict | None = None, placement: str | None = None, settings: dict | None = None) -> None:
    """Everything needed to continue exactly: weights, optimizer, RNGs, data position (epoch, batch), history."""
    _atomic_save({
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "lr": optimizer.param_groups[0]["lr"], "rng": _rng_state(),
        # the next batch to run is batch `batch` of epoch `epoch` (0-based); totals: the epoch so far
        "position": {"epoch": epoch, "batch": batch, "totals": dict(totals or _fresh_totals())},
        "history": history.to_dict(), "vocab": vocab.to_dict(),
        "config_name": _config_name(model.config), "config": model.config.to_dict(), "vocab_size": model.vocab_size,
        "placement": placement, "settings": dict(settings or {}),
    }, path)


def load_checkpoint(path, *, model: LSTMLM | None = None, vocab=None) -> dict:
    """Read a checkpoint (weights_only); with `model`/`vocab`, check it belongs to them."""
    ckpt = _load(path, "checkpoint")
    if model is not None:
        if ckpt["config"] != model.config.to_dict() or ckpt["vocab_size"] != model.vocab_size:
            raise CheckpointError(
                f"checkpoint {path} holds a {_describe(ckpt['config'], ckpt['vocab_size'])}, but this run built a "
                f"{_describe(model.config.to_dict(), model.vocab_size)}; use the same --config and --data as the "
                f"run that wrote it, or another --out to start afresh")
    if vocab is not None and ckpt["vocab"] != vocab.to_dict():
        from .data import Vocabulary
        theirs = Vocabulary.from_dict(ckpt["vocab"]).itos
        i = next((i for i, (a, b) in enumerate(zip(theirs, vocab.itos)) if a != b), min(len(theirs), len(vocab.itos)))
        raise CheckpointError(
            f"checkpoint {path} was trained on another vocabulary ({len(theirs):,} words) than this corpus "
            f"({len(vocab.itos):,} words); they first differ at id {i}; use the same --data as the run "
            f"that wrote it, or another --out to start afresh")
    return ckpt


def save_model(path, model: LSTMLM, vocab, *, placement: str | None = None) -> None:
    """Final weights with what is needed to rebuild them: config and vocabulary."""
    _atomic_save({"format": MODEL_FORMAT, "model": model.state_dict(), "config_name": _config_name(model.config),
                  "config": model.config.to_dict(), "vocab_size": model.vocab_size, "vocab": vocab.to_dict(),
                  "placement": placement}, path)


def load_model(path):
    """(model, vocab) from a file written by save_model (e.g. runs/latest/model.pt), on the CPU."""
    from .data import Vocabulary
    saved = _load(path, "model file")
    model = LSTMLM(saved["vocab_size"], LMConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model, Vocabulary.from_dict(saved["vocab"])
