"""The command line: `python -m mpedu train` and `corpus`, in-process and as a real subprocess."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import mpedu.cli.commands as cli
from mpedu.cli import main
from mpedu.training import History, load_model


ROOT = Path(__file__).resolve().parents[1]
PTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "ptb"
# a quick run; --no-baselines: its pipeline's measurement beside one device is tested once, on its own
QUICK = ["--config", "tiny", "--epochs", "1", "--limit-batches", "4", "--batch-size", "16", "--no-progress",
         "--no-baselines"]
KEYS = {"config", "epochs", "train_ppl", "valid_ppl", "test_ppl", "tokens_per_s"}


pytestmark = pytest.mark.usefixtures("one_thread")   # see conftest.one_thread


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def test_train_on_one_device_prints_epochs_and_a_json_summary(capsys, tmp_path):
    code, out, err = run(capsys, "train", "--devices", "1", *QUICK, "--out", str(tmp_path), "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert any(line.startswith("epoch   1/1  train ppl") and "tok/s" in line for line in lines)
    summary = last_json(out)
    assert KEYS <= set(summary) and summary["config"] == "tiny" and summary["epochs"] == 1
    assert summary["runner"] == "single" and summary["devices"] == ["cpu"]
    assert all(math.isfinite(summary[k]) and summary[k] > 1 for k in ("train_ppl", "valid_ppl", "test_ppl"))
    assert (tmp_path / "checkpoint.pt").is_file() and (tmp_path / "model.pt").is_file()


def test_resume_continues_and_a_foreign_checkpoint_is_an_error(capsys, tmp_path):
    out_dir = ["--devices", "1", "--out", str(tmp_path)]
    assert run(capsys, "train", *out_dir, *QUICK)[0] == 0
    code, out, _ = run(capsys, "train", *out_dir, *QUICK[:2], "--epochs", "2", *QUICK[4:], "--resume", "--json")
    assert code == 0 and "resumed from" in out
    assert "epoch   1/2" not in out and "epoch   2/2" in out
    assert last_json(out)["epochs"] == 2

    code, out, err = run(capsys, "train", *out_dir, "--config", "small", *QUICK[2:], "--resume")
    assert code == 2
    assert err.startswith("mpedu: error: checkpoint") and "'tiny' model" in err and "'small' model" in err


def test_a_plain_resume_continues_the_runs_own_settings_bit_for_bit(capsys, tmp_path):
    """The first run's --batch-size, --seed, --clip and --limit-batches are not given again on --resume: they
    come from the checkpoint (they fell back to the recipe's, training another run), and the end is the
    uninterrupted run's model bit for bit."""
    own = ["--devices", "1", "--batch-size", "8", "--seed", "3", "--clip", "0.5", "--limit-batches", "3",
           "--no-progress", "--json"]
    assert run(capsys, "train", *own, "--epochs", "2", "--out", str(tmp_path / "whole"))[0] == 0
    assert run(capsys, "train", *own, "--epochs", "1", "--out", str(tmp_path / "cut"))[0] == 0
    code, out, err = run(capsys, "train", "--devices", "1", "--epochs", "2", "--no-progress", "--out",
                         str(tmp_path / "cut"), "--resume")
    assert code == 0, err
    assert "continuing the run's own --batch-size 8, --seed 3, --limit-batches 3, --clip 0.5" in out
    assert "this run uses" not in out                    # no setting differs from the checkpoint's
    assert (tmp_path / "cut" / "model.pt").read_bytes() != b""
    whole, cut = (load_model(tmp_path / d / "model.pt")[0].state_dict() for d in ("whole", "cut"))
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


def test_a_resume_with_no_checkpoint_yet_takes_the_recipes_lr(capsys, tmp_path):
    code, out, err = run(capsys, "train", "--config", "small", "--devices", "1", "--epochs", "1", "--limit-batches",
                         "2", "--no-progress", "--out", str(tmp_path), "--resume", "--json")
    assert code == 0, err
    assert "no checkpoint at" in out and last_json(out)["lr"] == 20        # small's lr (it took mpedu's 10)


def test_a_bad_data_folder_exits_2_naming_it(capsys, tmp_path):
    missing = tmp_path / "no-such-corpus"
    code, out, err = run(capsys, "train", "--devices", "1", "--data", str(missing), *QUICK)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("mpedu: error:") and str(missing) in err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "ptb.train.txt").write_text("a b c\n")
    code, out, err = run(capsys, "train", "--devices", "1", "--data", str(tmp_path / "half"), *QUICK)
    assert code == 2 and "ptb.valid.txt" in err


