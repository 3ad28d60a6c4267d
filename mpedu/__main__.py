"""The command line: `python -m mpedu train` trains the language model, `python -m mpedu corpus` writes the corpus."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .model import CONFIGS
from .train import BATCH_SIZE, CHECKPOINT_EVERY, CLIP, CONFIG, EPOCHS, LR, SingleDevice, train

EXAMPLES = """\
examples:
  python -m mpedu train                           # tiny model, embedded corpus, 2 virtual devices, GPipe
  python -m mpedu train --devices 1               # the single-device reference run
  python -m mpedu train --placement "embed,lstm0:vgpu0 | lstm1,decode:vgpu1" --schedule 1f1b
  python -m mpedu train --data path/to/ptb --config small --epochs 13
  python -m mpedu train --resume                  # continue runs/latest/checkpoint.pt
  python -m mpedu train --memory-cap 2MB          # refuse a placement that needs more per device
"""


def _whole(text: str, minimum: int, maximum: int = 2**63) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not minimum <= value < maximum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}"
                                         + (f" and < {maximum}" if maximum < 2**63 else "") + f", got {text}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _count(text: str) -> int:
    return _whole(text, 0)


def _number(text: str, minimum: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {minimum:g}, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _number(text, 0.0, strict=True)


def _non_negative_float(text: str) -> float:
    return _number(text, 0.0, strict=False)


def _memory_cap(text: str):
    """'2MB' for every device, or 'vgpu:0=2MB,vgpu:1=4MB' per device; sizes checked by parse_size."""
    from .devices import parse_size
    try:
        if "=" not in text:
            parse_size(text)
            return text
        caps = {}
        for item in text.split(","):
            device, _, size = item.partition("=")
            if not device.strip():
                raise ValueError(f"{item!r} names no device; write DEVICE=SIZE, e.g. vgpu:0=2MB")
            parse_size(size)
            caps[device.strip()] = size
        return caps
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_training_options(parser: argparse.ArgumentParser, clip_over: str) -> None:
    """The options every `train` command takes (here and under torchrun), with the same checks."""
    parser.add_argument("--data", metavar="DIR", help="folder with ptb.train.txt, ptb.valid.txt and ptb.test.txt "
                        "(default: the embedded synthetic corpus)")
    parser.add_argument("--config", choices=list(CONFIGS), default=CONFIG, help=f"model size (default: {CONFIG})")
    parser.add_argument("--epochs", type=_positive_int, default=EPOCHS, help=f"default: {EPOCHS}")
    parser.add_argument("--batch-size", type=_positive_int, default=BATCH_SIZE, metavar="B",
                        help=f"sentences per batch (default: {BATCH_SIZE})")
    parser.add_argument("--lr", type=_positive_float, default=LR,
                        help=f"SGD learning rate, halved when validation perplexity gains < 1 (default: {LR:g})")
    parser.add_argument("--clip", type=_non_negative_float, default=CLIP,
                        help=f"norm clip over {clip_over}, 0 for none (default: {CLIP})")
    parser.add_argument("--seed", type=_count, default=0,
                        help="seeds initialisation, dropout and data order (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpedu", description="Model-parallel (pipeline) training of a stacked LSTM language model. "
        "With no command, runs `train` with its defaults.")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="{train,corpus}")

    t = commands.add_parser("train", help="train the language model (default: 2 virtual devices, GPipe)",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Train, print one line per epoch, save checkpoint.pt and model.pt in --out.")
    add_training_options(t, clip_over="the gradients")
    t.add_argument("--bptt", type=_positive_int, metavar="T",
                   help="stream mode: cut the text into T-step chunks and carry the LSTM state across batches")
    t.add_argument("--out", default="runs/latest", metavar="DIR",
                   help="where checkpoint.pt and model.pt go (default: runs/latest)")
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt, mid-epoch if need be "
                   "(on any placement or device count)")
    t.add_argument("--checkpoint-every", type=_count, default=CHECKPOINT_EVERY, metavar="N",
                   help=f"write DIR/checkpoint.pt every N batches, and at each epoch end; 0: only at epoch "
                        f"ends (default: {CHECKPOINT_EVERY})")
    t.add_argument("--skip-bad-batches", action="store_true",
                   help="skip a batch whose loss or gradient is NaN or inf (counted in the summary) instead "
                        "of stopping")
    t.add_argument("--limit-batches", type=_positive_int, metavar="N",
                   help="use only the first N batches of each split per epoch: a quick smoke test, "
                        "whose perplexities describe those batches only")
    t.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    t.add_argument("--no-progress", action="store_true", help="no progress bars (they go to stderr)")
    pipe = t.add_argument_group("pipeline")
    where = pipe.add_mutually_exclusive_group()
    where.add_argument("--devices", type=_positive_int, default=2, metavar="N",
                       help="split the layers evenly over N devices (vgpu:0.. on CPU); 1 = the single-device "
                            "reference runner (default: 2)")
    where.add_argument("--placement", metavar="STR",
                       help='layers to devices, e.g. "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"')
    pipe.add_argument("--schedule", default="gpipe",
                      help="pipeline schedule: naive, gpipe, 1f1b, interleaved, zb1, wavefront (default: gpipe)")
    pipe.add_argument("--micro-batches", type=int, default=4, metavar="M",   # checked by the schedule: exit 2
                      help="micro-batches per batch, at most --batch-size (default: 4)")
    pipe.add_argument("--chunks", type=_positive_int, default=1, metavar="C",
                      help="time chunks per sequence, for --schedule wavefront (default: 1)")
    pipe.add_argument("--memory-cap", type=_memory_cap, metavar="SIZE",
                      help="memory each device may use, e.g. 2MB, or per device: vgpu:0=2MB,vgpu:1=4MB; a "
                           "placement that needs more stops before the first step and names one that fits")

    c = commands.add_parser("corpus", help="write the embedded corpus as ptb.{train,valid,test}.txt",
                            description="Write the embedded synthetic corpus in PTB format (one sentence per line).")
    c.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    c.add_argument("--seed", type=int, default=0, help="which made-up language (default: 0)")
    return parser


def _error(message: str, code: int = 2) -> int:
    print(f"mpedu: error: {message}", file=sys.stderr)
    return code


def build_runner(model, args):
    """SingleDevice for `--devices 1` without a placement; otherwise a Pipeline."""
    if args.placement is None and args.devices == 1:
        if args.memory_cap is not None:
            raise ValueError("--memory-cap applies to pipeline devices; use --devices 2 or more, or a "
                             "--placement (one device: --placement 'embed,...,decode:vgpu0')")
        return SingleDevice(model)
    from .devices import get_devices
    from .pipeline import Pipeline
    from .placement import Placement
    if args.placement is not None:
        placement = Placement.parse(args.placement, model)
    else:
        placement = Placement.even(model, get_devices(args.devices))
    return Pipeline(model, placement, schedule=args.schedule, micro_batches=args.micro_batches, chunks=args.chunks,
                    memory_cap=args.memory_cap)


def run_train(args) -> int:
    from .data import load_corpus
    from .model import LSTMLM
    try:
        corpus = load_corpus(args.data)
    except ValueError as e:  # CorpusError: names the folder and the missing or bad file
        return _error(str(e))
    except OSError as e:     # unreadable (permissions, a folder where a file should be)
        return _error(f"cannot read the corpus in {args.data}: {e.strerror or e} ({e.filename or args.data})")
    # Settings a schedule cannot meet are refused before one is built (a schedule with a
    # billion micro-batches or chunks would take that long to write down).
    if args.micro_batches > args.batch_size:
        return _error(f"--micro-batches {args.micro_batches} is more than --batch-size {args.batch_size}: each "
                      f"micro-batch needs at least one sentence; use at most {args.batch_size}")
    longest = args.bptt or max(len(s) for s in corpus.train)
    if args.chunks > longest:
        return _error(f"--chunks {args.chunks} is more than the {longest} time steps of the longest "
                      f"{'window (--bptt)' if args.bptt else 'training sentence'}; use fewer chunks")
    torch.manual_seed(args.seed)
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab))
    try:
        runner = build_runner(model, args)
    except ValueError as e:  # bad placement, schedule, micro-batch count or memory cap
        return _error(str(e))
    pipelined = not isinstance(runner, SingleDevice)
    if not pipelined and (args.schedule != "gpipe" or args.micro_batches != 4):
        print("note: --schedule and --micro-batches apply to a pipeline; --devices 1 runs the single-device model")
    where = (f"pipeline {runner.placement}, schedule {runner.schedule.name}, {runner.micro_batches} micro-batches"
             if pipelined else "single device (cpu)")
    print(f"mpedu train: {args.config} model on {corpus.name} ({len(corpus.vocab):,} words, "
          f"{corpus.tokens('train'):,} training tokens); {where}")
    try:
        history = train(
            model, corpus, runner=runner, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            clip=args.clip or None, seed=args.seed, out=args.out, resume=args.resume, bptt=args.bptt,
            checkpoint_every=args.checkpoint_every, limit_batches=args.limit_batches,
            skip_bad_batches=args.skip_bad_batches, progress=not args.no_progress and sys.stderr.isatty())
    except ValueError as e:  # CheckpointError, MemoryCapError, or a setting the data cannot meet
        return _error(str(e))
    except FloatingPointError as e:  # NumericFault: names the step, the layer, its stage and device
        return _error(str(e), code=1)
    except OSError as e:
        return _error(f"cannot write to --out {args.out}: {e.strerror or e} ({e.filename or args.out})")
    except KeyboardInterrupt:
        return _error(f"interrupted; continue with --resume --out {args.out}", code=130)
    finally:
        runner.close()
    if pipelined and runner.last_timeline is not None:
        try:
            files = runner.last_timeline.save(args.out, stem="last_step")
        except OSError as e:
            return _error(f"cannot write the timeline to --out {args.out}: {e.strerror or e}")
        print(f"last step's timeline: {', '.join(str(f) for f in files)} (open the .json in Perfetto or chrome://tracing)")
    if args.json:
        summary = {"config": args.config, "data": corpus.name, **history.summary(), "batch_size": args.batch_size,
                   "seed": args.seed, "out": str(Path(args.out)), "runner": "pipeline" if pipelined else "single"}
        if pipelined:
            summary.update(devices=[str(d) for d in runner.devices], placement=str(runner.placement),
                           schedule=runner.schedule.name, micro_batches=runner.micro_batches,
                           bubble_fraction_over="mean of all training steps")
        else:
            summary.update(devices=["cpu"])
            summary.pop("bubble_fraction", None)
        print(json.dumps(summary))
    return 0


def run_corpus(args) -> int:
    from . import synthetic
    try:
        path = synthetic.write(args.out, args.seed)
    except OSError as e:
        return _error(f"cannot write the corpus to {args.out}: {e.strerror or e}")
    print(f"wrote the embedded corpus (seed {args.seed}) to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv or ["train"])
    return run_corpus(args) if args.command == "corpus" else run_train(args)


if __name__ == "__main__":
    sys.exit(main())
