"""The command line: `python -m mpedu train` trains the language model, `python -m mpedu corpus` writes the corpus."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from ..core.recompute import parse_recompute
from ..core.single import SingleDevice
from ..course.wording import plural
from ..runtime.files import why
from ..training.history import diverged
from ..training.loop import CHECKPOINT_EVERY, train
from ..training.recipes import RECIPES
from .options import (add_training_options, apply_recipe, count, folder, join_dash_values, json_line, link_help,
                      micro_batch_option, parse_link, parse_memory_cap, positive_int, shorten)
from .runners import build_runner, pipeline_defaults

EXAMPLES = """\
examples:
  python -m mpedu train                           # laptop model, embedded corpus, 2 virtual devices, GPipe
  python -m mpedu train --devices 1               # the single-device reference run
  python -m mpedu train --placement "embed,lstm0:vgpu0 | lstm1,decode:vgpu1" --schedule 1f1b
  python -m mpedu train --data path/to/ptb --config small   # Zaremba et al.'s small recipe
  python -m mpedu train --resume                  # continue runs/latest/checkpoint.pt
  python -m mpedu train --memory-cap 2MB          # refuse a placement that needs more per device
  python -m mpedu train --link 10gbe/100          # devices joined by 10 Gb Ethernet, slowed 100x as the CPU is
"""

LR_HELP = """
learning rate and recipes:
  mpedu's loss is the mean NLL per token. Zaremba et al. sum it over the T time steps of a
  window, so their gradients are T times mpedu's: their lr 1 is about lr T here (20 for small,
  T = 20), and their gradient clip 5 about 5 / T. Each --config carries its paper's recipe in
  mpedu's units; --epochs, --batch-size, --lr, --clip and --bptt you give override it:
