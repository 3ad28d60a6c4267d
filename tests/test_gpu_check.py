"""bench/gpu_check.py, the prepared GPU check: its answer without a GPU, and its steps rehearsed on CPU."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_GPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}   # no GPU, on any machine


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_stops_at_step_one_and_says_what_to_install():
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=NO_GPU_ENV,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 2 and lines[0].startswith("[1/7] cuda: FAIL torch ")
    assert "sees no CUDA GPU" in lines[0] and "nvidia-smi" in lines[0]     # and what to install or check
    summary = json.loads(lines[-1])
    assert summary["ok"] is False and summary["cuda"] is False and list(summary["steps"]) == ["cuda"]
    assert "Traceback" not in proc.stderr


def test_steps_are_chosen_by_number():
    check = load_check()
    assert check.parse_steps("1-7") == set(range(1, 8))
    assert check.parse_steps("2-4, 7") == {2, 3, 4, 7}
    with pytest.raises(SystemExit, match="no step 9; the steps are 1 cuda, 2 cuda tests"):
        check.parse_steps("9")
    with pytest.raises(SystemExit, match="expected numbers such as 1-7"):
        check.parse_steps("all")


def test_speedup_is_measured_against_the_pipeline_ideal():
    text, numbers = load_check().speedup_line("two GPUs gpipe", 0.9, 0.5, p=2, m=8)
    assert numbers["speedup"] == pytest.approx(1.8) and numbers["ideal"] == pytest.approx(16 / 9)
    assert numbers["efficiency"] == pytest.approx(1.8 * 9 / 16)
    assert text == "two GPUs gpipe 1.80x (ideal 1.78x, efficiency 1.01)"


def test_the_steps_rehearsed_on_virtual_devices_pass():
    """Virtual devices stand in for two GPUs: the check's placements, comparisons and summary run here."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--rehearse-on-cpu",
                           "--steps", "3,4,7"], cwd=ROOT, env=NO_GPU_ENV, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line[:6] for line in lines[:-1]] == ["[1/7] ", "[3/7] ", "[4/7] ", "[7/7] "]
    assert all(" PASS " in line for line in lines[:-1]), lines
    summary = json.loads(lines[-1])
    assert summary["ok"] and summary["rehearsal"]
    assert summary["steps"]["race probe"]["max_loss_diff"] < 1e-4
    assert {"two GPUs gpipe", "two GPUs 1f1b", "GPU+CPU gpipe", "GPU+CPU 1f1b"} <= set(summary["steps"]["mxnet8 speed"])
