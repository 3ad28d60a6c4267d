"""The prepared GPU check: mpedu on real CUDA GPUs in under five minutes, one line per step, JSON last.

    bash bench/gpu_check.sh                 # on a machine with one or more CUDA GPUs
    python bench/gpu_check.py --steps 3,4   # some steps only
    python bench/gpu_check.py --rehearse-on-cpu --steps 3,4,5,7 --batches 5   # the check's own logic, no GPU

Steps (issue 19): 1 torch sees CUDA (else stop, saying what to install); 2 the CUDA tests;
3 a mixed GPU/CPU placement, interleaved, against the CPU reference; 4 the race probe (a sleep on
the default stream before each optimizer step); 5 `python -m mpedu train` on GPUs against virtual
devices, with measured GPU memory beside the estimate; 6 torchrun's two processes on one GPU (and
on two); 7 mxnet8 on one GPU against two (GPipe and 1F1B, m = 8), and one GPU plus CPU devices.

Exit status: 0 every step that ran passed, 1 a step failed, 2 nothing checked (no CUDA GPU, or
packages mpedu needs are missing: step 1 says which).
Comparisons with the CPU run in plain fp32: TF32 is turned off in this process (steps 3-5, 7) and,
through NVIDIA_TF32_OVERRIDE=0, in the `python -m mpedu train` runs of step 5.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

STEPS = {1: "cuda", 2: "cuda tests", 3: "mixed placement", 4: "race probe", 5: "train", 6: "torchrun",
         7: "mxnet8 speed"}
BUDGET_S = 290                       # the whole check, so it ends within five minutes
INSTALL = ("install a CUDA build of torch that matches the driver (nvidia-smi shows the CUDA version it "
           "supports), e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126, and "
           "check that nvidia-smi lists a GPU and CUDA_VISIBLE_DEVICES does not hide it")
HIDDEN = ("check that nvidia-smi lists a GPU and that its driver supports CUDA {cuda} (else install a torch "
          "built for the driver's CUDA, see pytorch.org), and that CUDA_VISIBLE_DEVICES does not hide the GPUs")


class Check:
    """Where the check runs: real GPUs, or (rehearsal) virtual devices standing in for them."""

    def __init__(self, rehearse: bool, batches: int):
        self.rehearse = rehearse
        self.batches = batches
        self.gpus = 2 if rehearse else torch.cuda.device_count()
        self.deadline = time.monotonic() + BUDGET_S

    def gpu(self, k: int) -> str:
        """The name of GPU k; in a rehearsal, a virtual device no placement here uses otherwise."""
        return f"vgpu:{k + 4}" if self.rehearse else f"cuda:{k}"

    @property
    def cuda(self) -> bool:
        return not self.rehearse

    def left(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.deadline - time.monotonic()))

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# -- helpers --------------------------------------------------------------------------------------

def first_batch(batch_size: int = 16):
    """The first batch of the embedded corpus (it has padding), and the corpus's vocabulary size."""
    from mpedu.lm import BucketIterator
    from mpedu.lm import load_corpus
    corpus = load_corpus()
    return next(iter(BucketIterator(corpus.train, batch_size, seed=0))), len(corpus.vocab)