""" + "".join(f"  {name:<7} {recipe.describe()}\n" for name, recipe in RECIPES.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpedu", description="Model-parallel (pipeline) training of a stacked LSTM language model. "
        "With no command, runs `train` with its defaults.")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="{train,corpus}")

    t = commands.add_parser("train", help="train the language model (default: laptop model, 2 virtual devices, "
                            "GPipe)",
                            epilog=EXAMPLES + LR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Train, print one line per epoch, save checkpoint.pt and model.pt in --out.")
    add_training_options(t, clip_over="the gradients")
    t.set_defaults(seed=None)       # resolved after parsing: a --resume takes the checkpoint's unless given
    t.add_argument("--bptt", type=count, metavar="T",
                   help="stream mode: cut the text into T-step chunks and carry the LSTM state across batches; "
                        "0: bucketed sentences (default: the recipe's; tiny: bucketed)")
    t.add_argument("--out", type=folder, default="runs/latest", metavar="DIR",
                   help="where checkpoint.pt and model.pt go (default: runs/latest)")
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt, mid-epoch if need be "
                   "(on any placement or device count), with the run's own --batch-size, --seed, --clip, --bptt "
                   "and --limit-batches unless given; bit for bit with the same micro-batches and chunks, "
                   "dropout and stream mode (--bptt) included, else to float rounding")
    t.add_argument("--checkpoint-every", type=count, default=CHECKPOINT_EVERY, metavar="N",
                   help=f"write DIR/checkpoint.pt every N batches, and at each epoch end; 0: only at epoch "
                        f"ends (default: {CHECKPOINT_EVERY})")
    t.add_argument("--limit-batches", type=positive_int, metavar="N",
                   help="use only the first N batches of each split per epoch: a quick smoke test, "
                        "whose perplexities describe those batches only")
    t.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    t.add_argument("--no-progress", action="store_true", help="no progress bars (they go to stderr)")
    t.add_argument("--no-baselines", action="store_true",
                   help="after training a pipeline, do not measure it beside one virtual device and one device "
                        "with all cores (a few steps of each, in turn: a few seconds)")
    pipe = t.add_argument_group("pipeline")
    where = pipe.add_mutually_exclusive_group()
    # default None, resolved after parsing (the recipe's placement, or 2): argparse treats a value that `is`
    # the default as not given, so a typed "--devices 2" beside --placement would escape the exclusion
    where.add_argument("--devices", type=positive_int, metavar="N",
                       help="split the layers evenly over N devices (vgpu:0.. on CPU); 1 = the single-device "
                            "reference runner, on the cpu with PyTorch's intra-op threads (default: the recipe's "
                            "placement; laptop: embed,lstm0,lstm1 on vgpu:0 and decode on vgpu:1; others: 2)")
    where.add_argument("--placement", metavar="STR",
                       help='layers to devices, e.g. "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"')
    pipe.add_argument("--schedule", default="gpipe",
                      help="pipeline schedule: naive, gpipe, 1f1b, interleaved, looped_bfs, zb1, wavefront (default: "
                      "gpipe); zbv, dualpipev, v_half, v_min on the V placement (the default placement for them); "
                      "zb_cap<k>, zero bubble holding at most k micro-batches per device; or a file of your own, one "
                      "line of actions per device (0F0 0F1 0B0 0B1), or PyTorch's .csv")
    pipe.add_argument("--micro-batches", type=micro_batch_option, metavar="M",
                      help="micro-batches per batch, at most --batch-size, or the sentences of each, adding up to "
                           "--batch-size: 8,16,24,16 (unequal micro-batches) (default: the recipe's; laptop: 8, "
                           "others: 4)")
    pipe.add_argument("--chunks", type=positive_int, default=1, metavar="C",
                      help="time chunks per sequence, for --schedule wavefront (default: 1)")
    pipe.add_argument("--memory-cap", type=parse_memory_cap, metavar="SIZE",
                      help="memory each device may use, e.g. 2MB, or per device: vgpu:0=2MB,vgpu:1=4MB; a "
                           "placement that needs more stops before the first step and names one that fits")
    pipe.add_argument("--link", type=parse_link, metavar="LINK", help=link_help())
    pipe.add_argument("--recompute", type=_recompute, metavar="MODE",
                      help="activation recomputation: none, all, all-but-last (every micro-batch but the last), "
                           "or per stage, e.g. 0=all,1=none: keep only each stage's input and run its forward "
                           "again before the backward (less memory, more time; default: none)")

    c = commands.add_parser("corpus", help="write the embedded corpus as ptb.{train,valid,test}.txt",
                            description="Write the embedded synthetic corpus in PTB format (one sentence per line).")
    c.add_argument("--out", type=folder, required=True, metavar="DIR", help="folder to write into")
    c.add_argument("--seed", type=count, default=0, help="which made-up language (default: 0)")
    c.add_argument("--force", action="store_true", help="replace ptb.*.txt files already in DIR")
    return parser


def _recompute(text: str):
    try:
        return parse_recompute(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _error(message: str, code: int = 2) -> int:
    print(f"mpedu: error: {shorten(message, 2000)}", file=sys.stderr)
    return code


def run_train(args) -> int:
    from ..lm.data import load_corpus
    try:
        corpus = load_corpus(args.data)
    except ValueError as e:  # CorpusError: names the folder and the missing or bad file
        return _error(str(e))
    except OSError as e:     # unreadable (permissions, a folder where a file should be)
        return _error(f"cannot read the corpus in {args.data}: {e.strerror or e} ({e.filename or args.data})")
    recipe = apply_recipe(args)
    pipeline_defaults(args, recipe)
    args.resuming = _the_runs_own_settings(args)
    # Settings a schedule cannot meet are refused before one is built (a schedule with a
    # billion micro-batches or chunks would take that long to write down).
    if isinstance(args.micro_batches, list) and sum(args.micro_batches) != args.batch_size:
        sizes = ",".join(map(str, args.micro_batches))
        return _error(f"--micro-batches {sizes} adds up to {sum(args.micro_batches)} sentences, but --batch-size is "
                      f"{args.batch_size}: give sizes that add up to the batch size, or a count such as 4")
    if not isinstance(args.micro_batches, list) and args.micro_batches > args.batch_size:
        return _error(f"--micro-batches {args.micro_batches} is more than --batch-size {args.batch_size}: each "
                      f"micro-batch needs at least one sentence; use at most {args.batch_size}")
    longest = args.bptt or int(corpus.train.lengths().max())
    if args.chunks > longest:
        return _error(f"--chunks {args.chunks} is more than the {longest} time steps of the longest "
                      f"{'window (--bptt)' if args.bptt else 'training sentence'}; use fewer chunks")
    from ..runtime.files import OutFolderError, OutLock, prepare_out
    try:                     # --out is checked, and locked against a second run, before any training
        prepare_out(args.out)
        with OutLock(args.out):
            return _train_in(args, corpus, recipe)
    except OutFolderError as e:
        return _error(str(e))


# what a --resume takes from the checkpoint's run when not given: (where it is kept, a check of the value)
_CONTINUED = {"batch_size": ("settings", lambda v: _whole(v, 1)), "seed": ("settings", lambda v: _whole(v, 0)),
              "bptt": ("settings", lambda v: v is None or _whole(v, 1)),
              "limit_batches": ("settings", lambda v: v is None or _whole(v, 1)),
              "clip": ("options", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                          and math.isfinite(v) and v > 0))}


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**63


def _the_runs_own_settings(args) -> bool:
    """On --resume with a checkpoint in --out, the options not given here are the interrupted run's (its
    batch size, seed, clip, stream mode and batch limit; its lr comes with its optimizer), so the same
    command with --resume continues that run. Returns whether a checkpoint will be resumed."""
    given = set(args.given) | {k for k in ("seed", "limit_batches") if getattr(args, k) is not None}
    if args.seed is None:
        args.seed = 0
    path = Path(args.out) / "checkpoint.pt"
    if not args.resume or not path.is_file():
        return False
    from ..training.checkpoint import CheckpointError, load_checkpoint
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError:
        return True                          # train() names what is wrong with it
    taken = []
    for key, (part, fits) in _CONTINUED.items():
        saved = ckpt[part] if isinstance(ckpt.get(part), dict) else {}
        if key in given or key not in saved or not fits(saved[key]):
            continue                         # given here, or not known: train() notes any difference
        value = saved[key] if key != "clip" else saved[key] or 0.0
        if value != getattr(args, key):
            setattr(args, key, value)
            shown = "none" if value is None else "0 (no clipping)" if key == "clip" and not value else value
            taken.append(f"{key.replace('_', '-')} {shown}")
    if taken:
        print(f"note: continuing the run's own --{', --'.join(taken)} (from its checkpoint; give an option "
              "to change it)")
    return True


def _link_estimate(args, corpus, runner) -> str:
    """Before the first step: what the emulated link costs a step, on the run's first batch."""
    from ..runtime.link import format_duration
    from ..training.loop import make_batches
    batch = next(iter(make_batches(corpus.train, args.batch_size, bptt=args.bptt, shuffle=True, seed=args.seed)))
    T, B = batch.inputs.shape
    return (f"link {runner.link.name}: one step's hand-offs take at least "
            f"{format_duration(runner.transfer_time(batch))} on the first batch ({T} x {B})")


