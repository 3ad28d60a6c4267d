"""The command line of `torchrun ... -m mpedu.distributed {train,check}` (options shared with `python -m mpedu`)."""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from ..cli.options import (add_training_options, count, folder, join_dash_values, non_negative_float, positive_int,
                           shorten)
from ..lm.model import CONFIGS
from ..training.recipes import TORCHRUN_CONFIG
from .group import TIMEOUT, stop_heartbeat
from .heartbeat import LIMIT as HEARTBEAT

EXAMPLES = """\
examples (one machine, processes on the CPU; gloo):
  torchrun --nproc-per-node 2 -m mpedu.distributed train --limit-batches 20 --epochs 1
  torchrun --nproc-per-node 2 -m mpedu.distributed train --schedule 1f1b --micro-batches 8
  torchrun --nproc-per-node 2 -m mpedu.distributed train --schedule zbv   # the V: rank r, stages r and 2p-1-r
  torchrun --nproc-per-node 2 -m mpedu.distributed train --placement "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"
  torchrun --nproc-per-node 2 -m mpedu.distributed check --schedule gpipe,1f1b,my_schedule.txt
  torchrun --nproc-per-node 4 -m mpedu.distributed train --pipeline-devices 2   # 2 replicas x 2 stages
  torchrun --nproc-per-node 4 -m mpedu.distributed check --pipeline-devices 2
two nodes with 4 GPUs each (NCCL), run on both nodes:
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id lm \\
      -m mpedu.distributed train --config mxnet8 --data path/to/ptb --pipeline-devices 4
"""

PLACEMENT_HELP = ("layers to devices, e.g. \"embed,lstm0:vgpu0 | lstm1,decode:vgpu1\". Device names are labels: "
                  "the k-th distinct device (in order of first appearance) is pipeline rank k, so the placement "
                  "must name exactly as many devices as a pipeline has ranks; two groups on one device are two "
                  "stages (the V: \"embed:a | lstm0:b | lstm1:b | decode:a\"). Default: the layers split evenly "
                  "over them, or for zbv and dualpipev the V, rank r holding stages r and 2p-1-r")

SCHEDULE_HELP = ("a schedule name (naive, gpipe, 1f1b, interleaved, zb1, zbv, dualpipev; mpedu.core.schedules "
                 "builds its action lists) or a file with one line of actions per device, e.g. '0F0 0F1 0B0 0B1' and "
                 "'1F0 1B0 1F1 1B1': mpedu validates it and torch's runtime plays it as written")


# `python -m mpedu train` options a torchrun job does not take, and why
NOT_OFFERED = {
    "--bptt": "stream mode carries each sequence's LSTM state into the next batch, and a stage's state cannot "
              "travel between ranks",
    "--chunks": "a wavefront's time chunks hand their LSTM state on from chunk to chunk, which cannot travel "
                "between ranks",
    "--recompute": "activation recomputation runs in mpedu's own threads only (python -m mpedu train --recompute)",
    "--memory-cap": "memory caps are checked by mpedu's own pipeline only (python -m mpedu train --memory-cap)",
    "--link": "the ranks talk over a real link; an emulated one is for virtual devices (python -m mpedu train)",
    "--resume": "a torchrun job writes no checkpoint, only model.pt at its end",
    "--checkpoint-every": "a torchrun job writes no checkpoint, only model.pt at its end",
}