def test_no_arguments_means_train_on_two_virtual_devices_with_gpipe(monkeypatch, tmp_path):
    # the main job: the laptop model, its recipe's split over two virtual devices, GPipe with 8 micro-batches
    seen = []
    monkeypatch.chdir(tmp_path)                                          # runs/latest is made here
    monkeypatch.setattr(cli, "_train_in", lambda args, corpus, recipe: seen.append(args) or 0)
    assert main([]) == 0
    args = seen[0]
    assert (args.command, args.devices, args.placement, args.schedule, args.micro_batches) == (
        "train", None, "embed,lstm0,lstm1:vgpu0 | decode:vgpu1", "gpipe", 8)
    assert (args.config, args.out, args.data, args.resume) == ("laptop", "runs/latest", None, False)
    seen.clear()                                                         # another config: its own defaults
    assert main(["--config", "tiny"]) == 0
    assert (seen[0].devices, seen[0].placement, seen[0].micro_batches) == (2, None, 4)


def test_bad_numbers_are_argparse_errors(capsys):
    for args in (["--epochs", "0"], ["--lr", "-1"], ["--batch-size", "many"]):
        with pytest.raises(SystemExit) as exit_:
            main(["train", *args])
        assert exit_.value.code == 2
        assert args[0] in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "corpus" in out


def test_corpus_command_writes_ptb_files_that_train_reads(capsys, tmp_path):
    code, out, _ = run(capsys, "corpus", "--out", str(tmp_path / "c"), "--seed", "3")
    assert code == 0
    lines = {s: (tmp_path / "c" / f"ptb.{s}.txt").read_text().splitlines() for s in ("train", "valid", "test")}
    assert [len(v) for v in lines.values()] == [9500, 950, 950]
    code, out, _ = run(capsys, "train", "--devices", "1", "--data", str(tmp_path / "c"), *QUICK,
                       "--out", str(tmp_path / "run"), "--json")
    assert code == 0 and last_json(out)["data"] == str(tmp_path / "c")


@pytest.mark.skipif(not (PTB / "ptb.valid.txt").is_file(), reason=f"no PTB files at {PTB}")
def test_train_on_real_ptb_files(capsys, tmp_path):
    # Only PTB's valid and test files are shipped: train on valid, validate and test on test.
    data = tmp_path / "ptb"
    data.mkdir()
    for name, source in (("train", "valid"), ("valid", "test"), ("test", "test")):
        shutil.copy(PTB / f"ptb.{source}.txt", data / f"ptb.{name}.txt")
    code, out, err = run(capsys, "train", "--devices", "1", "--data", str(data), *QUICK,
                         "--out", str(tmp_path / "run"), "--json")
    assert code == 0, err
    words = int(re.search(r"\(([\d,]+) words", out).group(1).replace(",", ""))
    assert 5_000 < words <= 10_003  # PTB's 10k vocabulary, less the words only ptb.train.txt holds
    summary = last_json(out)
    assert 1 < summary["valid_ppl"] < 20_000 and math.isfinite(summary["test_ppl"])


def test_subprocess_run_ends_with_a_json_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "mpedu", "train", "--devices", "1", *QUICK,
                           "--out", str(tmp_path), "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc.stdout)
    assert KEYS <= set(summary) and summary["epochs"] == 1


def test_subprocess_bad_data_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "mpedu", "train", "--data", str(tmp_path / "nope")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("mpedu: error:") and str(tmp_path / "nope") in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the pipeline path (the default)