def reference(model, batch):
    """The whole model on the CPU: (loss, {name: grad}); the model is left unchanged."""
    from mpedu.lm import nll_sum
    ref = copy.deepcopy(model).cpu()
    loss = nll_sum(ref(batch.inputs)[0], batch.targets) / batch.tokens
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest absolute difference between two {name: tensor} maps, and where."""
    return max(((a[k].detach().cpu() - b[k].detach().cpu()).abs().max().item(), k) for k in a)


def close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> bool:
    return all(torch.allclose(a[k].detach().cpu(), b[k].detach().cpu(), rtol=rtol, atol=atol) for k in a)


def speedup_line(label: str, t_one: float, t_many: float, p: int, m: int) -> tuple[str, dict]:
    """Speedup of p devices over one and its efficiency against a GPipe-shaped ideal m*p/(m+p-1)."""
    speedup = t_one / t_many
    ideal = m * p / (m + p - 1)
    return (f"{label} {speedup:.2f}x (ideal {ideal:.2f}x, efficiency {speedup / ideal:.2f})",
            {"speedup": speedup, "ideal": ideal, "efficiency": speedup / ideal, "step_s": t_many})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)


def _tail(proc: subprocess.CompletedProcess, lines: int = 3) -> str:
    return " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


# -- the steps: each returns (passed, one line, data) ---------------------------------------------

NEEDED = ("numpy", "tqdm", "matplotlib", "pytest")     # mpedu's dependencies, and pytest for step 2


def step_cuda(check: Check):
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        return False, (f"{sys.executable} lacks {', '.join(missing)}: pip install {' '.join(missing)} "
                       "(or pip install -e . in the repository)"), {"missing": missing}
    if check.rehearse:
        return True, "rehearsal: virtual devices vgpu:4, vgpu:5 stand in for two GPUs", {"rehearsal": True}
    if not torch.cuda.is_available():
        if torch.version.cuda:
            advice = f"torch {torch.__version__} (a CUDA {torch.version.cuda} build) sees no CUDA GPU: " + \
                HIDDEN.format(cuda=torch.version.cuda)
        else:
            advice = f"torch {torch.__version__} (a CPU-only build) sees no CUDA GPU: {INSTALL}"
        return False, advice, {"cuda": False}
    names = [torch.cuda.get_device_name(k) for k in range(check.gpus)]
    torch.zeros(1, device="cuda:0")           # a context now, so later steps do not time its start
    return True, (f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
                  f"{check.gpus} GPU(s): {', '.join(names)}"), {"cuda": True, "gpus": names}


def step_tests(check: Check):
    files = ["tests/test_cuda.py", "tests/test_profile.py", "tests/test_memory.py", "tests/test_devices.py"]
    # -o addopts=: without the notebook options of pyproject.toml (nbval need not be installed)
    proc = _run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                 *files], timeout=check.left(150))
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return proc.returncode == 0, f"pytest -m cuda {' '.join(files)}: {summary}", {"returncode": proc.returncode}


def step_mixed(check: Check):
    from mpedu.lm import LSTMLM
    from mpedu.core import Pipeline
    batch, vocab = first_batch()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab, num_layers=3, dropout=0.0)
    ref_loss, ref_grads = reference(model, batch)
    placement = f"embed:{check.gpu(0)} | lstm0:vgpu:0 | lstm1:{check.gpu(0)} | lstm2,decode:vgpu:0"
    with Pipeline(model, placement, "interleaved", micro_batches=4) as pipe:
        results = []
        for _ in range(2):     # the second step reuses the streams and the cached plan
            model.zero_grad(set_to_none=True)
            loss = pipe.train_step(batch).loss
            grads = {n: p.grad for n, p in model.named_parameters()}
            results.append((loss, max_diff(grads, ref_grads), close(grads, ref_grads)))
    ok = all(abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and equal for loss, _, equal in results)
    loss, (worst, where), _ = results[-1]
    return ok, (f"'{placement}' interleaved m=4: loss {loss:.7f} vs CPU {ref_loss:.7f}, max |grad diff| "
                f"{worst:.1e} ({where})"), {"loss": loss, "cpu_loss": ref_loss, "max_grad_diff": worst}


def race_probe(check: Check, placement: str, ordered: bool = True, steps: int = 3, lr: float = 2.0):
    """Losses and final weights of `steps` clipped SGD steps, with a sleep queued on each GPU's
    default stream before each optimizer step. ordered=False runs the pipeline without its
    ordering of the workers' streams after the caller's (the defect), to show the probe bites.
    The sleep goes after the clip: with a CPU stage the clip copies the CPU norm to the GPU and
    waits for that stream, which would wait the sleep out before the step was even queued."""
    from mpedu.core import Pipeline
    from mpedu.runtime import streams
    from mpedu.lm import LSTMLM
    batch, vocab = first_batch()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab, num_layers=3, dropout=0.0)
    original = streams.after
    if not ordered:
        streams.after = lambda caller_stream, job: job
    try:
        with Pipeline(model, placement, "1f1b", micro_batches=4) as pipe:
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            gpus = [d.torch_device for d in pipe.devices if d.is_cuda]
            losses = []
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                losses.append(pipe.train_step(batch).loss)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                for gpu in gpus:
                    with torch.cuda.device(gpu):
                        torch.cuda._sleep(200_000_000)        # ~0.1 s of GPU time before the step
                optimizer.step()
            weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
    finally:
        streams.after = original
    return losses, weights


def cpu_sgd(steps: int = 3, lr: float = 2.0):
    from mpedu.lm import LSTMLM, nll_sum
    batch, vocab = first_batch()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab, num_layers=3, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nll_sum(model(batch.inputs)[0], batch.targets) / batch.tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def step_race(check: Check):
    placement = (f"embed,lstm0:{check.gpu(0)} | lstm1-2,decode:{check.gpu(1)}" if check.gpus >= 2 else
                 f"embed,lstm0,lstm1:{check.gpu(0)} | lstm2,decode:vgpu:0")
    ref_losses, ref_weights = cpu_sgd()
    losses, weights = race_probe(check, placement)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst, where = max_diff(weights, ref_weights)
    ok = loss_diff <= 1e-5 * max(ref_losses) and close(weights, ref_weights)
    line = (f"'{placement}', 3 SGD steps, sleep on the default stream before each: max |loss diff| {loss_diff:.1e}, "
            f"max |weight diff| {worst:.1e} ({where})")
    data = {"losses": losses, "cpu_losses": ref_losses, "max_loss_diff": loss_diff, "max_weight_diff": worst}
    if check.cuda:       # the control: without the ordering the same probe should differ
        bad, _ = race_probe(check, placement, ordered=False)
        control = max(abs(a - b) for a, b in zip(bad, ref_losses))
        line += f"; control without the ordering: max |loss diff| {control:.1e}"
        data["control_max_loss_diff"] = control
        if control <= 1e-5 * max(ref_losses):     # the probe did not bite: it proved nothing about the ordering
            ok = False
            line += " (INCONCLUSIVE: the control should differ)"
    return ok, line, data


def step_train(check: Check):
    from mpedu.predict import memory_report, measured_peak
    from mpedu.lm import LSTMLM
    from mpedu.core import Pipeline
    gpu = (f"embed,lstm0:{check.gpu(0)} | lstm1,decode:{check.gpu(1)}" if check.gpus >= 2 else
           f"embed,lstm0,lstm1,decode:{check.gpu(0)}")
    virtual = re.sub(r"(cuda|vgpu):(\d+)", lambda m: f"vgpu:{int(m.group(2)) % 4}", gpu)
    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for name, placement in (("gpu", gpu), ("virtual", virtual)):
            # NVIDIA_TF32_OVERRIDE=0: cuDNN and cuBLAS in plain fp32, as on the CPU
            proc = _run([sys.executable, "-m", "mpedu", "train", "--config", "tiny", "--placement", placement,
                         "--epochs", "1", "--no-baselines",
                         "--limit-batches", str(check.batches), "--json", "--no-progress", "--out",
                         str(Path(out) / name)], timeout=check.left(90), env={"NVIDIA_TF32_OVERRIDE": "0"})
            if proc.returncode != 0:
                return False, f"python -m mpedu train --placement '{placement}' failed: {_tail(proc)}", {}
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    rel = abs(runs["gpu"]["train_ppl"] / runs["virtual"]["train_ppl"] - 1)
    # measured memory beside the estimate: one step of the same run, in this process
    batch, vocab = first_batch()
    torch.manual_seed(0)
    model = LSTMLM.from_config("tiny", vocab)
    with Pipeline(model, gpu, "gpipe", micro_batches=4) as pipe:
        for d in pipe.devices:
            if d.is_cuda:
                torch.cuda.reset_peak_memory_stats(d.torch_device)
        timeline = pipe.train_step(batch).timeline
        report = memory_report(pipe, timeline)
    memory = {d.device: {"estimate": d.total, "measured": measured_peak(d.device)} for d in report.devices}
    shown = "; ".join(f"{name} estimate {v['estimate'] / 1e6:.2f} MB, measured peak "
                      + (f"{v['measured'] / 1e6:.2f} MB" if v["measured"] is not None else "- (virtual)")
                      for name, v in memory.items())
    # fp32 rounding that SGD amplifies over the steps: one device with 1 vs 2 threads ends an epoch
    # ~5e-4 apart at lr 20 (measured on a CPU), so allow ten times that
    return rel <= 5e-3, (f"{check.batches} batches on '{gpu}' vs '{virtual}': train ppl {runs['gpu']['train_ppl']:.3f} "
                         f"vs {runs['virtual']['train_ppl']:.3f} (rel {rel:.1e}, allowed 5e-3); {shown}"), \
        {"gpu": runs["gpu"], "virtual": runs["virtual"], "rel_ppl_diff": rel, "memory": memory}


def torchrun(check: Check, visible: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "mpedu.distributed", "check",
           "--schedule", "gpipe,1f1b", "--batch-size", "16", "--timeout", "60",
           "--placement", "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"]
    return _run(cmd, timeout=check.left(120), env={"CUDA_VISIBLE_DEVICES": visible, "OMP_NUM_THREADS": "1"})


def step_torchrun(check: Check):
    cases = [("one GPU", "" if check.rehearse else "0")]
    if check.gpus >= 2 and check.cuda:
        cases.append(("two GPUs", "0,1"))
    parts, data, ok = [], {}, True
    for label, visible in cases:
        proc = torchrun(check, visible)
        equal = proc.returncode == 0
        backend = "nccl" if "TF32 off" in proc.stdout else "gloo"
        ok &= equal and backend == ("nccl" if label == "two GPUs" else "gloo")
        parts.append(f"{label}: {backend}, {'equal' if equal else 'FAILED: ' + _tail(proc)}")
        data[label] = {"returncode": proc.returncode, "backend": backend}
    return ok, "torchrun --nproc-per-node 2 -m mpedu.distributed check: " + "; ".join(parts), data


def step_speed(check: Check, m: int = 8, repeats: int = 5):
    sys.path.insert(0, str(ROOT / "bench"))
    from common import random_batch

    from mpedu.lm import LSTMLM
    from mpedu.core import Pipeline
    if check.rehearse:        # the same steps on a model a CPU runs in seconds
        vocab, T, B = 1000, 10, 16
        model = LSTMLM.from_config("tiny", vocab, num_layers=8)
    else:
        vocab, T, B = 10_000, 35, 64
        model = LSTMLM.from_config("mxnet8", vocab)
    batch = random_batch(vocab, T, B)
    g0, g1 = check.gpu(0), check.gpu(1)
    runs = {"one GPU": (f"embed,lstm0-7,decode:{g0}", "gpipe")}
    if check.gpus >= 2:
        for schedule in ("gpipe", "1f1b"):
            runs[f"two GPUs {schedule}"] = (f"embed,lstm0-3:{g0} | lstm4-7,decode:{g1}", schedule)
    for schedule in ("gpipe", "1f1b"):    # the CPU takes the embedding, the lightest layer
        runs[f"GPU+CPU {schedule}"] = (f"embed:vgpu:0 | lstm0-7,decode:{g0}", schedule)
    times = {}
    for name, (placement, schedule) in runs.items():
        with Pipeline(model, placement, schedule, micro_batches=m) as pipe:
            samples = []
            for k in range(2 + repeats):          # two warm-up steps
                model.zero_grad(set_to_none=True)
                check.synchronize()
                start = time.perf_counter()
                pipe.train_step(batch)
                check.synchronize()
                if k >= 2:
                    samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    t1 = times["one GPU"]
    parts, data = [f"one GPU {t1 * 1e3:.1f} ms/step ({batch.tokens / t1:,.0f} tokens/s)"], {"one_gpu_step_s": t1}
    for name in runs:
        if name != "one GPU":
            text, numbers = speedup_line(name, t1, times[name], 2, m)
            parts.append(text)
            data[name] = numbers
    if check.gpus < 2:
        parts.append("two GPUs: not present")
    what = "rehearsal (a tiny 8-layer model)" if check.rehearse else "mxnet8"
    return True, f"{what} m={m}, B={B}, T={T}: " + "; ".join(parts), data


RUNNERS = {1: step_cuda, 2: step_tests, 3: step_mixed, 4: step_race, 5: step_train, 6: step_torchrun, 7: step_speed}


# -- the run --------------------------------------------------------------------------------------

def run_step(fn, check: Check, timeout: float):
    """(passed, line, data) of fn(check), or a failure with the error; None when it outlived `timeout`."""
    box = {}

    def target():
        try:
            box["result"] = fn(check)
        except subprocess.TimeoutExpired as e:
            box["result"] = (False, f"timed out after {e.timeout:.0f} s: {' '.join(map(str, e.cmd))[:120]}", {})
        except Exception as e:     # a step's error is its result; the others still run
            box["result"] = (False, f"{type(e).__name__}: {e}", {"error": repr(e)})

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return box.get("result")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1-7", help="which steps, e.g. 1-7 or 1,3,4 (step 1 always runs)")
    parser.add_argument("--batches", type=int, default=50, help="batches of the train runs in step 5 (default 50)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="virtual devices stand in for two GPUs: checks this script's own logic anywhere")
    args = parser.parse_args(argv)
    wanted = {1} | parse_steps(args.steps)
    check = Check(args.rehearse_on_cpu, args.batches)
    if check.cuda:
        # the comparisons with the CPU claim fp32 rounding: no TF32 in this process
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    summary = {"ok": True, "rehearsal": check.rehearse, "torch": torch.__version__, "steps": {}}
    code = 0
    for k, name in STEPS.items():
        if k not in wanted:
            continue
        started = time.monotonic()
        result = run_step(RUNNERS[k], check, check.left(200))
        seconds = time.monotonic() - started
        if result is None:
            print(f"[{k}/7] {name}: FAIL timed out after {seconds:.0f} s; later steps not run", flush=True)
            summary["steps"][name] = {"passed": False, "seconds": seconds, "line": "timed out"}
            summary["ok"] = False
            print(json.dumps(summary), flush=True)
            os._exit(1)              # a stuck worker thread must not keep the process alive
        passed, line, data = result
        print(f"[{k}/7] {name}: {'PASS' if passed else 'FAIL'} {line} ({seconds:.1f} s)", flush=True)
        summary["steps"][name] = {"passed": passed, "seconds": round(seconds, 2), "line": line, **data}
        summary["ok"] &= passed
        if k == 1 and not passed:
            summary["cuda"] = data.get("cuda", torch.cuda.is_available())
            code = 2
            break
    else:
        code = 0 if summary["ok"] else 1
    print(json.dumps(summary), flush=True)
    return code


def parse_steps(text: str) -> set[int]:
    """"1-7", "3,4", "2-4,7" -> step numbers; an unknown step is an error that lists the steps."""
    steps = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            steps |= set(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"gpu_check: --steps {text!r}: expected numbers such as 1-7 or 3,4") from None
    unknown = sorted(steps - set(STEPS))
    if unknown:
        raise SystemExit(f"gpu_check: no step {unknown[0]}; the steps are "
                         + ", ".join(f"{k} {name}" for k, name in STEPS.items()))
    return steps


if __name__ == "__main__":
    sys.exit(main())