class _NotOffered(argparse.Action):
    """An option of `python -m mpedu train` that a torchrun job refuses, saying why."""

    def __init__(self, *args, why: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not offered under torchrun: {self.why}")


def _add_pipeline_options(parser, schedule_help: str) -> None:
    group = parser.add_argument_group("pipeline (one process per device) and data parallelism")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--devices", type=positive_int, metavar="N",
                       help="split the layers evenly over N pipeline devices = N processes per pipeline; must "
                            "equal --pipeline-devices (default: all processes form one pipeline)")
    where.add_argument("--placement", metavar="STR", help=PLACEMENT_HELP)
    group.add_argument("--pipeline-devices", type=positive_int, metavar="P",
                       help="processes per pipeline; torchrun's N processes then run N / P replicas of the "
                            "pipeline, each on its share of every batch, with gradients all-reduced across "
                            "replicas (default: N, one pipeline, no data parallelism)")
    group.add_argument("--schedule", default="gpipe", help=schedule_help)
    group.add_argument("--runtime", choices=["mpedu", "torch"], default="mpedu",
                       help="mpedu: mpedu's action lists played by torch's pipeline-order runtime (any schedule, "
                            "the same as the threads and the simulator); torch: PyTorch's own schedule class "
                            "for the name, to compare (default: mpedu)")
    group.add_argument("--micro-batches", type=positive_int, default=4, metavar="M",
                       help="micro-batches per batch and replica (default: 4); train needs a batch size that is a "
                            "multiple of replicas x M (check pads its one batch to that)")
    group.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                       help="auto: NCCL on cuda:LOCAL_RANK when every process on the node has a GPU of its "
                            "own, else gloo on the CPU for all")
    group.add_argument("--timeout", type=_at_least(10, "setting up the ranks alone can take that long"),
                       default=TIMEOUT, metavar="S",
                       help=f"seconds a rank waits for a busy peer before failing (default: {TIMEOUT}); with "
                            "torchrun, a failing rank also makes torchrun stop the others at once")
    group.add_argument("--heartbeat", type=_at_least(1, "a shorter silence is a busy machine's scheduling, not a "
                                                      "rank gone", zero_ok=True), default=HEARTBEAT, metavar="S",
                       help=f"a peer that gives no sign of life (stopped, hung, its machine gone) for S seconds "
                            f"ends every rank with a line naming it; 0: no watchdog (default: {HEARTBEAT:g})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m mpedu.distributed",
        description="mpedu's model, placement and schedule on torch.distributed.pipelining, one process per "
                    "device, optionally several replicas of the pipeline (data parallel x pipeline). Shapes "
                    "must be static there: one schedule is built (and cached) per bucket length.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,check}")

    t = commands.add_parser("train", help="train the language model, like `python -m mpedu train`",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Train; rank 0 prints one line per epoch and writes model.pt and the "
                                        "last step's timeline (every rank: last_step.png, last_step.json, "
                                        "last_step.timeline.json) in --out. Not offered: --bptt (state cannot "
                                        "cross ranks), --chunks, --recompute, --memory-cap, --link (the ranks' "
                                        "link is real), --resume and --checkpoint-every (no checkpoints: model.pt "
                                        "is written at the end).")
    add_training_options(t, clip_over="all ranks' gradients", resume=False, config=TORCHRUN_CONFIG)
    for option, why in NOT_OFFERED.items():        # said in plain words, not argparse's "unrecognized arguments"
        # default SUPPRESS: no attribute at all unless given (apply_recipe reads a missing --bptt as "no stream")
        t.add_argument(option, nargs="?", action=_NotOffered, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                       why=why)
    t.add_argument("--out", type=folder, default="runs/distributed", metavar="DIR",
                   help="where rank 0 writes model.pt and the timeline (default: runs/distributed)")
    t.add_argument("--limit-batches", type=positive_int, metavar="N",
                   help="use only the first N batches of each split per epoch: a quick run")
    t.add_argument("--json", action="store_true", help="rank 0 prints a JSON summary as the last line")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (rank 0, stderr)")
    _add_pipeline_options(t, SCHEDULE_HELP + " (default: gpipe)")

    c = commands.add_parser("check", help="one step: are loss and gradients those of one process?",
                            description="Run one training step on one batch of the corpus and compare loss "
                                        "and every gradient with the whole model in one process (dropout "
                                        "masks are positional, so --dropout P is compared too). Exits 0 only "
                                        "when every schedule gives the one-process numbers. With --out, "
                                        "every rank writes its gradients there.")
    c.add_argument("--data", metavar="DIR", help="corpus folder (default: the embedded corpus)")
    c.add_argument("--config", choices=list(CONFIGS), default=TORCHRUN_CONFIG)
    c.add_argument("--batch-size", type=positive_int, default=16, metavar="B")
    c.add_argument("--seed", type=count, default=0)
    c.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability of the model (default: 0); the masks are positional, so any P "
                        "gives the one-process numbers")
    c.add_argument("--out", type=folder, metavar="DIR",
                   help="write grads-<schedule>-rank<r>.pt, check.json, the timelines and the inputs (check-init.pt, "
                   "check-batch.pt) here")
    _add_pipeline_options(c, "one or more, comma-separated: " + SCHEDULE_HELP + " (default: gpipe)")
    return parser


