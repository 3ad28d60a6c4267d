"""Checkpoints a user can trust: checksums, files that are not checkpoints, a full disk, going back, overrides."""
import copy
import gzip
import io
import json
import math
import os
import pickle
import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import mpedu.cli.commands as cli
from conftest import FUZZ, lm, quiet
from mpedu.training import (CheckpointError, History, atomic_save, checksums, load_checkpoint,
    load_model, save_checkpoint, train)
from mpedu.lm import Corpus, LSTMLM, Vocabulary, load_corpus


ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", "tiny", "--limit-batches", "3", "--batch-size", "16", "--no-progress", "--devices", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


@pytest.fixture(scope="module")
def little120():
    corpus = load_corpus()
    return Corpus(corpus.vocab, corpus.train[:120], corpus.valid[:30], corpus.test[:30], name="little")


def short_run(lines=None, **kw):
    return dict(progress=False, log=(lambda line: None) if lines is None else lines.append, batch_size=16,
                limit_batches=2, **kw)


@pytest.fixture(scope="module")
def trained(little120, tmp_path_factory):
    """A folder with the checkpoint.pt and model.pt of one epoch."""
    out = tmp_path_factory.mktemp("trained")
    train(lm(little120), little120, epochs=1, out=out, **short_run())
    return out


def copy_of(trained, tmp_path, name="checkpoint.pt"):
    (tmp_path / name).write_bytes((trained / name).read_bytes())
    return tmp_path / name


# ---------------------------------------------------------------- 3: checksums

@pytest.mark.parametrize("name", ["checkpoint.pt", "model.pt"])
def test_flipped_weights_are_refused_naming_the_tensor(trained, tmp_path, name):
    path = copy_of(trained, tmp_path, name)
    obj = torch.load(path, weights_only=True)
    weight = obj["model"]["layers.lstm0.lstm.weight_hh_l0"]
    weight.view(-1)[:16] = -weight.view(-1)[:16]            # 16 floats changed, the file otherwise intact
    torch.save(obj, path)
    read = load_checkpoint if name == "checkpoint.pt" else load_model
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) changed.*model/layers\.lstm0\.lstm\.weight_hh_l0"):
        read(path)


def test_bytes_flipped_on_disk_are_refused(trained, tmp_path):
    path = copy_of(trained, tmp_path)
    data = bytearray(path.read_bytes())
    weights = torch.load(path, weights_only=True)["model"]["layers.decode.linear.weight"]
    raw = weights.numpy().tobytes()[:64]                   # find the tensor's bytes in the zip, flip one bit
    at = bytes(data).find(raw)
    assert at > 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="decode.linear.weight"):
        load_checkpoint(path)


@pytest.mark.parametrize("where", ["a number", "a name"])
def test_a_changed_byte_outside_the_tensors_is_damage(trained, tmp_path, where):
    """The pickle part (history, options, lr: no tensor checksum covers it) is guarded by the zip's CRC-32: an
    lr edited from 10 to 1000 resumed as if given, and a mangled name read as a foreign callable."""
    path = copy_of(trained, tmp_path)
    data = bytearray(path.read_bytes())
    if where == "a number":                               # the lr, a pickled float 10.0 (opcode G, big-endian)
        at = bytes(data).find(b"G" + struct.pack(">d", 10.0))
        data[at + 1:at + 9] = struct.pack(">d", 1000.0)
    else:
        at = bytes(data).find(b"torch._utils")
        data[at + 6:at + 10] = b"ZZZZ"
    assert at > 0
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is damaged: its part 'archive/data\.pkl' does not match the CRC-32"):
        load_checkpoint(path)


def test_every_tensor_has_a_checksum_and_one_without_is_refused(trained, tmp_path):
    path = copy_of(trained, tmp_path)
    obj = torch.load(path, weights_only=True)
    sums = obj.pop("checksums")
    assert sums == checksums(obj)
    assert {"model/layers.embed.embedding.weight", "rng/torch"} <= set(sums)
    torch.save(obj, path)
    with pytest.raises(CheckpointError, match="has no tensor checksums"):
        load_checkpoint(path)


# ---------------------------------------------------------------- 11: files that are not checkpoints

def _payload():
    return os.system, ("true",)


class Reducer:
    def __reduce__(self):
        return _payload()


