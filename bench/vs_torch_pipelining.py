"""mpedu's in-process pipeline (2 virtual devices) vs torch.distributed.pipelining (2 gloo processes).

    python bench/vs_torch_pipelining.py [--repeats 5] [--schedules gpipe,1f1b,zb1]

Same model, same placement, schedule and micro-batches on both
sides, one core per stage: mpedu's virtual devices are threads running torch
single-threaded, and each gloo rank is a process with torch.set_num_threads(1).
The torch side runs under torchrun through mpedu.distributed with timeline
recording off (one all_gather of the loss per step remains); its bubble comes from
one extra recorded step. Same schedule: by default (--runtime mpedu) torch's
pipeline-order runtime plays mpedu's own action lists, the ones the threads play;
--runtime torch times PyTorch's own class for the name instead. Run alone: other
work on the cores shows up in both.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import finish, machine, median_time, random_batch  # noqa: E402

from mpedu.lm import LMConfig, LSTMLM  # noqa: E402

VOCAB, T, B, M = 2000, 35, 64, 8
CONFIG = LMConfig(embed_size=256, hidden_size=256, num_layers=3)
# Measured per micro-batch (forward + backward, one core): embed 0.7 ms, each LSTM layer 11-15 ms,
# decode 11 ms; so embed + 2 LSTM layers | 1 LSTM layer + decode is close to even.
PLACEMENT = "embed,lstm0-1:vgpu0 | lstm2,decode:vgpu1"


def model() -> LSTMLM:
    torch.manual_seed(0)
    return LSTMLM(VOCAB, CONFIG)


def worker(args) -> None:
    """One gloo rank (started by torchrun): time train_step for each schedule, rank 0 writes the result."""
    import torch.distributed as dist

    from mpedu.distributed import DistributedPipeline, setup
    torch.set_num_threads(1)                 # one core per stage, like a virtual device
    rank, _, device = setup("gloo")
    net, batch = model(), random_batch(VOCAB, T, B)
    results = {}
    for schedule in args.schedules.split(","):
        pipe = DistributedPipeline(net, args.placement, schedule, M, device=device, record=False,
                                   runtime=args.runtime)

        def step():
            net.zero_grad(set_to_none=True)
            return pipe.train_step(batch)

        seconds = median_time(step, args.repeats)
        pipe.recorder.enabled = True
        result = step()
        results[schedule] = {"step_s": seconds, "loss": result.loss, "bubble": result.timeline.bubble_fraction,
                             "torch_schedule": pipe.torch_schedule}
        pipe.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def in_process(schedule: str, placement: str, repeats: int) -> dict:
    from mpedu.core import Pipeline
    torch.set_num_threads(1)
    net, batch = model(), random_batch(VOCAB, T, B)
    with Pipeline(net, placement, schedule, M) as pipe:
        def step():
            net.zero_grad(set_to_none=True)
            return pipe.train_step(batch)
        seconds = median_time(step, repeats)
        result = step()
    return {"step_s": seconds, "loss": result.loss, "bubble": result.timeline.bubble_fraction}


def with_torch(schedules: str, placement: str, repeats: int, runtime: str = "mpedu") -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), str(Path(__file__).resolve()),
               "--worker", "--schedules", schedules, "--placement", placement, "--repeats", str(repeats),
               "--result", str(out), "--runtime", runtime]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the torchrun workers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--schedules", default="gpipe,1f1b,zb1", help="comma-separated (default: gpipe,1f1b,zb1)")
    parser.add_argument("--placement", default=PLACEMENT, help=f"default: {PLACEMENT!r}")
    parser.add_argument("--runtime", choices=["mpedu", "torch"], default="mpedu",
                        help="torch side: mpedu's action lists in torch's runtime (default), or torch's own class")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    schedules = args.schedules.split(",")
    mpedu = {s: in_process(s, args.placement, args.repeats) for s in schedules}
    theirs = with_torch(args.schedules, args.placement, args.repeats, args.runtime)
    tokens = random_batch(VOCAB, T, B).tokens
    print(f"model: embed {CONFIG.embed_size}, {CONFIG.num_layers} LSTM layers of {CONFIG.hidden_size}, "
          f"vocab {VOCAB}; batch T={T} B={B}, {M} micro-batches; placement {args.placement}")
    print("mpedu: 2 virtual devices (threads) in one process; torch: 2 gloo processes under torchrun; "
          "one core per stage on both sides")
    print(f"{'schedule':<10}{'engine':<40}{'step (ms)':>10}{'tokens/s':>10}{'bubble':>8}{'loss':>10}")
    rows = {}
    for s in schedules:
        ours, torch_side = mpedu[s], theirs[s]
        for name, r in (("mpedu Pipeline (threads)", ours),
                        (f"torch {torch_side['torch_schedule']} (gloo)", torch_side)):
            print(f"{s:<10}{name:<40}{r['step_s'] * 1e3:>10.1f}{tokens / r['step_s']:>10.0f}"
                  f"{r['bubble']:>8.1%}{r['loss']:>10.5f}")
        ratio = ours["step_s"] / torch_side["step_s"]
        print(f"{'':<10}torch / mpedu tokens/s: {ratio:.2f}")
        rows[s] = {"torch_schedule": torch_side["torch_schedule"],
                   "tokens_per_s_mpedu": tokens / ours["step_s"], "tokens_per_s_torch": tokens / torch_side["step_s"],
                   "torch_over_mpedu": ratio, "bubble_mpedu": ours["bubble"], "bubble_torch": torch_side["bubble"],
                   "loss_mpedu": ours["loss"], "loss_torch": torch_side["loss"]}
    finish("vs_torch_pipelining", {"benchmark": "vs_torch_pipelining", "placement": args.placement,
                                   "runtime": args.runtime,
                                   "micro_batches": M, "T": T, "B": B, "tokens": tokens, "schedules": rows,
                                   "machine": machine()})


if __name__ == "__main__":
    main()
