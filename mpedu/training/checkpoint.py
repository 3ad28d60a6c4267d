"""Checkpoints and model files: atomic writes, weights-only reads, and errors that name the file and the fix."""
from __future__ import annotations

import contextlib
import hashlib
import pickle
import random
import re
import warnings
import zipfile
from pathlib import Path

import torch

from ..lm.model import CONFIGS, LSTMLM, LMConfig
from ..runtime.files import atomic_write, temp_prefix
from ..runtime.values import shorten

CHECKPOINT_FORMAT = "mpedu-checkpoint-1"
MODEL_FORMAT = "mpedu-model-1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that belongs to another model."""


def _config_name(config: LMConfig) -> str:
    """The first CONFIGS name of `config`, or "custom" when its sizes match none."""
    return next((name for name, c in CONFIGS.items() if c == config), "custom")


def _describe(config: dict, vocab_size: int) -> str:
    # every name of its sizes ('laptop' / 'small' share theirs), in alphabetical order
    names = " / ".join(sorted(f"'{name}'" for name, c in CONFIGS.items() if c == LMConfig(**config))) or "'custom'"
    return (f"{names} model (embed {config['embed_size']}, hidden {config['hidden_size']}, "
            f"{config['num_layers']} LSTM layers, {vocab_size:,}-word vocabulary)")


# ---------------------------------------------------------------- writing

def atomic_save(obj, path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: readers see old or new, never half.

    A failed write (disk full, file-size limit) raises OSError naming the cause; the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    atomic_write(path, lambda f: torch.save(obj, f))


def remove_stale_temp(path) -> list[Path]:
    """Delete temp files an interrupted `atomic_save` of `path` left behind (a kill between write
    and rename); they are never read. Returns what was removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = [p for p in path.parent.glob(f"{temp_prefix(path)}*.tmp") if p.is_file()]
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
    return stale


# ---------------------------------------------------------------- reading

_UNSAFE_RE = re.compile(r"(?:unsupported GLOBAL|Unsupported global:\s*GLOBAL)\s+([\w.]+)", re.IGNORECASE)


def _what_is(path: Path) -> str:
    """What a file that torch cannot read looks like, from its first bytes (for the error message)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        return "is empty (0 bytes)"
    if head.startswith(b"\x1f\x8b"):
        return "is a gzip-compressed file, not a checkpoint (if it holds one, decompress it first: gunzip)"
    if head.startswith(b"PK\x03\x04"):
        return ("is a PyTorch (zip) file that is truncated or damaged (a copy or a write that did not "
                "finish?)")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "is a Python pickle that is not a PyTorch checkpoint, or is truncated"
    if all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        return f"is a text file (it starts with {head.decode('ascii')!r}), not a PyTorch file"
    return f"is not a PyTorch file (it starts with bytes {head[:8].hex(' ')})"


def _pickled_callables(path: Path) -> list[str]:
    """The Python callables a plain pickle file names (GLOBAL, STACK_GLOBAL), read without running it.

    torch's weights-only reader stops at the first opcode it does not support (protocol 4's
    FRAME) before it sees a callable, so its message cannot tell a malicious pickle from junk."""
    import pickletools
    names, strings = [], []
    with contextlib.suppress(Exception), open(path, "rb") as f:   # junk: whatever was read so far
        for op, arg, _ in pickletools.genops(f):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
            if len(names) >= 3:
                break
    return names


def _load(path, kind: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no {kind} at {path}" + (" (a folder of that name)" if path.is_dir() else ""))
    try:
        with warnings.catch_warnings():   # torch warns about odd pickle protocols: noise for a file we refuse anyway
            warnings.simplefilter("ignore")
            # weights_only: tensors, numbers, strings, lists and dicts only; a pickle that names any
            # other Python callable (os.system, ...) is refused before anything runs
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        _check_crc(path, kind)         # a damaged byte can mangle a name into one that looks foreign
        # Only a pickle that names a Python callable could run code; random bytes or a gzip file
        # also fail the weights-only reader, with another message, and are merely not checkpoints.
        found = _UNSAFE_RE.search(str(e))
        names = [found.group(1)] if found else _pickled_callables(path)
        if "Weights only load failed" not in str(e) or not names:
            raise _damaged(path, kind, e) from None
        raise CheckpointError(f"{path} holds Python objects, not just weights (it names {', '.join(names)}); "
                              f"loading it could run code, so mpedu refuses it. If you did not write this "
                              f"file, delete it; mpedu writes only tensors and plain data") from None
    except Exception as e:  # truncated zip, random bytes, ...: the torch message alone does not name the file
        raise _damaged(path, kind, e) from None
    expected = CHECKPOINT_FORMAT if kind == "checkpoint" else MODEL_FORMAT
    if not isinstance(obj, dict) or obj.get("format") != expected:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path} is not an mpedu {kind} (format {found!r}, expected {expected!r})")
    _verify_checksums(obj, path, kind)       # tensors, by name
    _check_crc(path, kind)                   # the rest: numbers, options, history
    return obj


def _check_crc(path: Path, kind: str) -> None:
    """A PyTorch file is a zip whose every part carries a CRC-32: a changed byte anywhere (a number in the
    history or the options, which the tensor checksums do not cover; a name in the pickle, which would
    otherwise read as a foreign callable) is damage, and named so."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError):   # not a zip, or cut short: torch says
        return
    if bad is not None:
        raise CheckpointError(f"{kind} {path} is damaged: its part {bad!r} does not match the CRC-32 written with "
                              "it (changed on disk or by an edit); delete it, or pick another --out")


def _damaged(path, kind, e) -> CheckpointError:
    try:
        what = _what_is(path)
    except OSError as read_error:
        what = f"cannot be read ({read_error.strerror or read_error})"
    return CheckpointError(f"{kind} {path} {what}, so it cannot be read as an mpedu {kind} "
                           f"(torch says: {e.__class__.__name__}: {shorten((str(e).splitlines() or [''])[0], 160)}); "
                           f"delete it, or pick another --out")


# ---------------------------------------------------------------- checksums

def _tensors(obj, prefix: str = ""):
    """(path, tensor) for every tensor inside nested dicts, lists and tuples: 'model/embed.embedding.weight'."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if not (prefix == "" and key == "checksums"):
                yield from _tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}")


