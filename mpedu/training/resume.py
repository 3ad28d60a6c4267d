"""Resuming a run from its checkpoint: model, optimizer, RNGs and position, naming the options that changed."""
from __future__ import annotations

import numbers
from pathlib import Path

from ..core.runner import check_carried
from ..runtime.values import check_number
from .checkpoint import CheckpointError, load_checkpoint, set_rng_state
from .faults import all_finite
from .history import History

# what every epoch record of a History holds (and summary() reads)
EPOCH_KEYS = ("epoch", "lr", "train_ppl", "valid_ppl", "tokens_per_s", "seconds", "tokens", "steps", "train_seconds")


def fresh_totals() -> dict:
    """Running sums for the epoch in progress; saved in mid-epoch checkpoints."""
    return {"nll": 0.0, "tokens": 0, "steps": 0, "train_seconds": 0.0, "bubble_sum": 0.0, "bubble_steps": 0,
            "skipped": 0}


def _differs(a, b) -> bool:
    try:
        return bool(a != b)
    except Exception:      # e.g. a tensor where a setting should be: it differs
        return True


def restore(path: Path, model, optimizer, vocab, settings: dict, options: dict, lr_given: bool, epochs: int,
            placement: str | None, log):
    """Load a checkpoint into model, optimizer and RNGs; return (history, epoch, batch, totals, carried),
    carried: stream mode's recurrent state for the next batch (None: none was carried).

    Options (lr, clip, lr_decay) that differ from those the interrupted run was given win, and
    are named; the same values (the same command again) continue exactly, with the lr as the
    schedule left it. A checkpoint already past `epochs` is refused before anything changes.
    """
    ckpt = load_checkpoint(path, model=model, vocab=vocab)
    _refuse_going_back(path, ckpt["position"], epochs)     # before the model and optimizer change
    try:
        # weights are stored per layer name, so they load onto any placement or device count
        model.load_state_dict(ckpt["model"])          # copies into the live (possibly moved) Parameters
        optimizer.load_state_dict(ckpt["optimizer"])  # includes the lr, perhaps halved already
        set_rng_state(ckpt["rng"])
        history = History.from_dict(ckpt["history"])
        pos = ckpt["position"]
        totals = {**fresh_totals(), **pos.get("totals", {})}
        # what the loop will do arithmetic with must be numbers, or it fails mid-epoch
        for where, values in [("totals", totals), *((f"history epoch {k + 1}", e) for k, e in enumerate(history.epochs))]:
            for key in EPOCH_KEYS if where != "totals" else fresh_totals():
                if isinstance(values[key], bool) or not isinstance(values[key], numbers.Real):
                    raise TypeError(f"{where}: {key}={values[key]!r} is not a number")
        check_number("the learning rate", optimizer.param_groups[0]["lr"], above=True)
        carried = ckpt.get("carried")
        if carried is not None:
            check_carried(carried, model)
    except Exception as e:  # whatever part torch or we trip over, the cause is the file: say so
        raise CheckpointError(f"checkpoint {path} is damaged: {e.__class__.__name__}: {e}; delete it, or pick "
                              "another --out to start afresh") from None
    if not all_finite([p.detach() for p in model.parameters()]):
        raise CheckpointError(f"checkpoint {path} holds NaN or inf weights; mpedu never writes those, so the file "
                              "was changed or comes from elsewhere: delete it, or pick another --out")
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
    for key in ("micro_batches", "chunks"):     # how a step adds up: another count changes the float rounding
        if key in saved and _differs(saved[key], options[key]):
            log(f"note: the checkpoint's run used {key}={saved[key]}; this run uses {key}={options[key]}, so the "
                "numbers follow the interrupted run to float rounding, not bit for bit")
    changed = {k: (ckpt["settings"].get(k), v) for k, v in settings.items() if _differs(ckpt["settings"].get(k), v)}
    if changed:
        log("note: the checkpoint used " + ", ".join(f"{k}={a}" for k, (a, _) in changed.items())
            + "; this run uses " + ", ".join(f"{k}={b}" for k, (_, b) in changed.items())
            + ", so the data order differs from the interrupted run")
    if ckpt.get("placement") != placement:
        log(f"note: the checkpoint was written on {ckpt.get('placement') or 'one device'}; this run uses "
            f"{placement or 'one device'} (weights are stored per layer, so they load; float rounding may differ)")
    where = (f"all {epochs} epochs trained" if pos["epoch"] == epochs
             else f"at epoch {pos['epoch'] + 1}, batch {pos['batch']}")
    log(f"resumed from {path} {where} (lr {optimizer.param_groups[0]['lr']:g})")
    return history, pos["epoch"], pos["batch"], totals, carried


def _refuse_going_back(path, pos, epochs: int) -> None:
    """A checkpoint past `epochs` cannot be continued to `epochs`: refused, naming what it trained."""
    if not isinstance(pos, dict):
        return                              # a damaged position: restore's checks name it
    epoch, batch = pos.get("epoch"), pos.get("batch")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, batch)):
        return                              # a damaged position: restore's checks name it
    if epoch > epochs or (epoch == epochs and batch > 0):
        done = f"{epoch} epochs" + (f" and {batch} batches of epoch {epoch + 1}" if batch else "")
        raise CheckpointError(f"checkpoint {path} has already trained {done}, more than asked for (--epochs {epochs}); "
                              f"a run cannot go back, and the checkpoint was left as it is. Pass --epochs "
                              f"{epoch + 1} or more to train further, or another --out to start afresh")