def _train_in(args, corpus, recipe) -> int:
    """Build the model and runner, train, write the timeline and the summary (--out is locked)."""
    from ..lm.model import LSTMLM
    from ..runtime.files import WriteFailed
    torch.manual_seed(args.seed)
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab))
    try:
        runner = build_runner(model, args)
    except ValueError as e:  # bad placement, schedule, micro-batch count or memory cap
        return _error(str(e))
    pipelined = not isinstance(runner, SingleDevice)
    if not pipelined and (args.schedule != "gpipe" or args.micro_batches_given):
        print("note: --schedule and --micro-batches apply to a pipeline; --devices 1 runs the single-device model")
    sizes = runner.micro_batch_sizes if pipelined else None
    where = (f"pipeline {runner.placement}, schedule {runner.schedule.name}, {runner.micro_batches} micro-batches"
             + (f" of {', '.join(map(str, sizes))} sentences" if sizes and len(set(sizes)) > 1 else "")
             + (f", link {runner.link}" if runner.link.emulated else "") if pipelined
             else f"single device (cpu, {plural(torch.get_num_threads(), 'intra-op thread')})")
    print(f"mpedu train: {args.config} model on {corpus.name} ({len(corpus.vocab):,} words, "
          f"{corpus.tokens('train'):,} training tokens); {where}")
    if pipelined and runner.link.emulated:
        print(_link_estimate(args, corpus, runner))
    checkpoint = Path(args.out) / "checkpoint.pt"
    before = _written(checkpoint)        # a checkpoint this run did not write belongs to an earlier run
    try:
        history = train(
            # on --resume, an lr not given is the checkpoint's (it may have been decayed)
            model, corpus, runner=runner, epochs=args.epochs, batch_size=args.batch_size,
            lr=args.lr if "lr" in args.given or not args.resuming else None,
            clip=args.clip or None, seed=args.seed, out=args.out, resume=args.resume, bptt=args.bptt,
            checkpoint_every=args.checkpoint_every, limit_batches=args.limit_batches, lr_decay=recipe.decay,
            skip_bad_batches=args.skip_bad_batches, progress=not args.no_progress and sys.stderr.isatty())
    except WriteFailed as e:   # disk full, file-size limit: says what was kept
        return _error(str(e), code=1)
    except ValueError as e:  # CheckpointError, MemoryCapError, or a setting the data cannot meet
        return _error(str(e))
    except FloatingPointError as e:  # NumericFault: names the step, the layer, its stage and device
        return _error(str(e), code=1)
    except OSError as e:
        return _error(f"cannot write to --out {args.out}: {why(e)} ({e.filename or args.out})", code=1)
    except KeyboardInterrupt:
        if args.resuming or _written(checkpoint) not in (None, before):    # this run's own, or the one it continued
            return _error(f"interrupted; continue with --resume --out {args.out}", code=130)
        first = (f"interrupted before this run's first checkpoint (written every {args.checkpoint_every} batches "
                 "and at each epoch end)")
        if before is not None:
            return _error(f"{first}; {checkpoint} is still the earlier run's (--resume would continue that one)",
                          code=130)
        return _error(f"{first}: nothing to resume", code=130)
    finally:
        runner.close()
    try:
        return _report(args, corpus, recipe, runner, history, pipelined)
    except KeyboardInterrupt:
        return _error(f"interrupted after training had finished: {checkpoint} and model.pt are written; the "
                      "last step's timeline or the summary may not be", code=130)