def pipeline_devices(args, world: int) -> int:
    """Processes per pipeline from --pipeline-devices and --devices (which must agree), else the world."""
    p = args.pipeline_devices or args.devices or world
    if args.devices is not None and args.devices != p:
        raise ValueError(f"--devices {args.devices} but --pipeline-devices {p}: a pipeline has one process per "
                         "device, so give one of them (or the same number)")
    if args.pipeline_devices is None and args.devices is not None and args.devices != world:
        raise ValueError(f"--devices {args.devices} but torchrun started {world} processes: one process per "
                         f"device, so pass --nproc-per-node {args.devices} (or drop --devices), or add "
                         f"--pipeline-devices {args.devices} to run {world} / {args.devices} replicas")
    return p


# what gloo's RuntimeErrors (not DistErrors) say when a peer has gone or stopped answering
_PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe")


def _at_least(least: float, what: str, zero_ok: bool = False):
    """An argparse type: seconds, at least `least` (or 0 when `zero_ok`)."""
    def parse(text: str) -> float:
        value = non_negative_float(text)
        if value < least and not (zero_ok and value == 0):
            raise argparse.ArgumentTypeError(f"expected at least {least:g} seconds{' (or 0: off)' if zero_ok else ''}"
                                             f", got {text}: {what}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_dash_values(parser, list(sys.argv[1:] if argv is None else argv)))
    if "RANK" not in os.environ:
        print(f"mpedu.distributed: error: start it with torchrun, one process per device, e.g.\n"
              f"  torchrun --nproc-per-node 2 -m mpedu.distributed {args.command}\n"
              "(for the in-process pipeline on virtual devices, use `python -m mpedu train`)", file=sys.stderr)
        return 2
    from .commands import run_check, run_train
    try:
        return run_check(args) if args.command == "check" else run_train(args)
    except ValueError as e:   # a placement, schedule or size the pipeline cannot run: every rank says why
        print(f"mpedu.distributed: error (rank {os.environ.get('RANK', '?')}): {shorten(str(e), 2000)}", file=sys.stderr)
        return 2
    except FloatingPointError as e:   # NumericFault: the step, the layer, its stage
        print(f"mpedu.distributed: error (rank {os.environ.get('RANK', '?')}): {shorten(str(e), 2000)}", file=sys.stderr)
        return 1
    except (dist.DistError, RuntimeError) as e:   # a peer failed or timed out: one line, not the backend's traceback
        if not isinstance(e, dist.DistError) and not any(sign in str(e) for sign in _PEER_FAILED):
            raise
        first = (str(e).splitlines() or [""])[0][:300]
        print(f"mpedu.distributed: error (rank {os.environ.get('RANK', '?')}): talking to the other ranks failed "
              f"({e.__class__.__name__}: {first}); see the other ranks' messages for the cause (a rank that says "
              "nothing may be stopped, e.g. by Ctrl-Z or a debugger, or gone: killed, or out of memory)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mpedu.distributed: rank {os.environ.get('RANK', '?')} interrupted; nothing was saved (a run under "
              "torchrun writes model.pt only at its end)", file=sys.stderr)
        return 130
    finally:
        stop_heartbeat()