FILES = {
    "random bytes": (lambda good: bytes(range(7, 250)) * 3, "is not a PyTorch file"),
    "gzip": (lambda good: gzip.compress(good), "gzip-compressed"),
    "truncated": (lambda good: good[:len(good) // 2], "truncated or damaged"),
    "empty": (lambda good: b"", "is empty"),
    "text": (lambda good: b"epoch 1 train ppl 100\n", "is a text file"),
    "plain pickle": (lambda good: pickle.dumps({"a": 1}), "Python pickle that is not a PyTorch checkpoint"),
}


@pytest.mark.parametrize("kind", list(FILES))
def test_a_file_that_is_not_a_checkpoint_is_described_not_called_dangerous(trained, tmp_path, kind, capsys):
    make, words = FILES[kind]
    (tmp_path / "checkpoint.pt").write_bytes(make((trained / "checkpoint.pt").read_bytes()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "checkpoint.pt")
    assert words in str(info.value) and "could run code" not in str(info.value)
    assert cli.main(["train", *QUICK, "--epochs", "1", "--resume", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_real_pickled_object_keeps_the_code_warning(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(pickle.dumps(Reducer()))
    with pytest.raises(CheckpointError, match=r"it names \w+\.system.*could run code"):
        load_checkpoint(tmp_path / "checkpoint.pt")


# ---------------------------------------------------------------- 7: a full disk

def _limit_file_size(nbytes):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write then fails with EFBIG, as a full disk does
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_the_old_checkpoint_stays(tmp_path):
    assert cli.main(["train", *QUICK, "--epochs", "1", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    # the resumed run's checkpoint is as large as the first: half of it is over the limit
    proc = subprocess.run([sys.executable, "-m", "mpedu", "train", *QUICK, "--epochs", "2", "--resume",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_file_size(len(before) // 2))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "File too large" in proc.stderr and "is as it was before this run" in proc.stderr
    assert "cannot write the checkpoint after epoch 2 to" in proc.stderr      # (not "at epoch 3, batch 0" of 2)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))                    # the half-written temp file is gone


# ---------------------------------------------------------------- 1 and 2: resuming

def test_an_lr_given_on_resume_wins_and_is_named(little120, tmp_path):
    train(lm(little120), little120, epochs=1, out=tmp_path, lr=10.0, **short_run())
    lines = []
    history = train(lm(little120), little120, epochs=2, out=tmp_path, lr=0.001, resume=True, **short_run(lines))
    assert history.epochs[1]["lr"] == 0.001
    assert any("lr 0.001 (given) replaces the checkpoint's lr 10" in line for line in lines), lines
    # the same command again continues with the lr as the run left it (here halved), saying nothing
    lines = []
    history = train(lm(little120), little120, epochs=3, out=tmp_path, lr=0.001, resume=True, **short_run(lines))
    assert history.epochs[2]["lr"] in (0.001, 0.0005) and not any("replaces" in line for line in lines)


def test_an_lr_not_given_on_resume_is_the_checkpoints(little120, tmp_path):
    train(lm(little120), little120, epochs=1, out=tmp_path, lr=3.0, **short_run())
    history = train(lm(little120), little120, epochs=2, out=tmp_path, resume=True, **short_run())
    assert history.epochs[1]["lr"] in (3.0, 1.5)


def test_the_cli_resume_with_a_new_lr_prints_it_in_the_summary(capsys, tmp_path):
    assert cli.main(["train", *QUICK, "--epochs", "1", "--out", str(tmp_path)]) == 0
    code = cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", "--lr", "0.001",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["lr"] == 0.001
    assert "lr 0.001 (given) replaces the checkpoint's lr 10" in out


def test_a_clip_given_on_resume_is_named(little120, tmp_path):
    train(lm(little120), little120, epochs=1, out=tmp_path, clip=0.25, **short_run())
    lines = []
    train(lm(little120), little120, epochs=2, out=tmp_path, clip=1.0, resume=True, **short_run(lines))
    assert any("clip=0.25; this run uses clip=1.0" in line for line in lines), lines


def test_another_micro_batch_count_on_resume_is_named(little120, tmp_path):
    """Bit for bit needs the same micro-batches and chunks; another count resumes (to float rounding) and says so."""
    from mpedu.core import Pipeline
    model = lm(little120)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=2) as pipe:
        train(model, little120, runner=pipe, epochs=1, out=tmp_path, **short_run())
    lines, model = [], lm(little120)
    with Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=4) as pipe:
        train(model, little120, runner=pipe, epochs=2, out=tmp_path, resume=True, **short_run(lines))
    assert any("used micro_batches=2; this run uses micro_batches=4" in line and "float rounding" in line
               for line in lines), lines
    assert not any("chunks=" in line for line in lines)


def test_fewer_epochs_than_trained_is_refused_and_the_checkpoint_is_untouched(capsys, tmp_path):
    assert cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", *QUICK, "--epochs", "1", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "has already trained 2 epochs, more than asked for (--epochs 1)" in err and "--epochs 3 or more" in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # the same --epochs again: nothing to train, nothing rewritten, the summary as it was
    assert cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", "--json"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and json.loads(out.strip().splitlines()[-1])["epochs"] == 2
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # and a later, larger --epochs goes on from epoch 3: history epochs 1, 2, 3
    assert cli.main(["train", *QUICK, "--epochs", "3", "--out", str(tmp_path), "--resume"]) == 0
    assert [e["epoch"] for e in load_checkpoint(tmp_path / "checkpoint.pt")["history"]["epochs"]] == [1, 2, 3]


def test_an_extended_run_stopped_before_its_test_ends_with_its_own_test_and_model_file(little120, tmp_path,
                                                                                     monkeypatch):
    """Extended from 1 to 2 epochs and stopped during the final test (after the last checkpoint): the resume
    said "nothing to train" with the 1-epoch run's test perplexity and left the 1-epoch model.pt."""
    import mpedu.training.loop as training
    first = train(lm(little120), little120, epochs=1, out=tmp_path, **short_run())
    one_epoch = (tmp_path / "model.pt").read_bytes()
    real = training.evaluate

    def stopped_at_the_test(runner, sentences, *args, **kwargs):
        if sentences is little120.test:
            raise KeyboardInterrupt
        return real(runner, sentences, *args, **kwargs)
    monkeypatch.setattr(training, "evaluate", stopped_at_the_test)
    with pytest.raises(KeyboardInterrupt):
        train(lm(little120), little120, epochs=2, out=tmp_path, resume=True, **short_run())
    monkeypatch.undo()
    assert (tmp_path / "model.pt").read_bytes() == one_epoch
    lines = []
    second = train(lm(little120), little120, epochs=2, out=tmp_path, resume=True, **short_run(lines))
    assert not any("nothing to train" in line for line in lines) and second.test_ppl != first.test_ppl
    saved, _ = load_model(tmp_path / "model.pt")
    trained_two = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    assert all(torch.equal(t, trained_two[k]) for k, t in saved.state_dict().items())
    # finished: a model.pt that is not the checkpoint's weights (here the 1-epoch one) is written again
    (tmp_path / "model.pt").write_bytes(one_epoch)
    lines = []
    train(lm(little120), little120, epochs=2, out=tmp_path, resume=True, **short_run(lines))
    assert any("nothing to train" in line for line in lines) and any("written again" in line for line in lines)
    saved, _ = load_model(tmp_path / "model.pt")
    assert all(torch.equal(t, trained_two[k]) for k, t in saved.state_dict().items())


def test_train_refuses_to_go_back_before_changing_anything(little120, tmp_path):
    train(lm(little120), little120, epochs=1, out=tmp_path, **short_run())
    before = (tmp_path / "checkpoint.pt").read_bytes()
    model = lm(little120)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="already trained 1 epochs.*--epochs 2 or more"):
        train(model, little120, epochs=0, out=tmp_path, resume=True, **short_run())
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # nor the caller's model: the checkpoint's weights were loaded into it before the refusal
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- writing, refusing, loading back

def small_checkpoint(path, corpus, marker):
    model = lm(corpus)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    save_checkpoint(path, model=model, optimizer=optimizer, vocab=corpus.vocab,
                    history=History([{"marker": marker}]), epoch=marker)
    return model


def test_a_crash_while_writing_keeps_the_old_checkpoint(little, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    real_save = torch.save

    def dies_halfway(obj, f):  # the disk fills up (or the process dies) half-way through the write
        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="simulated"):
        small_checkpoint(path, little, marker=2)
    monkeypatch.undo()
    assert load_checkpoint(path)["history"]["epochs"] == [{"marker": 1}]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left behind


def test_a_truncated_checkpoint_names_the_file(little, tmp_path):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="damaged") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    with pytest.raises(CheckpointError, match="checkpoint.pt"):
        train(lm(little), little, epochs=1, out=tmp_path, resume=True, **quiet())
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_a_checkpoint_of_another_model_is_refused(little, tmp_path):
    path = tmp_path / "checkpoint.pt"
    small_checkpoint(path, little, marker=1)
    other = LSTMLM.from_config("small", vocab_size=len(little.vocab))
    with pytest.raises(CheckpointError) as err:
        train(other, little, epochs=1, out=tmp_path, resume=True, **quiet())
    assert "'tiny' model" in str(err.value) and "'small' model" in str(err.value)

    words = list(little.vocab.itos)
    words[10], words[11] = words[11], words[10]
    swapped = Corpus(Vocabulary(words), little.train, little.valid, little.test, name="swapped")
    with pytest.raises(CheckpointError, match="another vocabulary.*differ at id 10"):
        train(lm(little), swapped, epochs=1, out=tmp_path, resume=True, **quiet())


def test_final_model_and_vocabulary_load_back(little, tmp_path):
    model = lm(little)
    train(model, little, epochs=1, batch_size=16, out=tmp_path, **quiet())
    loaded, vocab = load_model(tmp_path / "model.pt")
    assert vocab.itos == little.vocab.itos and loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(CheckpointError, match="not an mpedu model file"):
        load_model(tmp_path / "checkpoint.pt")


RUN = dict(batch_size=16, lr=5.0, seed=3, checkpoint_every=3)


def test_a_leftover_temp_file_is_removed_and_never_read(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, limit_batches=2, **quiet(**RUN))
    before = load_checkpoint(tmp_path / "checkpoint.pt")
    junk = tmp_path / ".checkpoint.pt.abc123.tmp"
    junk.write_bytes(b"half a checkpoint")
    lines = []
    train(lm(little), little, epochs=1, out=tmp_path, resume=True, limit_batches=2, **quiet(lines, **RUN))
    assert not junk.exists() and any("never read" in line and junk.name in line for line in lines)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["history"] == before["history"]


def test_the_kill_tests_slow_write_only_delays_the_rename(tmp_path, monkeypatch):
    import mpedu.training.checkpoint
    from slow_checkpoints import slow_down
    monkeypatch.setattr(mpedu.training.checkpoint, "atomic_write", mpedu.training.checkpoint.atomic_write)   # put back afterwards
    slow_down(0.05)
    start = time.monotonic()
    atomic_save({"x": torch.ones(2)}, tmp_path / "f.pt")
    assert time.monotonic() - start >= 0.05
    assert torch.load(tmp_path / "f.pt", weights_only=True)["x"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]


# ---------------------------------------------------------------- untrusted files

class _Payload:
    """Unpickling this would create `marker`: what a malicious checkpoint would do."""

    def __init__(self, marker, how):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        return Path.write_text, (Path(self.marker), "owned")


@pytest.mark.parametrize("how", ["os.system", "Path.write_text"])
@pytest.mark.parametrize("container", ["torch.save", "raw pickle"])
def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, little, capsys, how, container):
    marker = tmp_path / "marker"
    payload = _Payload(marker, how)
    path = tmp_path / "checkpoint.pt"
    if container == "torch.save":
        torch.save({"format": "mpedu-checkpoint-1", "model": payload}, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match=r"holds Python objects, not just weights.*refuses it"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="refuses it"):
        train(lm(little), little, epochs=1, out=tmp_path, resume=True, **quiet(**RUN))
    assert cli.main(["train", "--devices", "1", "--resume", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "refuses it" in capsys.readouterr().err
    assert not marker.exists()
    if container == "raw pickle":        # the test means something: unpickled, it does write the marker
        pickle.loads(path.read_bytes())
        assert marker.exists()


@given(st.binary(max_size=3000))
@FUZZ
def test_random_bytes_are_a_checkpoint_error(tmp_path, data):
    path = tmp_path / "random.pt"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


@pytest.fixture(scope="module")
def good_checkpoint(little, tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    train(lm(little), little, epochs=1, out=out, limit_batches=2, **quiet(**RUN))
    return (out / "checkpoint.pt").read_bytes()


@given(st.floats(0.0, 0.999))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_truncated_checkpoint_is_a_checkpoint_error(tmp_path, good_checkpoint, fraction):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(good_checkpoint[:int(len(good_checkpoint) * fraction)])
    with pytest.raises(CheckpointError, match="checkpoint.pt"):
        load_checkpoint(path)


ODD_VALUES = [None, 0, -1, 10**6, 1e308, math.nan, "x", True, [], [1, "a"], {}, {"a": 1}, torch.zeros(3),
              torch.zeros(2, 2, dtype=torch.uint8)]


PATHS = [("model",), ("model", "layers.lstm0.lstm.weight_hh_l0"), ("optimizer",), ("optimizer", "param_groups"),
         ("optimizer", "state"), ("rng",), ("rng", "torch"), ("rng", "python"), ("position",), ("position", "epoch"),
         ("position", "batch"), ("position", "totals"), ("history",), ("history", "epochs"), ("vocab",),
         ("vocab", "itos"), ("config",), ("config", "num_layers"), ("config", "hidden_size"), ("vocab_size",),
         ("settings",), ("format",), ("placement",), ("lr",), ("carried",)]


@given(st.sampled_from(PATHS), st.sampled_from(range(len(ODD_VALUES))), st.booleans())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_tampered_checkpoint_resumes_or_is_refused_clearly(tmp_path, little, good_checkpoint, key, value, delete):
    ckpt = torch.load(io.BytesIO(good_checkpoint), weights_only=True)
    *parents, last = key
    node = ckpt
    for k in parents:
        node = node[k]
    if delete:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(ODD_VALUES[value])
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    torch.save(ckpt, out / "checkpoint.pt")
    try:   # epochs=1: the checkpoint is at the end of epoch 1, so a good one only evaluates the test split
        history = train(lm(little), little, epochs=1, out=out, resume=True, limit_batches=2, **quiet(**RUN))
    except CheckpointError as e:
        assert "checkpoint" in str(e) and str(out) in str(e)
    else:
        history.summary()


def test_the_checkpoint_names_live_in_checkpoint_and_the_old_training_module_is_gone():
    # (wave 1 checked that mpedu.train re-exported these "for older code"; the re-exports and the module are gone)
    import importlib.util
    import mpedu
    checkpoint = importlib.import_module("mpedu.training.checkpoint")
    for name in ("CheckpointError", "save_checkpoint", "load_checkpoint", "save_model", "load_model",
                 "CHECKPOINT_FORMAT", "MODEL_FORMAT"):
        assert hasattr(checkpoint, name), name
    assert mpedu.load_model is checkpoint.load_model
    assert importlib.util.find_spec("mpedu.train") is None


def _rewritten(good_checkpoint, tmp_path, change):
    """The good checkpoint changed by `change(obj)`, its tensor checksums recomputed: as mpedu would write it."""
    ckpt = torch.load(io.BytesIO(good_checkpoint), weights_only=True)
    change(ckpt)
    ckpt.pop("checksums")
    ckpt["checksums"] = checksums(ckpt)
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    torch.save(ckpt, out / "checkpoint.pt")
    return out


@pytest.mark.parametrize("change, words", [
    (lambda c: c["config"].update(rotary=True), r"has model settings this mpedu does not know \(rotary\)"),
    (lambda c: c["model"].update({"layers.decode.gate": torch.zeros(3)}),
     r"holds weights this mpedu does not know \(layers.decode.gate\)"),
], ids=["a config field", "a weight"])
def test_a_checkpoint_of_a_newer_mpedu_is_called_that_not_damaged(tmp_path, little, good_checkpoint, change, words):
    out = _rewritten(good_checkpoint, tmp_path, change)
    with pytest.raises(CheckpointError, match=words) as e:
        train(lm(little), little, epochs=2, out=out, resume=True, limit_batches=2, **quiet(**RUN))
    assert "written by a newer mpedu or another program" in str(e.value) and "damaged" not in str(e.value)


def test_a_position_past_the_epochs_end_is_refused_before_any_step(tmp_path, little, good_checkpoint):
    out = _rewritten(good_checkpoint, tmp_path, lambda c: c["position"].update(epoch=0, batch=10**9))
    with pytest.raises(CheckpointError, match=r"says it stopped at batch 1,000,000,000 of epoch 1, but an epoch "
                                              r"here has 2 batches \(batch size \d+, --limit-batches 2\)"):
        train(lm(little), little, epochs=1, out=out, resume=True, limit_batches=2, **quiet(**RUN))