def _written(path: Path):
    """When `path` was last written (None: it is not there)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _report(args, corpus, recipe, runner, history, pipelined) -> int:
    """After training: the last step's timeline, the JSON summary, and whether the run diverged."""
    if pipelined and runner.last_timeline is not None:
        try:
            files = runner.last_timeline.save(args.out, stem="last_step")
        except OSError as e:
            return _error(f"cannot write the timeline to --out {args.out}: {why(e)}; the checkpoint and "
                          "model.pt are written", code=1)
        print(f"last step's timeline: {', '.join(str(f) for f in files)} (open the .json in Perfetto or chrome://tracing)")
    baselines = None
    if pipelined and not args.no_baselines and history.summary().get("steps"):    # after training steps only
        baselines = _measure_baselines(args, corpus, runner)
        print("\n".join(baselines.lines()))
    if args.json:
        summary = {"config": args.config, "data": corpus.name, **history.summary(), "batch_size": args.batch_size,
                   "seed": args.seed, "out": str(Path(args.out)), "runner": "pipeline" if pipelined else "single",
                   "limit_batches": args.limit_batches}
        if pipelined:
            summary.update(devices=[str(d) for d in runner.devices], placement=str(runner.placement),
                           schedule=runner.schedule.name, micro_batches=runner.micro_batches,
                           micro_batch_sizes=list(runner.micro_batch_sizes or []), link=runner.link.name,
                           bubble_fraction_over="mean of all training steps",
                           **(baselines.summary() if baselines else {}))
        else:
            summary.update(devices=["cpu"])
            summary.pop("bubble_fraction", None)
        print(json_line(summary))
    problem = diverged(history.summary(), recipe.lr)
    return _error(problem, code=1) if problem else 0


def _measure_baselines(args, corpus, runner):
    """The trained pipeline beside one virtual device and one all-cores device, on a few training batches."""
    import itertools

    from ..course.baselines import measure_baselines
    from ..training.loop import make_batches
    batches = make_batches(corpus.train, args.batch_size, bptt=args.bptt, shuffle=True, seed=args.seed)
    return measure_baselines(runner, itertools.islice(batches, BASELINE_BATCHES))


BASELINE_BATCHES = 4      # per runner and round: a few seconds in all for the default model


def run_corpus(args) -> int:
    from ..lm import synthetic
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _error(f"--out {args.out} is a file; give a folder (it is created if need be)")
    there = [f.name for f in synthetic.files(out) if f.exists()]
    if there and not args.force:
        return _error(f"{args.out} already holds {', '.join(there)}; give another --out, or --force to replace them")
    try:
        path = synthetic.write(out, args.seed)
    except OSError as e:
        return _error(f"cannot write the corpus to {args.out}: {e.strerror or e}")
    print(f"wrote the embedded corpus (seed {args.seed}) to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["train"] + argv         # no command: `train`, with the options given
    parser = build_parser()
    args = parser.parse_args(join_dash_values(parser, argv) or ["train"])
    world = os.environ.get("WORLD_SIZE", "1")
    if args.command == "train" and world.isdigit() and int(world) > 1:
        # under torchrun each process would train the whole model on its own, in the same --out
        return _error(f"python -m mpedu train runs the whole pipeline in this one process, but WORLD_SIZE={world} "
                      f"says {world} were started together (torchrun or another launcher); for a pipeline across them "
                      f"use torchrun ... -m mpedu.distributed train")
    try:
        return run_corpus(args) if args.command == "corpus" else run_train(args)
    except KeyboardInterrupt:           # before training started (a Ctrl-C during it is answered in _train_in)
        return _error("interrupted before training started", code=130)


if __name__ == "__main__":
    sys.exit(main())
