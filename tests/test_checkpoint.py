"""Checkpoints a user can trust: checksums, files that are not checkpoints, a full disk, going back, overrides."""
import gzip
import os
import pickle
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpedu.__main__ as cli
from mpedu.checkpoint import CheckpointError, checksums, load_checkpoint, load_model
from mpedu.data import Corpus, load_corpus
from mpedu.model import LSTMLM
from mpedu.train import train

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", "tiny", "--limit-batches", "3", "--batch-size", "16", "--no-progress", "--devices", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


@pytest.fixture(scope="module")
def little():
    corpus = load_corpus()
    return Corpus(corpus.vocab, corpus.train[:120], corpus.valid[:30], corpus.test[:30], name="little")


def lm(corpus, seed=0):
    torch.manual_seed(seed)
    return LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))


def quiet(lines=None, **kw):
    return dict(progress=False, log=(lambda line: None) if lines is None else lines.append, batch_size=16,
                limit_batches=2, **kw)


@pytest.fixture(scope="module")
def trained(little, tmp_path_factory):
    """A folder with the checkpoint.pt and model.pt of one epoch."""
    out = tmp_path_factory.mktemp("trained")
    train(lm(little), little, epochs=1, out=out, **quiet())
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
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))                    # the half-written temp file is gone


# ---------------------------------------------------------------- 1 and 2: resuming

def test_an_lr_given_on_resume_wins_and_is_named(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, lr=10.0, **quiet())
    lines = []
    history = train(lm(little), little, epochs=2, out=tmp_path, lr=0.001, resume=True, **quiet(lines))
    assert history.epochs[1]["lr"] == 0.001
    assert any("lr 0.001 (given) replaces the checkpoint's lr 10" in line for line in lines), lines
    # the same command again continues with the lr as the run left it (here halved), saying nothing
    lines = []
    history = train(lm(little), little, epochs=3, out=tmp_path, lr=0.001, resume=True, **quiet(lines))
    assert history.epochs[2]["lr"] in (0.001, 0.0005) and not any("replaces" in line for line in lines)


def test_an_lr_not_given_on_resume_is_the_checkpoints(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, lr=3.0, **quiet())
    history = train(lm(little), little, epochs=2, out=tmp_path, resume=True, **quiet())
    assert history.epochs[1]["lr"] in (3.0, 1.5)


def test_the_cli_resume_with_a_new_lr_prints_it_in_the_summary(capsys, tmp_path):
    assert cli.main(["train", *QUICK, "--epochs", "1", "--out", str(tmp_path)]) == 0
    code = cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", "--lr", "0.001",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0 and cli.json.loads(out.strip().splitlines()[-1])["lr"] == 0.001
    assert "lr 0.001 (given) replaces the checkpoint's lr 10" in out


def test_a_clip_given_on_resume_is_named(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, clip=0.25, **quiet())
    lines = []
    train(lm(little), little, epochs=2, out=tmp_path, clip=1.0, resume=True, **quiet(lines))
    assert any("clip=0.25; this run uses clip=1.0" in line for line in lines), lines


def test_fewer_epochs_than_trained_is_refused_and_the_checkpoint_is_untouched(capsys, tmp_path):
    assert cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", *QUICK, "--epochs", "1", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "has already trained 2 epochs, more than the 1 epochs" in err and "--epochs 3 or more" in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # the same --epochs again: nothing to train, nothing rewritten, the summary as it was
    assert cli.main(["train", *QUICK, "--epochs", "2", "--out", str(tmp_path), "--resume", "--json"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and cli.json.loads(out.strip().splitlines()[-1])["epochs"] == 2
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # and a later, larger --epochs goes on from epoch 3: history epochs 1, 2, 3
    assert cli.main(["train", *QUICK, "--epochs", "3", "--out", str(tmp_path), "--resume"]) == 0
    assert [e["epoch"] for e in load_checkpoint(tmp_path / "checkpoint.pt")["history"]["epochs"]] == [1, 2, 3]


def test_train_refuses_to_go_back_before_changing_anything(little, tmp_path):
    train(lm(little), little, epochs=1, out=tmp_path, **quiet())
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(CheckpointError, match="already trained 1 epochs.*--epochs 2 or more"):
        train(lm(little), little, epochs=0, out=tmp_path, resume=True, **quiet())
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
