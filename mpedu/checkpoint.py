"""Checkpoints and model files: atomic writes, weights-only reads, and errors that name the file and the fix."""
from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import tempfile
import time
import warnings
from pathlib import Path

import torch

from .model import CONFIGS, LMConfig, LSTMLM

CHECKPOINT_FORMAT = "mpedu-checkpoint-1"
MODEL_FORMAT = "mpedu-model-1"
# Tests only: seconds to sleep between writing the temp file and renaming it, so that a
# test can kill the process inside that window and prove a half-written file is never read.
SLOW_WRITE_ENV = "MPEDU_SLOW_CHECKPOINT_WRITE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that belongs to another model."""


def _config_name(config: LMConfig) -> str:
    """The CONFIGS name of `config`, or "custom" when its sizes match none."""
    return next((name for name, c in CONFIGS.items() if c == config), "custom")


def _describe(config: dict, vocab_size: int) -> str:
    name = _config_name(LMConfig(**config))
    return (f"'{name}' model (embed {config['embed_size']}, hidden {config['hidden_size']}, "
            f"{config['num_layers']} LSTM layers, {vocab_size:,}-word vocabulary)")


# ---------------------------------------------------------------- writing

def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def atomic_save(obj, path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        slow = os.environ.get(SLOW_WRITE_ENV)
        if slow:
            time.sleep(float(slow))
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


def remove_stale_temp(path) -> list[Path]:
    """Delete temp files an interrupted `atomic_save` of `path` left behind (a kill between write
    and rename); they are never read. Returns what was removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = [p for p in path.parent.glob(f"{_temp_prefix(path)}*.tmp") if p.is_file()]
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
    return stale


# ---------------------------------------------------------------- reading

_UNSAFE_RE = re.compile(r"(?:unsupported GLOBAL|Unsupported global:\s*GLOBAL)\s+([\w.]+)", re.IGNORECASE)


def _load(path, kind: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {kind} at {path}")
    try:
        with warnings.catch_warnings():   # torch warns about odd pickle protocols: noise for a file we refuse anyway
            warnings.simplefilter("ignore")
            # weights_only: tensors, numbers, strings, lists and dicts only; a pickle that names any
            # other Python callable (os.system, ...) is refused before anything runs
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise _damaged(path, kind, e) from e
        found = _UNSAFE_RE.search(str(e))
        what = f" (it names {found.group(1)})" if found else ""
        raise CheckpointError(f"{path} holds Python objects, not just weights{what}; loading it could run "
                              f"code, so mpedu refuses it. If you did not write this file, delete it; "
                              f"mpedu writes only tensors and plain data") from None
    except Exception as e:  # truncated zip, random bytes, ...: the torch message alone does not name the file
        raise _damaged(path, kind, e) from e
    expected = CHECKPOINT_FORMAT if kind == "checkpoint" else MODEL_FORMAT
    if not isinstance(obj, dict) or obj.get("format") != expected:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path} is not an mpedu {kind} (format {found!r}, expected {expected!r})")
    return obj


def _damaged(path, kind, e) -> CheckpointError:
    message = str(e).splitlines()[0] if str(e) else ""
    return CheckpointError(f"cannot read {kind} {path}: {e.__class__.__name__}: {message}. The file is damaged "
                           f"or is not an mpedu {kind}; delete it, or pick another --out")


# What a file must hold, checked before any of it is used, so that a damaged or foreign
# file is a CheckpointError naming the part, never a KeyError deep inside torch.
_MODEL_PARTS = {"model": dict, "config": dict, "vocab_size": int, "vocab": dict}
_CHECKPOINT_PARTS = {**_MODEL_PARTS, "optimizer": dict, "rng": dict, "position": dict, "history": dict,
                     "settings": dict}


def _check_parts(obj: dict, parts: dict, path, kind: str) -> None:
    for key, kind_of in parts.items():
        if not isinstance(obj.get(key), kind_of) or isinstance(obj.get(key), bool):
            found = "missing" if key not in obj else f"a {type(obj[key]).__name__}"
            raise CheckpointError(f"{kind} {path} is damaged: its {key!r} entry is {found}, expected a "
                                  f"{kind_of.__name__}; delete it, or pick another --out")
    try:
        config = LMConfig(**obj["config"])
    except TypeError as e:
        raise CheckpointError(f"{kind} {path} is damaged: its model config {obj['config']!r} is not one "
                              f"mpedu writes ({e})") from None
    itos = obj["vocab"].get("itos")
    if obj["vocab_size"] < 4 or not isinstance(itos, list) or not all(isinstance(w, str) for w in itos):
        raise CheckpointError(f"{kind} {path} is damaged: its vocabulary is not a list of words, or its "
                              f"vocab_size {obj['vocab_size']} is below 4")
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj["model"].items()):
        raise CheckpointError(f"{kind} {path} is damaged: its weights are not a map of names to tensors")
    # embed 1 + 4 per LSTM layer + decode 2 tensors: checked before building anything of that size
    layers = config.num_layers
    if not isinstance(layers, int) or isinstance(layers, bool) or 4 * layers + 3 != len(obj["model"]):
        raise CheckpointError(f"{kind} {path} is damaged: its config has num_layers={layers!r}, but it "
                              f"holds {len(obj['model'])} weight tensors")
    # the weights must be this config's, tensor for tensor: shapes from an empty model of that size
    try:
        with torch.device("meta"):   # shapes only: no memory, whatever sizes the file claims
            expected = {k: v.shape for k, v in LSTMLM(obj["vocab_size"], config).state_dict().items()}
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{kind} {path} is damaged: its model config {obj['config']!r} cannot be "
                              f"built ({e})") from None
    got = {k: v.shape for k, v in obj["model"].items()}
    if got != expected:
        odd = next((k for k in sorted(set(got) | set(expected)) if got.get(k) != expected.get(k)))
        raise CheckpointError(f"{kind} {path} is damaged: weight {odd!r} has shape "
                              f"{tuple(got[odd]) if odd in got else 'missing'}, but its config needs "
                              f"{tuple(expected[odd]) if odd in expected else 'none'}")
    if not isinstance(obj.get("placement"), (str, type(None))):
        raise CheckpointError(f"{kind} {path} is damaged: its placement is a {type(obj['placement']).__name__}, "
                              "not a placement string")
    if kind == "checkpoint":
        position = obj["position"]
        epoch, batch = position.get("epoch"), position.get("batch")
        if not (isinstance(epoch, int) and isinstance(batch, int) and epoch >= 0 and batch >= 0
                and isinstance(position.get("totals", {}), dict)):
            raise CheckpointError(f"checkpoint {path} is damaged: its position {position!r} is not "
                                  f"(epoch >= 0, batch >= 0)")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):  # numpy's global RNG, in case a notebook's code uses it
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    """Put back the generators saved in a checkpoint (torch, Python, CUDA, numpy)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


# ---------------------------------------------------------------- the public four

def save_checkpoint(path, *, model: LSTMLM, optimizer, vocab, history, epoch: int, batch: int = 0,
                    totals: dict | None = None, placement: str | None = None, settings: dict | None = None) -> None:
    """Everything needed to continue exactly: weights, optimizer, RNGs, data position (epoch, batch), history.

    `history` is a train.History (or anything with `to_dict()`). The weights are stored per
    layer name, so a checkpoint loads onto any placement and device count.
    """
    atomic_save({
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "lr": optimizer.param_groups[0]["lr"], "rng": _rng_state(),
        # the next batch to run is batch `batch` of epoch `epoch` (0-based); totals: the epoch so far
        "position": {"epoch": epoch, "batch": batch, "totals": dict(totals or {})},
        "history": history.to_dict(), "vocab": vocab.to_dict(),
        "config_name": _config_name(model.config), "config": model.config.to_dict(), "vocab_size": model.vocab_size,
        "placement": placement, "settings": dict(settings or {}),
    }, path)


def load_checkpoint(path, *, model: LSTMLM | None = None, vocab=None) -> dict:
    """Read a checkpoint (weights_only); with `model`/`vocab`, check it belongs to them."""
    ckpt = _load(path, "checkpoint")
    _check_parts(ckpt, _CHECKPOINT_PARTS, path, "checkpoint")
    if model is not None:
        if ckpt["config"] != model.config.to_dict() or ckpt["vocab_size"] != model.vocab_size:
            raise CheckpointError(
                f"checkpoint {path} holds a {_describe(ckpt['config'], ckpt['vocab_size'])}, but this run built a "
                f"{_describe(model.config.to_dict(), model.vocab_size)}; use the same --config and --data as the "
                f"run that wrote it, or another --out to start afresh")
    if vocab is not None and ckpt["vocab"] != vocab.to_dict():
        theirs = [str(w) for w in ckpt["vocab"]["itos"]]
        i = next((i for i, (a, b) in enumerate(zip(theirs, vocab.itos)) if a != b), min(len(theirs), len(vocab.itos)))
        raise CheckpointError(
            f"checkpoint {path} was trained on another vocabulary ({len(theirs):,} words) than this corpus "
            f"({len(vocab.itos):,} words); they first differ at id {i}; use the same --data as the run "
            f"that wrote it, or another --out to start afresh")
    return ckpt


def save_model(path, model: LSTMLM, vocab, *, placement: str | None = None) -> None:
    """Final weights with what is needed to rebuild them: config and vocabulary."""
    atomic_save({"format": MODEL_FORMAT, "model": model.state_dict(), "config_name": _config_name(model.config),
                 "config": model.config.to_dict(), "vocab_size": model.vocab_size, "vocab": vocab.to_dict(),
                 "placement": placement}, path)


def load_model(path):
    """(model, vocab) from a file written by save_model (e.g. runs/latest/model.pt), on the CPU."""
    from .data import Vocabulary
    saved = _load(path, "model file")
    _check_parts(saved, _MODEL_PARTS, path, "model file")
    try:
        vocab = Vocabulary.from_dict(saved["vocab"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"model file {path} is damaged: its vocabulary is invalid ({e})") from None
    model = LSTMLM(saved["vocab_size"], LMConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model, vocab