def test_default_runner_is_a_two_device_gpipe_pipeline(capsys, tmp_path):
    code, out, err = run(capsys, "train", *QUICK, "--out", str(tmp_path), "--json")
    assert code == 0, err
    summary = last_json(out)
    assert summary["runner"] == "pipeline" and summary["devices"] == ["vgpu:0", "vgpu:1"]
    assert summary["schedule"] == "gpipe" and summary["micro_batches"] == 4
    assert 0 <= summary["bubble_fraction"] < 1 and summary["placement"]
    # the last step's timeline as a picture, a Chrome trace and data
    trace = json.loads((tmp_path / "last_step.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"vgpu:0", "vgpu:1"}
    assert (tmp_path / "last_step.png").read_bytes()[:4] == b"\x89PNG"


def test_a_pipeline_run_ends_measured_beside_one_virtual_device_and_all_cores(capsys, tmp_path):
    measured = [a for a in QUICK if a != "--no-baselines"]
    code, out, err = run(capsys, "train", *measured, "--out", str(tmp_path), "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert "rounds in turn on the same batches: this pipeline on 2 virtual devices" in lines[-4]
    assert "one virtual device (the whole model on one core)" in lines[-3]
    assert f"one device with all cores ({len(os.sched_getaffinity(0))} intra-op threads" in lines[-2]
    summary = last_json(out)
    assert summary["pipeline_vs_one_virtual_device"] == pytest.approx(
        summary["tokens_per_s_pipeline"] / summary["tokens_per_s_one_virtual_device"], rel=1e-2)
    code, out, err = run(capsys, "train", *measured, "--out", str(tmp_path / "none"), "--json", "--no-baselines")
    assert code == 0 and "rounds in turn" not in out and "tokens_per_s_pipeline" not in last_json(out)
    code, out, err = run(capsys, "train", *measured, "--devices", "1", "--out", str(tmp_path / "one"))
    assert code == 0 and f"single device (cpu, {torch.get_num_threads()} intra-op thread" in out
    assert "rounds in turn" not in out


def test_wavefront_with_time_chunks_from_the_command_line(capsys, tmp_path):
    code, out, err = run(capsys, "train", *QUICK, "--out", str(tmp_path), "--json", "--schedule", "wavefront",
                         "--chunks", "3", "--micro-batches", "1")
    assert code == 0, err
    assert last_json(out)["schedule"] == "wavefront"
    saved = json.loads((tmp_path / "last_step.timeline.json").read_text())
    assert {e["chunk"] for e in saved["events"]} == {0, 1, 2}


@pytest.mark.parametrize("args, words", [
    (["--placement", "embed,lstm0:vgpu0 | decode:vgpu1"], "lstm1"),
    (["--schedule", "no-such-schedule"], "no-such-schedule"),
    (["--devices", "1", "--schedule", "no-such-schedule"], "no-such-schedule"),
    (["--devices", "1", "--chunks", "4"], "--chunks 4"),
    (["--schedule", "gpipe", "--chunks", "4"], "--schedule wavefront"),
])
def test_bad_pipeline_options_exit_2(capsys, tmp_path, args, words):
    code, out, err = run(capsys, "train", *args, *QUICK, "--out", str(tmp_path))
    assert code == 2 and err.startswith("mpedu: error:") and words in err, err


# ---- what a hostile user tried (issue 14): every refusal is one line naming the value, never a traceback

def refused(capsys, *args):
    """Run the CLI; return (exit code, stderr), counting argparse's exit as a return."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_a_diverged_run_prints_null_not_infinity_and_exits_1(capsys, tmp_path):
    code, out, err = run(capsys, "train", "--devices", "1", *QUICK, "--lr", "1e30", "--out", str(tmp_path),
                         "--json")
    summary = json.loads(out.strip().splitlines()[-1])    # strict JSON: json.loads accepts Infinity, so look too
    assert "Infinity" not in out.splitlines()[-1] and "NaN" not in out.splitlines()[-1]
    assert code == 1 and summary["test_ppl"] is None
    assert "training diverged" in err and "lower --lr" in err and "1e+30" in err and "Traceback" not in err


def test_timeline_files_replace_a_planted_symlink_and_never_write_through_it(capsys, tmp_path):
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me")
    for name in ("last_step.json", "last_step.png", "last_step.timeline.json"):
        (out / name).symlink_to(target)
    code, _, err = run(capsys, "train", *QUICK, "--out", str(out))
    assert code == 0, err
    assert target.read_text() == "keep me"
    for name in ("last_step.json", "last_step.png", "last_step.timeline.json"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 10


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(capsys, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mpedu.runtime import OutLock\n"
                               f"with OutLock({str(tmp_path)!r}):\n print('held', flush=True); time.sleep(60)",
                               "--pretend", "first-run"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        seen = []
        cli.train, real = (lambda *a, **k: seen.append(k)), cli.train
        try:
            code, err = refused(capsys, "train", *QUICK, "--out", str(tmp_path))
        finally:
            cli.train = real
        assert code == 2 and not seen
        assert f"in use by another mpedu run (pid {holder.pid}" in err and "first-run" in err
        assert "pick another --out" in err
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock is stale, and the next run takes it over, saying so
    code, out, err = run(capsys, "train", "--devices", "1", *QUICK, "--out", str(tmp_path))
    assert code == 0, err
    assert f"names pid {holder.pid}, which is no longer running; taking the lock over" in out
    assert (tmp_path / "mpedu.lock").read_text() == ""          # released: emptied at the end


@pytest.mark.parametrize("make", ["file", "under a file"])
def test_a_bad_out_is_refused_before_training(capsys, monkeypatch, tmp_path, make):
    seen = []
    monkeypatch.setattr(cli, "train", lambda *a, **k: seen.append(k))
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" if make == "file" else tmp_path / "afile" / "run"
    code, err = refused(capsys, "train", *QUICK, "--out", str(out))
    assert code == 2 and not seen and str(out) in err and len(err.splitlines()) == 1
    assert "pick a folder" in err


def test_a_corpus_of_only_unk_is_one_line_naming_the_file(capsys, tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"ptb.{split}.txt").write_text("<unk> <unk>\n<unk>\n")
    code, err = refused(capsys, "train", *QUICK, "--data", str(tmp_path), "--out", str(tmp_path / "run"))
    assert code == 2 and len(err.splitlines()) == 1
    assert str(tmp_path / "ptb.train.txt") in err and "no words besides <unk>" in err


@pytest.mark.parametrize("args, words", [
    (["--placement", "embed,lstm0:vgpu:-1 | lstm1,decode:vgpu:1"], "device 'vgpu:-1' does not exist"),
    (["--placement", "x" * 10_000], "(10,000 characters)"),
    (["--placement", "embed,lstm0,lstm1,decode:vgpu" + "9" * 10_000], "characters) is not a device name"),
    (["--placement", "embed" * 2_000 + ":vgpu0"], "(10,000 characters) is not in the model"),
    (["--data", "README.md"], "README.md is a file, not a folder"),
    (["--memory-cap", "-5MB"], "memory size '-5MB' is not a size"),
    (["--lr", "-1e-3"], "expected a finite number > 0, got -1e-3"),
    (["--memory-cap", "vgpu:0=2MB,vgpu:0=4MB"], "gives vgpu:0 twice (2MB and 4MB)"),
    (["--memory-cap", "vgpu:0=2MB,vgpu0=4MB"], "gives vgpu:0 two caps"),
])
def test_bad_values_are_named_briefly(capsys, monkeypatch, tmp_path, args, words):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "train", lambda *a, **k: pytest.fail("trained"))
    code, err = refused(capsys, "train", *QUICK, *args, "--out", str(tmp_path))
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()[-1]) < 400, err   # the message, after argparse's usage lines


@pytest.mark.parametrize("args, words", [
    (["--micro-batches", "0"], "argument --micro-batches: expected a whole number >= 1, got 0"),
    (["--devices", "2", "--placement", "embed:vgpu0 | lstm0:vgpu1 | lstm1,decode:vgpu2"], "not allowed with"),
    (["--recompute", "some"], "choose none (keep activations"),
    (["--recompute", "0=all,0=none"], "gives stage 0 twice"),
])
def test_options_are_refused_in_the_command_lines_words(capsys, args, words):
    code, err = refused(capsys, "train", *QUICK, *args)
    assert code == 2 and words in err, err


def test_options_without_a_command_are_trains(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run_train", lambda args: seen.append(args) or 0)
    assert main(["--epochs", "1", "--devices", "1"]) == 0
    assert seen[0].command == "train" and seen[0].epochs == 1 and seen[0].devices == 1


def test_corpus_refuses_to_overwrite_a_users_files_without_force(capsys, tmp_path):
    (tmp_path / "ptb.train.txt").write_text("my own words\n")
    code, err = refused(capsys, "corpus", "--out", str(tmp_path))
    assert code == 2 and "already holds ptb.train.txt" in err and "--force" in err
    assert (tmp_path / "ptb.train.txt").read_text() == "my own words\n"
    code, err = refused(capsys, "corpus", "--out", str(tmp_path / "ptb.train.txt"))
    assert code == 2 and "is a file; give a folder" in err
    assert main(["corpus", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ptb.train.txt").read_text() != "my own words\n"


@pytest.mark.parametrize("case", ["none", "an earlier run's", "this run's", "resumed"])
def test_ctrl_c_says_whether_there_is_a_checkpoint_to_resume(capsys, monkeypatch, tmp_path, case):
    """--resume is offered for a checkpoint this run wrote or continued; an earlier run's, left as it was by a
    run started afresh, is named as that (--resume would continue the other run)."""
    if case in ("an earlier run's", "resumed"):
        (tmp_path / "checkpoint.pt").write_bytes(b"")     # only its presence (and its time) is read

    def interrupted(*args, **kwargs):
        if case == "this run's":
            (tmp_path / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "train", interrupted)
    code, err = refused(capsys, "train", *QUICK, "--devices", "1", "--out", str(tmp_path),
                        *(["--resume"] if case == "resumed" else []))
    assert code == 130
    expected = {"none": "nothing to resume", "an earlier run's": "is still the earlier run's (--resume would continue "
                "that one)", "this run's": "continue with --resume", "resumed": "continue with --resume"}[case]
    assert expected in err, err


def test_ctrl_c_after_training_says_the_files_are_written(capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "json_line", interrupted)
    code, err = refused(capsys, "train", *QUICK, "--devices", "1", "--out", str(tmp_path), "--json")
    assert code == 130 and "interrupted after training had finished" in err and "model.pt are written" in err
    assert (tmp_path / "model.pt").is_file()


def test_ctrl_c_before_training_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("mpedu.lm.data.load_corpus", interrupted)
    code, err = refused(capsys, "train", *QUICK, "--out", str(tmp_path))
    assert code == 130 and err.strip() == "mpedu: error: interrupted before training started"



# ---- recipes: each config trains as its paper did, in mpedu's learning-rate convention

def _train_kwargs(monkeypatch, capsys, *args):
    seen = []
    monkeypatch.setattr(cli, "train", lambda *a, **k: seen.append(k) or History())
    monkeypatch.setattr(cli, "build_runner", lambda model, args: cli.SingleDevice(model))
    code = main(["train", *args])
    out = capsys.readouterr().out
    assert code == 0
    return seen[0], out


def test_the_tiny_run_keeps_the_trainers_defaults_and_the_default_run_is_the_laptop_recipe(monkeypatch, capsys,
                                                                                            tmp_path):
    import inspect
    import importlib
    from mpedu.training import RECIPES
    training = importlib.import_module("mpedu.training.loop")   # the module (`mpedu.train` is the function)
    kwargs, out = _train_kwargs(monkeypatch, capsys, "--config", "tiny", "--out", str(tmp_path))
    defaults = inspect.signature(training.train).parameters
    assert (kwargs["lr"], kwargs["epochs"], kwargs["batch_size"], kwargs["clip"]) == (
        training.LR, defaults["epochs"].default, defaults["batch_size"].default, defaults["clip"].default)
    assert kwargs["bptt"] is None and kwargs["lr_decay"] is None
    assert "recipe 'tiny'" in out and "given" not in out.splitlines()[0]
    kwargs, out = _train_kwargs(monkeypatch, capsys, "--out", str(tmp_path / "laptop"))
    laptop = RECIPES["laptop"]
    assert (kwargs["lr"], kwargs["epochs"], kwargs["batch_size"], kwargs["clip"]) == (
        laptop.lr, laptop.epochs, laptop.batch_size, laptop.clip)
    assert kwargs["bptt"] is None and kwargs["lr_decay"] is None
    assert "recipe 'laptop'" in out and "given" not in out.splitlines()[0]


def test_small_follows_zaremba_in_mpedus_units_and_given_options_win(monkeypatch, capsys, tmp_path):
    from mpedu.training import RECIPES
    kwargs, out = _train_kwargs(monkeypatch, capsys, "--config", "small", "--out", str(tmp_path))
    small = RECIPES["small"]
    # Zaremba: lr 1 and clip 5 for a loss summed over T = 20 steps; batch 20, 13 epochs, / 2 after epoch 4
    assert kwargs["lr"] == 1 * small.bptt and kwargs["clip"] == 5 / small.bptt
    assert (kwargs["bptt"], kwargs["batch_size"], kwargs["epochs"], kwargs["lr_decay"]) == (20, 20, 13, (4, 2.0))
    assert "Zaremba et al. 2014, small" in out
    kwargs, out = _train_kwargs(monkeypatch, capsys, "--config", "small", "--lr", "5", "--bptt", "0",
                                "--out", str(tmp_path))
    assert kwargs["lr"] == 5 and kwargs["bptt"] is None and kwargs["epochs"] == 13
    assert "given: --lr 5, --bptt 0" in out


def test_the_help_explains_the_learning_rate_convention(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "mean NLL per token" in out and "lr 1 is about lr T here" in out and "Zaremba et al. 2014, small" in out


# ---------------------------------------------------------------- random argument lists

OPTIONS = ["--epochs", "--batch-size", "--lr", "--clip", "--seed", "--bptt", "--limit-batches", "--devices",
           "--placement", "--schedule", "--micro-batches", "--chunks", "--memory-cap", "--checkpoint-every",
           "--config", "--data", "--resume", "--skip-bad-batches", "--json", "--help", "-h", "--bogus"]


VALUES = ["0", "1", "2", "3", "-1", "4", "16", "1e400", "nan", "inf", "-inf", "2.5", "x", "", "tiny", "small",
          "gpipe", "1f1b", "zb1", "wavefront", "naive", "interleaved", "embed,lstm0:vgpu0 | lstm1,decode:vgpu1",
          "lstm0-99999999:vgpu0", "embed:vgpu0|lstm0,lstm1,decode:vgpu0", "2MB", "vgpu:0=1kB", "vgpu:9=1MB",
          "=3", "99999999999999999999", "/nonexistent"]


FLAGS = ["--resume", "--skip-bad-batches", "--json"]


tokens = st.lists(st.one_of(st.sampled_from(OPTIONS), st.sampled_from(VALUES), st.text(max_size=6)), max_size=7)


# option-value pairs reach past argparse more often: into the checks on the data, placement and schedule
pairs = st.lists(st.one_of(st.tuples(st.sampled_from([o for o in OPTIONS if o not in FLAGS + ["--help", "-h"]]),
                                     st.sampled_from(VALUES)), st.sampled_from(FLAGS).map(lambda f: (f,))),
                 max_size=4).map(lambda items: [word for item in items for word in item])


@given(st.one_of(tokens, pairs))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_argv_exits_0_or_2_with_a_message_never_a_traceback(capsys, monkeypatch, tmp_path, argv):
    # Training itself is stubbed: the fuzz covers parsing and building the runner, not training.
    seen = []
    monkeypatch.setattr(cli, "train", lambda *a, **k: seen.append(k) or History())
    assume("--out" not in argv)
    try:
        code = cli.main(["train", *argv, "--out", str(tmp_path / "out"), "--no-progress"])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err
    if code == 2:
        assert "error:" in err, (argv, err)


def test_under_torchrun_the_one_process_command_points_to_the_distributed_one(monkeypatch, capsys, tmp_path):
    # torchrun -m mpedu train: every process trained the whole model on its own, the second then failing on
    # the first's --out lock; now each says which command runs a pipeline across the processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["train", "--out", str(tmp_path), "--limit-batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 says 2 were started together" in err and "-m mpedu.distributed train" in err
    assert not any(tmp_path.iterdir())                                   # nothing written
    monkeypatch.setenv("WORLD_SIZE", "1")                                # one process: trains as ever
    assert cli.main(["train", "--config", "tiny", "--out", str(tmp_path), "--limit-batches", "1", "--epochs", "1",
                     "--no-progress"]) == 0


@pytest.mark.parametrize("args", [["train", "--out", "  ", "--epochs", "1"], ["corpus", "--out", ""]])
def test_an_empty_out_is_refused_instead_of_writing_into_the_current_folder(capsys, monkeypatch, tmp_path, args):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "argument --out: " in (err := capsys.readouterr().err)
    assert "names no folder; give one, e.g. runs/mine, or . for the current folder" in err
    assert list(tmp_path.iterdir()) == []


def test_a_hand_written_schedule_file_trains_on_threads_as_under_torchrun(capsys, tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("# 1F1B by hand\n0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    args = ["train", "--config", "tiny", "--epochs", "1", "--limit-batches", "2", "--batch-size", "16",
            "--no-baselines", "--no-progress", "--json", "--out", str(tmp_path / "run"), "--schedule", str(mine)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "schedule mine, 2 micro-batches" in out                # its counts come from the file
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["schedule"] == "mine" and summary["micro_batches"] == 2
    assert main(args + ["--micro-batches", "4"]) == 2               # a count given beside it must agree
    assert "micro-batch" in capsys.readouterr().err


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.txt", r"missing.txt: no such file, and no schedule has that name \(naive, gpipe"),
    (lambda d: d, "is a folder; give a file with one line of actions per device"),
    (lambda d: (d / "bin.txt", (d / "bin.txt").write_bytes(b"\xfd\x00\x01"))[0],
     r"bin.txt is not UTF-8 text \(byte 0xfd at offset 0\)"),
], ids=["missing", "a folder", "binary"])
def test_a_schedule_file_that_cannot_be_read_is_named_with_what_is_wrong(capsys, tmp_path, make, words):
    path = make(tmp_path)
    assert main(["train", "--config", "tiny", "--epochs", "1", "--limit-batches", "1", "--no-baselines",
                 "--schedule", str(path), "--out", str(tmp_path / "run")]) == 2
    assert re.search(words, capsys.readouterr().err)


def test_a_v_schedule_gets_the_v_placement_by_default_and_a_capped_one_its_cap(capsys, tmp_path):
    """--schedule zbv (or dualpipev) without --placement cuts the model into the V: device 0 holds embed and decode."""
    code, out, err = run(capsys, "train", *QUICK, "--schedule", "zbv", "--micro-batches", "4", "--out", str(tmp_path),
                         "--json")
    assert code == 0, err
    summary = last_json(out)
    assert summary["schedule"] == "zbv"
    groups = [g.strip() for g in summary["placement"].split("|")]
    assert len(groups) == 4 and groups[0].startswith("embed") and groups[-1].endswith("decode:vgpu0")
    assert groups[1].endswith(":vgpu1") and groups[2].endswith(":vgpu1")
    code, out, err = run(capsys, "train", *QUICK, "--schedule", "ZB-cap2", "--micro-batches", "4", "--out",
                         str(tmp_path), "--json")
    assert code == 0 and last_json(out)["schedule"] == "zb_cap2", err
    code, out, err = run(capsys, "train", *QUICK, "--schedule", "zbv", "--placement",
                         "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "--out", str(tmp_path))
    assert code != 0 and "zbv needs the V placement" in err


def test_micro_batches_of_unequal_size_from_the_command_line(capsys, tmp_path):
    code, out, err = run(capsys, "train", *QUICK, "--micro-batches", "2,6,6,2", "--out", str(tmp_path), "--json")
    assert code == 0, err
    assert "4 micro-batches of 2, 6, 6, 2 sentences" in out
    summary = last_json(out)
    assert summary["micro_batches"] == 4 and summary["micro_batch_sizes"] == [2, 6, 6, 2]
    code, out, err = run(capsys, "train", *QUICK, "--micro-batches", "2,6,6", "--out", str(tmp_path))
    assert code != 0 and "--micro-batches 2,6,6 adds up to 14 sentences, but --batch-size is 16" in err
    with pytest.raises(SystemExit):
        main(["train", *QUICK, "--micro-batches", "2,0"])
    assert "sentences per micro-batch such as 8,16,24,16 (whole numbers >= 1), got '2,0'" in capsys.readouterr().err