def _digest(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)           # fast; guards against damage, not against a forger
    h.update(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def checksums(obj: dict) -> dict[str, str]:
    """A digest of every tensor in a checkpoint or model file, by its path inside the file."""
    return {path: _digest(t) for path, t in _tensors(obj)}


def _verify_checksums(obj: dict, path, kind: str) -> None:
    """Refuse a file whose tensors changed after it was written, naming them (a flipped bit on disk,
    an edit): such weights load and train without any other sign."""
    stored = obj.get("checksums")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{kind} {path} has no tensor checksums: it was written by an older mpedu or "
                              "altered since, so its weights cannot be trusted; delete it, or pick another --out")
    try:
        now = checksums(obj)
    except (RuntimeError, TypeError, ValueError) as e:   # a tensor torch cannot view as bytes
        raise CheckpointError(f"{kind} {path} is damaged: one of its tensors cannot be read ({e}); delete "
                              "it, or pick another --out") from None
    changed = sorted(k for k in set(now) | set(stored) if now.get(k) != stored.get(k))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise CheckpointError(f"{kind} {path} does not match its checksums: {len(changed)} tensor(s) changed "
                              f"since mpedu wrote it ({shown}); the file was altered or damaged on disk. Delete "
                              "it, or pick another --out")


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
    unknown = sorted(set(obj["config"]) - set(LMConfig.__dataclass_fields__))
    if unknown:
        raise CheckpointError(f"{kind} {path} has model settings this mpedu does not know ({', '.join(map(str, unknown))}): "
                              "it was written by a newer mpedu or another program. Load it with the mpedu that "
                              "wrote it, or delete it, or pick another --out")
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
    if isinstance(layers, int) and not isinstance(layers, bool) and 4 * layers + 3 < len(obj["model"]):
        with torch.device("meta"):
            known = set(LSTMLM(obj["vocab_size"], config).state_dict())
        extra = sorted(set(obj["model"]) - known)
        if extra:
            raise CheckpointError(f"{kind} {path} holds weights this mpedu does not know ({', '.join(extra[:3])}): "
                                  "it was written by a newer mpedu or another program. Load it with the mpedu "
                                  "that wrote it, or delete it, or pick another --out")
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
                    totals: dict | None = None, placement: str | None = None, settings: dict | None = None,
                    options: dict | None = None, carried: dict | None = None) -> None:
    """Everything needed to continue exactly: weights, optimizer, RNGs, data position (epoch, batch), history.

    `history` is a train.History (or anything with `to_dict()`). The weights are stored per
    layer name, so a checkpoint loads onto any placement and device count. `settings` fix the
    data order (batch size, seed, ...); `options` are what a resume may change (lr, clip, decay);
    `carried`: stream mode's recurrent state going into the next batch (a runner's carried_state).
    Every tensor's checksum is stored with it, and checked on loading.
    """
    content = {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "lr": optimizer.param_groups[0]["lr"], "rng": _rng_state(),
        # the next batch to run is batch `batch` of epoch `epoch` (0-based); totals: the epoch so far
        "position": {"epoch": epoch, "batch": batch, "totals": dict(totals or {})},
        "history": history.to_dict(), "vocab": vocab.to_dict(),
        "config_name": _config_name(model.config), "config": model.config.to_dict(), "vocab_size": model.vocab_size,
        "placement": placement, "settings": dict(settings or {}), "options": dict(options or {}),
        "carried": carried,
    }
    atomic_save({**content, "checksums": checksums(content)}, path)


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
    content = {"format": MODEL_FORMAT, "model": model.state_dict(), "config_name": _config_name(model.config),
               "config": model.config.to_dict(), "vocab_size": model.vocab_size, "vocab": vocab.to_dict(),
               "placement": placement}
    atomic_save({**content, "checksums": checksums(content)}, path)


def load_model(path):
    """(model, vocab) from a file written by save_model (e.g. runs/latest/model.pt), on the CPU."""
    from ..lm.data import Vocabulary
    saved = _load(path, "model file")
    _check_parts(saved, _MODEL_PARTS, path, "model file")
    try:
        vocab = Vocabulary.from_dict(saved["vocab"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"model file {path} is damaged: its vocabulary is invalid ({e})") from None
    model = LSTMLM(saved["vocab_size"], LMConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model, vocab
