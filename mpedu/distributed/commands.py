"""`train` and `check` under torchrun: every rank runs the same function on the same data."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..cli.options import apply_recipe, json_line
from ..core.single import SingleDevice
from ..runtime.files import OutFolderError, OutLock, prepare_out
from ..training.checkpoint import save_model
from ..training.history import diverged
from ..training.loop import train as fit
from .bridge import resolve, schedule_arg
from .cli import pipeline_devices
from .group import setup
from .pipeline import DistributedPipeline
from .native import plan_schedule
from .placement import rank_placement, wants_v

# what each rank may choose for itself: where it writes and reads (paths differ between machines; the data and a
# schedule file are compared by content), what it prints, how long it waits
_OWN = {"out", "data", "no_progress", "json", "timeout", "heartbeat", "given"}


def same_everywhere(args, corpus) -> None:
    """Refuse, on every rank at once, options or data that differ between the ranks: on several machines each
    types its own command, and a different --lr trains silently wrong, a different --seed breaks a collective."""
    mine = {key: value for key, value in sorted(vars(args).items()) if key not in _OWN and not callable(value)}
    if isinstance(mine.get("schedule"), str):     # a hand-written schedule file: its content, not its path
        mine["schedule"] = ",".join(_content(item.strip()) for item in mine["schedule"].split(","))
    digest = hashlib.sha256("\n".join(corpus.vocab.itos).encode())
    for split in (corpus.train, corpus.valid, corpus.test):     # every token id, in order (milliseconds for PTB)
        digest.update(f"{len(split)};".encode())
        digest.update(split.ids[split.offsets[0]:split.offsets[-1]])      # (hashed where they lie: no copy)
        digest.update(split.offsets - split.offsets[0])
    mine["the data"] = f"{len(corpus.vocab):,} words, sha256 {digest.hexdigest()[:12]}"   # not its path: per machine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, value in mine.items():
        seen = [ranks.get(key) for ranks in everyone]
        if any(v != seen[0] for v in seen):
            what = "data" if key == "the data" else "--" + key.replace("_", "-")
            told = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
            raise ValueError(f"the ranks were started with different {what} ({told}); give every process the "
                             "same options and the same data")


def _content(item: str) -> str:
    """A --schedule item as the ranks compare it: a file by its size and digest (shown in a refusal, where its
    whole text would fill the screen once per rank), a name as it is."""
    path = Path(item)
    if not path.is_file():
        return item
    data = path.read_bytes()
    lines = data.count(b"\n") + 1
    return f"a file of {lines:,} lines, sha256 {hashlib.sha256(data).hexdigest()[:12]}"


def _say(rank: int):
    return print if rank == 0 else (lambda *a, **k: None)


def run_train(args) -> int:
    rank, world, device = setup(args.backend, args.timeout, args.heartbeat)
    say = _say(rank)
    recipe = apply_recipe(args, say)
    p = pipeline_devices(args, world)
    out = Path(args.out)
    with _out_held(rank, out, say):          # checked (and locked) before any training, as `python -m mpedu train`
        return _train(args, rank, world, device, say, recipe, p, out)


@contextlib.contextmanager
def _out_held(rank: int, out: Path, say):
    """Rank 0 prepares and locks --out (mpedu.runtime.files) and tells every rank whether it could: a folder that
    cannot be written stops all ranks before step 1, not after the last epoch with the weights unsaved."""
    with contextlib.ExitStack() as held:
        problem = None
        if rank == 0:
            try:
                held.enter_context(OutLock(prepare_out(out), log=say))
            except OutFolderError as e:
                problem = str(e)
            if problem is None and (out / "checkpoint.pt").exists():
                problem = (f"--out {out} holds the checkpoint.pt of a python -m mpedu train run: this job's model.pt "
                           "would sit beside it, and a --resume of that run would overwrite it; pick another --out")
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            raise ValueError(shared[0])
        yield


def _train(args, rank, world, device, say, recipe, p, out) -> int:
    from ..lm.data import load_corpus
    from ..lm.model import LSTMLM
    corpus = load_corpus(args.data)          # every rank reads the data: same batches, same order
    same_everywhere(args, corpus)
    torch.manual_seed(args.seed)
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab))
    placement = rank_placement(model, args.placement, p, args.schedule)      # zbv, dualpipev: the V by default
    schedule = schedule_arg(args.schedule, placement.stage_devices, args.micro_batches)
    pipe = DistributedPipeline(model, placement, schedule, args.micro_batches, device=device,
                               width=args.batch_size, pipeline_devices=p, runtime=args.runtime)
    replicas = f"{pipe.replicas} replicas x " if pipe.replicas > 1 else ""
    say(f"mpedu.distributed train: {args.config} model on {corpus.name} ({len(corpus.vocab):,} words); "
        f"{world} processes ({dist.get_backend()}, {device.type}) = {replicas}a {p}-rank pipeline; placement "
        f"{pipe.placement}; schedule {pipe.schedule} -> {pipe.torch_schedule}, {args.micro_batches} micro-batches")
    history = fit(
        model, corpus, runner=pipe, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        clip=args.clip or None,             # over every rank's gradients (DistributedPipeline.clip_grad_norm)
        seed=args.seed, out=None, limit_batches=args.limit_batches, log=say, lr_decay=recipe.decay,
        skip_bad_batches=args.skip_bad_batches,
        progress=rank == 0 and not args.no_progress and sys.stderr.isatty())
    state = pipe.gather_state_dict()
    if rank == 0:
        model.load_state_dict(state)
        save_model(out / "model.pt", model, corpus.vocab, placement=str(pipe.placement))
        written = ["model.pt"]
        if pipe.last_timeline is not None:
            written += [f.name for f in pipe.last_timeline.save(out, stem="last_step")]
            say(pipe.last_timeline.summary())
        say(f"wrote {', '.join(written)} in {out}")
        if args.json:
            summary = {"config": args.config, "data": corpus.name, **history.summary(),
                       "batch_size": args.batch_size, "seed": args.seed, "out": str(out), "runner": "distributed",
                       "limit_batches": args.limit_batches,
                       "world_size": world, "backend": dist.get_backend(), "devices": pipe.devices,
                       "pipeline_devices": p, "replicas": pipe.replicas, "runtime": pipe.runtime,
                       "placement": str(pipe.placement), "schedule": pipe.schedule,
                       "torch_schedule": pipe.torch_schedule, "micro_batches": args.micro_batches,
                       "shapes": len(pipe.shapes), "bubble_fraction_over": "mean of all training steps"}
            print(json_line(summary))
    dist.barrier()
    pipe.close()
    dist.destroy_process_group()
    problem = diverged(history.summary(), recipe.lr)      # every rank holds the same history
    if problem:
        say(f"mpedu.distributed: error: {problem}", file=sys.stderr)
        return 1
    return 0


def run_check(args) -> int:
    """One step per schedule; rank 0 compares loss and gradients with the whole model in one process."""
    from ..lm.bucketing import BucketIterator
    from ..lm.data import load_corpus
    from ..lm.model import LSTMLM
    rank, world, device = setup(args.backend, args.timeout, args.heartbeat)
    say = _say(rank)
    if device.type == "cuda":
        # The comparison claims equality up to fp32 rounding: cuDNN's LSTM (and cuBLAS, where enabled)
        # would otherwise multiply in TF32, whose 10-bit mantissa differs from the CPU by ~1e-3.
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        say("TF32 off for this check (cuDNN and cuBLAS multiply in plain fp32), so the GPUs can be compared "
            "with the CPU reference")
    names = [s.strip() for s in args.schedule.split(",") if s.strip()]
    if not names:
        raise ValueError("--schedule names no schedule; e.g. --schedule gpipe,1f1b")
    p = pipeline_devices(args, world)
    corpus = load_corpus(args.data)
    same_everywhere(args, corpus)
    torch.manual_seed(args.seed)
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout {args.dropout}: expected a probability, 0 <= P < 1")
    # positional dropout masks (mpedu.lm.dropout): the ranks draw the one-process masks, so --dropout is exact too
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab), dropout=args.dropout)
    # no --placement: the V when a schedule needs it (zbv, dualpipev), for every schedule of the check
    placement = rank_placement(model, args.placement, p, next((n for n in names if wants_v(n)), None))
    stage_ranks = placement.stage_devices
    # every schedule is built and validated before the first step, so a bad one stops the run at once
    schedules = [schedule_arg(name, stage_ranks, args.micro_batches) for name in names]
    if args.runtime == "mpedu":
        schedules = [resolve(schedule, stage_ranks, args.micro_batches) for schedule in schedules]
    else:                      # PyTorch's own classes: each name is mapped (or refused) before the first step too
        for schedule in schedules:
            if isinstance(schedule, str):        # a file's Schedule: DistributedPipeline says it needs a name
                plan_schedule(schedule, stage_ranks, args.micro_batches)
    labels = [Path(name).stem if Path(name).is_file() else name for name in names]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--schedule {args.schedule} names a schedule twice; name each once")
    batch = next(iter(BucketIterator(corpus.train, args.batch_size, seed=args.seed)))  # has padding
    out = Path(args.out) if args.out else None
    if out:                                  # every rank writes its gradients there (one node each, perhaps)
        try:
            prepare_out(out)
        except OutFolderError as e:
            raise ValueError(str(e)) from None
    if rank == 0:
        reference = copy.deepcopy(model)
        one = SingleDevice(reference)          # the reference runner: its dropout masks at (seed, step 0)
        one.dropout_seed = args.seed
        ref_loss = one.train_step(batch).loss
        ref_grads = {n: q.grad for n, q in reference.named_parameters()}
        if out:   # what the ranks start from, so a test can compute the reference itself
            torch.save({"state": model.state_dict(), "config": model.config.to_dict(),
                        "vocab_size": model.vocab_size, "seed": args.seed}, out / "check-init.pt")
            torch.save({"inputs": batch.inputs, "targets": batch.targets}, out / "check-batch.pt")
    dist.barrier()
    # a GPU's kernels (cuDNN LSTM) sum in other orders than the CPU reference
    rtol, atol = (1e-3, 1e-5) if device.type == "cuda" else (1e-5, 1e-7)
    report, ok = {}, True
    for name, schedule in zip(labels, schedules):
        model.zero_grad(set_to_none=True)
        pipe = DistributedPipeline(model, placement, schedule, args.micro_batches, device=device,
                                   pipeline_devices=p, runtime=args.runtime)
        pipe.dropout_seed = args.seed
        result = pipe.train_step(batch)
        grads = pipe.owned_grads()
        if out:
            torch.save(grads, out / f"grads-{name}-rank{rank}.pt")
        parts = [None] * world if rank == 0 else None
        dist.gather_object(grads, parts, dst=0)
        if rank == 0:
            equal, line, entry = compare(parts, ref_grads, result.loss, ref_loss, rtol, atol)
            ok &= equal
            entry.update({"torch_schedule": pipe.torch_schedule, "replicas": pipe.replicas,
                          "bubble_fraction": result.timeline.bubble_fraction,
                          "all_reduces": len(result.timeline.collectives())})
            report[name] = entry
            say(f"{name:>11} ({pipe.torch_schedule}{f', {pipe.replicas} replicas' if pipe.replicas > 1 else ''}): "
                + line)
            say("  " + result.timeline.summary().replace("\n", "\n  "))
            if out:
                result.timeline.save(out, stem=f"check-{name}")
        pipe.close()
    if rank == 0:
        say(f"{'equal to one process' if ok else 'NOT equal to one process'}: {len(report)} schedule(s) on "
            f"{world} processes ({world // p} replica(s) x {p} pipeline ranks)")
        if out:
            (out / "check.json").write_text(json.dumps({"world_size": world, "pipeline_devices": p,
                                                        "placement": str(pipe.placement), "tokens": batch.tokens,
                                                        "micro_batches": args.micro_batches, "equal": ok,
                                                        "schedules": report}, indent=2))
    verdict = torch.tensor([int(ok)], device=device)
    dist.broadcast(verdict, src=0)        # every rank exits 1 when the results differ
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


def compare(parts: list[dict], ref_grads: dict, loss: float, ref_loss: float, rtol: float, atol: float):
    """Every rank's gradients (each replica holds a full copy after the all-reduce) against one process's:
    (equal, a line for the terminal, the report entry)."""
    merged = {k: v for part in parts for k, v in part.items()}
    missing = sorted(set(ref_grads) - set(merged))
    worst, where = max(((g - ref_grads[k]).abs().max().item(), k) for part in parts for k, g in part.items())
    equal = (not missing and math.isclose(loss, ref_loss, rel_tol=10 * rtol)
             and all(torch.allclose(g, ref_grads[k], rtol=rtol, atol=atol) for part in parts for k, g in part.items()))
    line = (f"loss {loss:.7f}, one process {ref_loss:.7f}; max |grad diff| {worst:.2e} ({where})"
            + (f"; no gradient for {', '.join(missing)}" if missing else "") + ("  OK" if equal else "  DIFFERENT"))
    entry = {"loss": loss, "single_process_loss": ref_loss, "max_abs_grad_diff": worst, "worst_parameter": where,
             "missing_grads": missing, "equal": equal}
    return equal, line, entry
