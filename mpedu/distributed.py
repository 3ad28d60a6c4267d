"""The same model, placement and schedule on torch.distributed.pipelining: one process per device, under torchrun.

    torchrun --nproc-per-node 2 -m mpedu.distributed train --schedule 1f1b
    torchrun --nproc-per-node 2 -m mpedu.distributed check      # equal to one process?

Devices become ranks: the k-th distinct device of the placement (in order of first
appearance) is rank k, so "embed,lstm0:vgpu0 | lstm1,decode:vgpu1" runs embed and
lstm0 in rank 0 and the rest in rank 1. Each rank builds the whole model from the
seed (so every rank starts from the same weights), keeps its own layers, and wraps
each of its stages in a PipelineStage. mpedu's schedule names map to PyTorch's
schedule classes (see `plan_schedule`). CPU ranks talk through gloo, GPU ranks
through NCCL on `cuda:LOCAL_RANK`; several nodes join through torchrun's rendezvous.

Static shapes. A PipelineStage allocates its receive buffers once, for one input
shape, so every step must bring the shape it was built for. Bucketing gives
batches of several lengths T (and a bucket's last batch may be narrower). Two
ways out: pad every batch to the largest bucket (one schedule, but a 10-token
sentence then costs as much as a 60-token one), or build one stage set and
schedule per shape and cache them. We do the second: it is MXNet's "one unrolled
graph per bucket", it wastes no compute on padding, and with static metadata a new
shape costs no extra forward pass, only its buffers. Narrow batches are widened
with empty columns to the batch size, so there is one shape per bucket length.

State. Stage outputs must be tensors, so an LSTM's (h, c) cannot travel between
ranks; each stage starts every micro-batch from zero state and keeps it inside.
That is exactly the bucketed trainer's contract (state reset per batch); stream
mode (--bptt, state carried across batches) is not offered here.

Loss. The last stage's loss is nll_sum(micro-batch) / (real tokens in the whole
batch) and PyTorch's own scaling is off, so micro-batch losses add up to the
batch's mean NLL per token and the gradients equal the single-process model's,
with dropout too: masks are positional (mpedu.dropout), so rank r draws for its
micro-batch exactly the slice of the one-process masks. Gradient clipping sums the squared
norms over all ranks, so it clips exactly as one process would.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from .__main__ import (_non_negative_float, _positive_float, _positive_int, add_training_options,  # the same
                       apply_recipe, json_line)                                            # as `python -m mpedu`
from . import dropout
from .devices import Device
from .heartbeat import LIMIT as HEARTBEAT, Heartbeat
from .model import CONFIGS, Decode, Embed, LSTMLayer, nll_sum
from .placement import Placement, _expand
from .timeline import Event, Timeline
from .train import CONFIG, SingleDevice, StepResult, fit_width, save_model
from .train import train as fit   # (`from . import train` would give the function: mpedu exports it)

FAIL_ENV = "MPEDU_DIST_FAIL_RANK"   # tests: this rank raises in its first stage forward
TIMEOUT = 600                       # seconds a rank waits for a peer before giving up

SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb1")
_ALIASES = {"onefoneb": "1f1b", "zb": "zb1", "zbh1": "zb1", "zerobubble": "zb1"}


# -- stages -----------------------------------------------------------------------------

class _GradContiguous(torch.autograd.Function):
    """Identity forward; in backward, a contiguous gradient (gloo refuses to send strided tensors)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class StageModule(nn.Module):
    """Consecutive layers of an LSTMLM as one pipeline stage: a tensor in, a tensor out.

    First stage: tokens (b, T) batch-first, as torch's step() splits along dim 0 ->
    (T, b) time-major inside. Others: (T, b, F). Output (T, b, F') or logits (T, b, V).
    Each layer starts from zero state and its (h, c) never leaves the stage.
    """

    def __init__(self, names: list[str], layers: list[nn.Module]):
        super().__init__()
        self.names = list(names)
        self.layers = nn.ModuleList(layers)   # the model's own modules: Parameters are shared
        self.fail = False                     # set from FAIL_ENV, for the failure test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError(f"failure injected by {FAIL_ENV}={os.environ.get(FAIL_ENV)} in the stage "
                               f"holding {','.join(self.names)}")
        if x.is_floating_point():
            x = _GradContiguous.apply(x)      # (T, b, F) received from the previous rank
        else:
            x = x.t()                         # (b, T) -> (T, b) token ids
        for name, layer in zip(self.names, self.layers):
            x, _ = layer(x, None)             # None: zero state, reset every micro-batch
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"layer {name!r} returned {type(x).__name__}, but a pipeline stage may only "
                                "pass tensors between ranks; make the layer return (tensor, state)")
        return x.contiguous()                 # gloo sends contiguous tensors only


def _out_width(name: str, layer: nn.Module) -> int:
    """Features of a layer's output: what the next rank's receive buffer must hold."""
    if isinstance(layer, Embed):
        return layer.embedding.embedding_dim
    if isinstance(layer, LSTMLayer):
        return layer.lstm.hidden_size
    if isinstance(layer, Decode):
        return layer.linear.out_features
    raise TypeError(f"layer {name!r} is a {type(layer).__name__}; mpedu.distributed knows the output width of "
                    "Embed, LSTMLayer and Decode only, and needs it to build static receive buffers")


# -- placement and schedule -------------------------------------------------------------

_GROUP_RE = re.compile(r"^\s*([^:]+?)\s*:\s*([A-Za-z_]\w*(?::\d+)?|\d+)\s*$")  # "layers : label"


def rank_placement(model, placement: str | Placement | None, world_size: int) -> Placement:
    """A Placement whose devices are ranks `rank:0` .. `rank:p-1`.

    `placement` is None (layers split evenly over the world), a string whose device
    labels name ranks by order of first appearance (vgpu0, cuda3 and rank1 are all just
    labels; the k-th distinct one is rank k), or a Placement. Every rank must get layers.
    """
    if placement is None:
        if world_size > len(model.layer_names):
            raise ValueError(f"{world_size} ranks but the model has only {len(model.layer_names)} layers "
                             f"({', '.join(model.layer_names)}): a rank with no layers has nothing to do; "
                             f"run at most {len(model.layer_names)} processes or add LSTM layers (--config)")
        devices = [Device(f"rank:{k}", True) for k in range(world_size)]
        return _check_world(Placement.even(model, devices), world_size)
    if isinstance(placement, Placement):
        labels = {dev: k for k, dev in enumerate(placement.devices)}
        mapping = {name: Device(f"rank:{labels[dev]}", True) for name, dev in placement.assignment.items()}
        return _check_world(Placement.from_dict(mapping, model), world_size)
    mapping, ranks = {}, {}
    for group in placement.split("|"):
        match = _GROUP_RE.match(group)
        if not match:
            raise ValueError(f"placement group {group.strip()!r} should read 'layers:device', e.g. "
                             "'embed,lstm0:vgpu0' (the k-th distinct device is rank k)")
        label = match.group(2).lower().replace(":", "")
        rank = ranks.setdefault(label, len(ranks))
        for name in _expand(match.group(1)):
            if name in mapping:
                raise ValueError(f"layer {name!r} is placed twice; give each layer one device")
            mapping[name] = Device(f"rank:{rank}", True)
    return _check_world(Placement.from_dict(mapping, model), world_size)


def _check_world(placement: Placement, world_size: int) -> Placement:
    p = len(placement.devices)
    if p > world_size:
        raise ValueError(f"the placement {placement} uses {p} devices but only {world_size} processes run: "
                         f"one process per device, so start torchrun with --nproc-per-node {p} (on one node) "
                         "or use fewer devices")
    if p < world_size:
        raise ValueError(f"the placement {placement} uses {p} devices but {world_size} processes run, so "
                         f"rank{'s' if world_size - p > 1 else ''} {', '.join(str(r) for r in range(p, world_size))}"
                         f" would hold no layers; start {p} processes or place layers on every rank")
    return placement


def check_tied_weights(model, placement: Placement) -> None:
    """A Parameter used by layers on two ranks would get two diverging copies: refuse."""
    owner: dict[int, tuple[str, str]] = {}
    for name in model.layer_names:
        dev = placement.assignment[name].name
        for p in model.layers[name].parameters():
            if id(p) in owner and owner[id(p)][1] != dev:
                other, other_dev = owner[id(p)]
                raise ValueError(f"layers {other!r} ({other_dev}) and {name!r} ({dev}) share a weight (tied "
                                 "weights), which cannot be split over processes; place them on the same "
                                 "device or build the model with tie_weights=False")
            owner.setdefault(id(p), (name, dev))


def _layout(stage_ranks: list[int]) -> str:
    p, n = max(stage_ranks) + 1, len(stage_ranks)
    if n == p:
        return "single"
    if n % p == 0 and all(r == s % p for s, r in enumerate(stage_ranks)):
        return "looped"
    if n == 2 * p and stage_ranks == list(range(p)) + list(reversed(range(p))):
        return "v"
    return "other"


@dataclass(frozen=True)
class TorchPlan:
    """Which PyTorch schedule runs an mpedu schedule, and with how many micro-batches per step() call."""

    schedule: str          # mpedu's name
    cls: type              # a torch.distributed.pipelining schedule class
    per_call: int          # micro-batches per step() call; naive: 1, called m times
    layout: str            # "single" (one stage per rank) or "looped" (stage s on rank s % p)

    @property
    def multi(self) -> bool:
        """Whether the class takes a list of stages (all but GPipe and 1F1B do, even for one stage)."""
        return not issubclass(self.cls, PipelineScheduleSingle)


def plan_schedule(schedule: str, stage_ranks: list[int], m: int) -> TorchPlan:
    """Map an mpedu schedule name and a stage -> rank layout to a torch schedule class.

        naive        GPipe with 1 micro-batch per step() call, called m times (one in flight)
        gpipe        ScheduleGPipe; several stages per rank: ScheduleLoopedBFS
        1f1b         Schedule1F1B;  several stages per rank: ScheduleInterleaved1F1B
        interleaved  ScheduleInterleaved1F1B (needs v >= 2 stages per rank, round-robin)
        zb1          ScheduleInterleavedZeroBubble (one stage per rank, or round-robin)
    """
    key = _ALIASES.get(schedule.lower().replace("-", "").replace("_", ""), schedule.lower())
    if key not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"micro_batches must be a whole number >= 1, got {m!r}")
    layout = _layout(list(stage_ranks))
    if layout in ("v", "other"):
        why = ("a V (stage s and stage 2p-1-s on one rank) is what PyTorch's ZBV schedule wants, but in torch "
               f"{torch.__version__} ScheduleZBVZeroBubble cannot evaluate (eval() fails), so mpedu does not offer it"
               if layout == "v" else "PyTorch's multi-stage schedules put stage s on rank s % p")
        raise ValueError(f"stage ranks {list(stage_ranks)}: each rank must hold one stage, or stages dealt "
                         f"round-robin (stage s on rank s % p); {why}. {_ROUND_ROBIN_HINT}")
    table = {
        ("naive", "single"): pp.ScheduleGPipe, ("naive", "looped"): pp.ScheduleLoopedBFS,
        ("gpipe", "single"): pp.ScheduleGPipe, ("gpipe", "looped"): pp.ScheduleLoopedBFS,
        ("1f1b", "single"): pp.Schedule1F1B, ("1f1b", "looped"): pp.ScheduleInterleaved1F1B,
        ("interleaved", "looped"): pp.ScheduleInterleaved1F1B,
        ("zb1", "single"): pp.ScheduleInterleavedZeroBubble, ("zb1", "looped"): pp.ScheduleInterleavedZeroBubble,
    }
    if (key, layout) not in table:   # interleaved on one stage per rank
        raise ValueError(f"interleaved needs each rank to hold v >= 2 stages dealt round-robin, but stage ranks "
                         f"{list(stage_ranks)} give one stage per rank; use 1f1b, or deal the stages round-robin. "
                         f"{_ROUND_ROBIN_HINT}")
    cls = table[key, layout]
    p = max(stage_ranks) + 1
    rounds = max(1, m // p)
    if cls in (pp.ScheduleInterleaved1F1B, pp.ScheduleInterleavedZeroBubble) and m % rounds:
        # PyTorch runs these in max(1, m // p) equal rounds of micro-batches and refuses a remainder
        good = sorted({k for k in range(1, 2 * max(m, p) + 1) if k % max(1, k // p) == 0} - {m})
        near = sorted(sorted(good, key=lambda k: abs(k - m))[:3])
        raise ValueError(f"{cls.__name__} splits the m micro-batches into max(1, m // p) = {rounds} equal rounds "
                         f"on p={p} ranks, and m={m} does not divide into {rounds}; use --micro-batches "
                         f"{' or '.join(map(str, near))}")
    return TorchPlan(key, cls, 1 if key == "naive" else m, layout)


# -- timing -----------------------------------------------------------------------------

class _Recorder:
    """This rank's actions in one step, as (kind, stage, mb, start, end, bytes, peer).

    Times are seconds since `t_base`, taken right after a barrier on every rank, so
    rows of different ranks line up (to the barrier's skew, well under a millisecond
    on one machine). On a GPU, marks are CUDA events, read after the step.
    """

    def __init__(self, device: torch.device, t_base: float):
        self.cuda = device.type == "cuda"
        self.t_base = t_base
        self.enabled = True
        self.mb_offset = 0          # naive: the k-th step() call runs micro-batch k
        self.marks: list[list] = []

    def start_step(self) -> None:
        self.marks.clear()
        if self.cuda:
            self.ref_cpu = time.perf_counter()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def now(self):
        if not self.enabled:
            return 0.0
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, kind: str, stage: int, mb: int, start, end, nbytes: int = 0, peer: str = "") -> None:
        if self.enabled:
            self.marks.append([kind, stage, mb + self.mb_offset, start, end, nbytes, peer])

    def extend_forward(self, end) -> None:
        """The last stage's loss runs right after its forward: count it in that F box."""
        for mark in reversed(self.marks):
            if mark[0] == "F":
                mark[4] = end
                return

    def events(self) -> list[tuple]:
        if self.cuda:
            torch.cuda.synchronize()
            sec = lambda m: self.ref_cpu - self.t_base + self.ref.elapsed_time(m) / 1e3  # noqa: E731
        else:
            sec = lambda m: m - self.t_base  # noqa: E731
        return [(k, s, i, sec(a), sec(b), n, peer) for k, s, i, a, b, n, peer in self.marks]


class _TimedStage(pp.PipelineStage):
    """A PipelineStage that records each F, B and W it runs, and each send it posts."""

    def __init__(self, *args, recorder: _Recorder, position=lambda mb: None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorder = recorder
        self.position = position      # micro-batch -> its dropout Position (None: eval, no dropout)

    def _timed(self, kind, mb, run):
        start = self.recorder.now()
        result = run()
        self.recorder.add(kind, self.stage_index, mb, start, self.recorder.now())
        return result

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with dropout.at(self.position(fwd_chunk_id)):
            return self._timed("F", fwd_chunk_id, lambda: super(_TimedStage, self).forward_one_chunk(
                fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", bwd_chunk_id, lambda: super(_TimedStage, self).backward_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("W", bwd_chunk_id, lambda: super(_TimedStage, self).backward_weight_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def _sent(self, ops, mb):
        # gloo and NCCL sends are asynchronous: the box marks when the send was posted.
        for op in ops:
            t = self.recorder.now()
            self.recorder.add("send", self.stage_index, mb, t, t, op.tensor.numel() * op.tensor.element_size(),
                              f"rank:{op.peer}")
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._sent(super().get_fwd_send_ops(fwd_chunk_id), fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._sent(super().get_bwd_send_ops(bwd_chunk_id), bwd_chunk_id)


# -- the runner -------------------------------------------------------------------------

class DistributedPipeline:
    """This rank's share of a model, trained with a torch.distributed.pipelining schedule.

    Call in every rank, after init_process_group, with the same model (same seed),
    placement and schedule; every rank then calls train_step/eval_step on the same
    batches in the same order. Has the runner interface of mpedu.train (train_step,
    eval_step, reset_state, close), so `mpedu.train.train(model, corpus, runner=pipe,
    clip=None, ...)` trains with it; give the clip here, it needs all ranks' gradients.

    width: widen every batch to this many columns (the batch size), so each bucket
    length gives one shape and one cached schedule.
    """

    def __init__(self, model, placement: str | Placement | None = None, schedule: str = "gpipe",
                 micro_batches: int = 4, *, device: torch.device | str | None = None, clip: float | None = None,
                 width: int | None = None, record: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group (or mpedu.distributed.setup) first; "
                               "launch with torchrun --nproc-per-node N -m mpedu.distributed ...")
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.placement = rank_placement(model, placement, self.world)
        check_tied_weights(model, self.placement)
        self.stage_ranks = self.placement.stage_devices          # stage s runs in rank stage_ranks[s]
        self.plan = plan_schedule(schedule, self.stage_ranks, micro_batches)
        self.micro_batches = micro_batches
        if width is not None and width % micro_batches:
            raise ValueError(f"the batch size {width} must be a multiple of micro_batches={micro_batches}: "
                             "torch's pipelining splits every batch into equal micro-batches of one static shape")
        self.width, self.clip = width, clip
        runs = self.placement.stages
        self.num_stages = len(runs)
        self.last_rank = self.stage_ranks[-1]
        self.local = [s for s, r in enumerate(self.stage_ranks) if r == self.rank]
        self.modules: dict[int, StageModule] = {}
        self.widths: list[int] = []                               # output features of each stage
        for s, (_, names) in enumerate(runs):
            self.widths.append(_out_width(names[-1], model.layers[names[-1]]))
            if s in self.local:
                self.modules[s] = StageModule(names, [model.layers[n] for n in names]).to(self.device)
        self.owned = [name for s in self.local for name in runs[s][1]]
        self.params = [p for s in self.local for p in self.modules[s].parameters() if p.requires_grad]
        self.dtype = next(model.parameters()).dtype
        if os.environ.get(FAIL_ENV) == str(self.rank):
            self.modules[self.local[0]].fail = True
        dist.barrier()                                            # a common start for every rank's clock
        self.recorder = _Recorder(self.device, time.perf_counter())
        self.recorder.enabled = record
        self._cache: dict[tuple, tuple] = {}
        self._nll: list[torch.Tensor] = []
        self._scale = 1.0
        self.last_timeline: Timeline | None = None
        # Positional dropout (mpedu.dropout), as Pipeline and SingleDevice: train() sets both
        self.dropout_seed, self.dropout_step = 0, 0
        self._key: dropout.Position | None = None     # this step's, while it trains
        self._micro_width = 0

    # -- runner interface ----------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        return [f"rank:{r}" for r in range(self.world)]

    @property
    def schedule(self) -> str:
        return self.plan.schedule

    def __repr__(self) -> str:
        return (f"DistributedPipeline({self.placement}, schedule={self.plan.schedule} -> "
                f"{self.plan.cls.__name__}, micro_batches={self.micro_batches}, rank {self.rank}/{self.world})")

    def reset_state(self) -> None:
        """Nothing is carried between batches: every stage starts each micro-batch from zero state."""

    def close(self) -> None:
        self._cache.clear()

    @property
    def shapes(self) -> list[tuple]:
        """The (T, B, train) shapes a schedule was built for so far (one per bucket length and mode)."""
        return list(self._cache)

    def train_step(self, batch) -> StepResult:
        """Forward and backward one batch; gradients accumulate in this rank's layers.

        Returns the batch's mean NLL per real token on every rank, and (when recording)
        the step's Timeline with every rank's actions.
        """
        if getattr(batch, "carry_state", False):
            raise ValueError("stream mode (carry_state batches, --bptt) is not supported by mpedu.distributed: "
                             "stage outputs must be tensors, so (h, c) cannot be carried; use bucketed batches")
        for module in self.modules.values():
            module.train()
        batch, tokens = self._prepare(batch)
        self.recorder.start_step()
        self._key = dropout.Position(self.dropout_seed, self.dropout_step)
        try:
            self._run(batch, tokens, train=True)
        finally:
            self._key = None
        self.dropout_step += 1
        if self.clip:
            self._clip_grad_norm(self.clip)
        events = self.recorder.events() if self.recorder.enabled else []
        nll = float(sum(t.double().item() for t in self._nll)) if self.rank == self.last_rank else None
        gathered = [None] * self.world
        dist.all_gather_object(gathered, (nll, events))   # the loss lives on the last rank; events on each
        nll = gathered[self.last_rank][0]
        timeline = None
        if self.recorder.enabled:
            timeline = _merge(gathered, self.devices)
            self.last_timeline = timeline
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens, timeline=timeline)

    @torch.no_grad()
    def eval_step(self, batch) -> StepResult:
        """Forward only, dropout off; the summed NLL is sent from the last rank to all."""
        for module in self.modules.values():
            module.eval()
        batch, tokens = self._prepare(batch)
        recording, self.recorder.enabled = self.recorder.enabled, False   # timelines are of training steps
        try:
            self._run(batch, tokens, train=False)
        finally:
            self.recorder.enabled = recording
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.rank == self.last_rank:
            total += sum(t.double() for t in self._nll)
        dist.broadcast(total, src=self.last_rank)
        nll = total.item()
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens)

    # -- pieces --------------------------------------------------------------------
    def _prepare(self, batch):
        """Widen the batch with empty columns (no tokens, no gradient) to the fixed width."""
        B = batch.inputs.shape[1]
        target = max(self.width or 0, B)
        target += -target % self.micro_batches
        if target != B:
            batch = fit_width(batch, target)   # B < target: exactly target - B empty columns
        tokens = int(batch.tokens)
        if tokens == 0:
            raise ValueError("the batch has no real (non-padding) target tokens")
        return batch, tokens

    def _position(self, mb: int) -> dropout.Position | None:
        """Micro-batch `mb` of the current step() call starts at column (calls so far x per_call + mb) x b."""
        if self._key is None:
            return None
        return self._key.at(sequence=(self.recorder.mb_offset * self.plan.per_call + mb) * self._micro_width)

    def _run(self, batch, tokens: int, train: bool) -> None:
        self._nll.clear()
        self._micro_width = batch.inputs.shape[1] // self.micro_batches
        self._scale = 1.0 / tokens if train else 1.0
        # torch's step() splits its arguments along dim 0, so hand it batch-first (B, T) tensors;
        # the first stage turns them back to time-major. Naive: m calls with one micro-batch each.
        x, y = batch.inputs.t().to(self.device), batch.targets.t().to(self.device)   # (B, T)
        pieces = x.chunk(self.micro_batches) if self.plan.per_call == 1 and self.micro_batches > 1 else [x]
        targets = y.chunk(len(pieces))
        for k, (xk, yk) in enumerate(zip(pieces, targets)):
            self.recorder.mb_offset = k
            schedule = self._schedule(tuple(xk.shape), train)
            args = (xk,) if 0 in self.local else ()
            kwargs = {"target": yk} if self.num_stages - 1 in self.local else {}
            if train:
                schedule.step(*args, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, **kwargs)
        self.recorder.mb_offset = 0
        expected = self.micro_batches if self.rank == self.last_rank else 0
        if len(self._nll) != expected:
            raise RuntimeError(f"the last stage computed {len(self._nll)} micro-batch losses, expected {expected}")

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """logits (T, b, V), target (b, T) batch-first -> nll_sum / batch tokens (a scalar)."""
        nll = nll_sum(logits, target.t())
        self._nll.append(nll.detach())
        loss = nll * self._scale
        self.recorder.extend_forward(self.recorder.now())
        return loss

    def _schedule(self, shape: tuple[int, int], train: bool):
        """The cached stages and schedule for one (B, T) input shape (static shapes: see the module doc)."""
        key = (shape[1], shape[0], train)     # (T, B, train), as a learner reads batch shapes
        if key not in self._cache:
            B, T = shape
            n = self.plan.per_call
            b = B // n
            stages = []
            for s in self.local:
                if s == 0:
                    x = torch.empty((b, T), dtype=torch.long, device=self.device)          # token ids
                else:
                    x = torch.empty((T, b, self.widths[s - 1]), dtype=self.dtype, device=self.device,
                                    requires_grad=True)
                y = torch.empty((T, b, self.widths[s]), dtype=self.dtype, device=self.device, requires_grad=True)
                stages.append(_TimedStage(self.modules[s], s, self.num_stages, self.device, input_args=x,
                                          output_args=y, recorder=self.recorder, position=self._position))
            try:
                schedule = self.plan.cls(stages if self.plan.multi else stages[0], n, loss_fn=self._loss,
                                         scale_grads=False)
            except ValueError as e:   # plan_schedule checks what we know of; name the class if torch finds more
                raise ValueError(f"torch's {self.plan.cls.__name__} refuses {n} micro-batches on {self.world} "
                                 f"ranks: {e}") from e
            self._cache[key] = (stages, schedule)
        return self._cache[key][1]

    def _clip_grad_norm(self, max_norm: float) -> float:
        """clip_grad_norm_ over the whole model: each rank holds some gradients, so sum the squares."""
        grads = [p.grad for p in self.params if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            local += torch.linalg.vector_norm(g).float() ** 2
        dist.all_reduce(local)
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.item()

    def gather_state_dict(self, dst: int = 0) -> dict | None:
        """The whole model's weights on rank `dst` (None elsewhere): each rank sends its layers'."""
        own = {k: v.detach().cpu() for k, v in self.model.state_dict().items()
               if k.split(".")[1] in self.owned}
        parts = [None] * self.world if self.rank == dst else None
        dist.gather_object(own, parts, dst=dst)
        if self.rank != dst:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    def owned_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients by parameter name (layers.<layer>.<...>), on the CPU."""
        return {name: p.grad.detach().cpu().clone() for name, p in self.model.named_parameters()
                if name.split(".")[1] in self.owned and p.grad is not None}


def _merge(gathered, devices: list[str]) -> Timeline:
    """Every rank's events into one Timeline starting at 0."""
    events = [(r, e) for r, (_, evs) in enumerate(gathered) for e in evs]
    t0 = min((e[3] for _, e in events), default=0.0)
    timeline = Timeline(list(devices))
    for r, (kind, stage, mb, start, end, nbytes, peer) in events:
        timeline.add(Event(device=devices[r], kind=kind, stage=stage, mb=mb, start=start - t0, end=end - t0,
                           bytes=nbytes, peer=peer))
    return timeline


# -- process group ----------------------------------------------------------------------

_ROUND_ROBIN_HINT = ("Round-robin means: cut the layers into v * p consecutive groups and give group k to "
                     "rank k % p; for 2 ranks and 4 groups: 'G0:rank0 | G1:rank1 | G2:rank0 | G3:rank1', "
                     "where G0..G3 are runs of your model's layers (see model.layer_names)")


_heartbeat: Heartbeat | None = None       # this process's watchdog, started by setup()


def setup(backend: str = "auto", timeout: float = TIMEOUT, heartbeat: float = HEARTBEAT) -> tuple[int, int, torch.device]:
    """init_process_group from torchrun's environment: (rank, world size, this rank's device).

    gloo on CPU; NCCL on `cuda:LOCAL_RANK` when every process of the node has a GPU of its own
    (see `choose_backend`). `timeout` bounds every
    wait on a peer, so a rank whose peer died exits with an error instead of hanging. `heartbeat`
    (seconds, 0 for none) ends every rank, naming the silent one, once a peer stops (mpedu.heartbeat).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("mpedu.distributed runs under torchrun, which starts one process per device: "
                           "torchrun --nproc-per-node 2 -m mpedu.distributed train")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = choose_backend(backend, local_world, torch.cuda.device_count())
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # the device binds NCCL's communicator to this rank's GPU at once (no guessing from the rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
    global _heartbeat
    if heartbeat and _heartbeat is None and "MASTER_ADDR" in os.environ:
        _heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size(), heartbeat).start()
    return dist.get_rank(), dist.get_world_size(), device


def choose_backend(backend: str, local_world: int, gpus: int) -> str:
    """"nccl" or "gloo" for `--backend auto|nccl|gloo`, the same on every rank of a node.

    The choice depends only on what all the node's ranks see alike: how many processes torchrun
    started here (LOCAL_WORLD_SIZE) and how many GPUs there are. NCCL when every process gets a GPU
    of its own, else gloo on the CPU for all. (Deciding per rank, "is there a GPU for my local
    rank", gave two processes on one GPU NCCL on rank 0 and gloo on rank 1: the first barrier hung.)
    Nodes with different GPU counts can still choose differently: pass the backend explicitly.
    """
    if backend == "auto":
        return "nccl" if 0 < local_world <= gpus else "gloo"
    if backend == "nccl" and local_world > gpus:
        fewer = f"start at most {gpus} per node (--nproc-per-node) or " if gpus else ""
        raise RuntimeError(f"--backend nccl gives each process its own GPU, but torchrun started {local_world} "
                           f"processes on this node and it has {gpus} GPU(s): {fewer}use --backend gloo")
    return backend


# -- command line -----------------------------------------------------------------------

EXAMPLES = """\
examples (one machine, 2 processes on the CPU; gloo):
  torchrun --nproc-per-node 2 -m mpedu.distributed train --limit-batches 20 --epochs 1
  torchrun --nproc-per-node 2 -m mpedu.distributed train --schedule 1f1b --micro-batches 8
  torchrun --nproc-per-node 2 -m mpedu.distributed train --placement "embed,lstm0:vgpu0 | lstm1,decode:vgpu1"
  torchrun --nproc-per-node 2 -m mpedu.distributed check --schedule gpipe,1f1b
two nodes with 4 GPUs each (NCCL), run on both nodes:
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id lm \\
      -m mpedu.distributed train --config mxnet8 --data path/to/ptb
"""

PLACEMENT_HELP = ("layers to devices, e.g. \"embed,lstm0:vgpu0 | lstm1,decode:vgpu1\". Device names are labels: "
                  "the k-th distinct device (in order of first appearance) is rank k, so the placement must name "
                  "exactly as many devices as torchrun starts processes (default: the layers split evenly over "
                  "all ranks)")


def _add_pipeline_options(parser, schedule_help: str) -> None:
    group = parser.add_argument_group("pipeline (one process per device)")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--devices", type=_positive_int, metavar="N",
                       help="split the layers evenly over N devices = N processes; must equal torchrun's "
                            "process count (the default)")
    where.add_argument("--placement", metavar="STR", help=PLACEMENT_HELP)
    group.add_argument("--schedule", default="gpipe", help=schedule_help)
    group.add_argument("--micro-batches", type=_positive_int, default=4, metavar="M",
                       help="micro-batches per batch (default: 4); the batch size must be a multiple of M")
    group.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                       help="auto: NCCL on cuda:LOCAL_RANK when every process on the node has a GPU of its "
                            "own, else gloo on the CPU for all")
    group.add_argument("--timeout", type=_positive_float, default=TIMEOUT, metavar="S",
                       help=f"seconds a rank waits for a busy peer before failing (default: {TIMEOUT}); with "
                            "torchrun, a failing rank also makes torchrun stop the others at once")
    group.add_argument("--heartbeat", type=_non_negative_float, default=HEARTBEAT, metavar="S",
                       help=f"a peer that gives no sign of life (stopped, hung, its machine gone) for S seconds "
                            f"ends every rank with a line naming it; 0: no watchdog (default: {HEARTBEAT:g})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m mpedu.distributed",
        description="mpedu's model, placement and schedule on torch.distributed.pipelining, one process per "
                    "device. Shapes must be static there: one schedule is built (and cached) per bucket length.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,check}")

    t = commands.add_parser("train", help="train the language model, like `python -m mpedu train`",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="Train; rank 0 prints one line per epoch and writes model.pt and "
                                        "timeline.json (the last step, every rank) in --out. Not offered: "
                                        "--bptt (state cannot cross ranks), --resume, and --link (the ranks' "
                                        "link is real: gloo or NCCL).")
    add_training_options(t, clip_over="all ranks' gradients")
    t.add_argument("--out", default="runs/distributed", metavar="DIR",
                   help="where rank 0 writes model.pt and timeline.json (default: runs/distributed)")
    t.add_argument("--limit-batches", type=_positive_int, metavar="N",
                   help="use only the first N batches of each split per epoch: a quick run")
    t.add_argument("--json", action="store_true", help="rank 0 prints a JSON summary as the last line")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (rank 0, stderr)")
    _add_pipeline_options(t, "gpipe, 1f1b, interleaved, zb1 or naive (default: gpipe)")

    c = commands.add_parser("check", help="one step: are loss and gradients those of one process?",
                            description="Run one training step on one batch of the corpus and compare loss "
                                        "and every gradient with the whole model in one process (dropout "
                                        "masks are positional, so --dropout P is compared too). With --out, "
                                        "every rank writes its gradients there.")
    c.add_argument("--data", metavar="DIR", help="corpus folder (default: the embedded corpus)")
    c.add_argument("--config", choices=list(CONFIGS), default=CONFIG)
    c.add_argument("--batch-size", type=_positive_int, default=16, metavar="B")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability of the model (default: 0); the masks are positional, so any P "
                        "gives the one-process numbers")
    c.add_argument("--out", metavar="DIR", help="write grads-<schedule>-rank<r>.pt, check.json and the "
                   "inputs (check-init.pt, check-batch.pt) here")
    _add_pipeline_options(c, "one or more, comma-separated, e.g. gpipe,1f1b (default: gpipe)")
    return parser


def _placement_arg(args, world: int):
    if args.devices is not None and args.devices != world:
        raise ValueError(f"--devices {args.devices} but torchrun started {world} processes: one process per "
                         f"device, so pass --nproc-per-node {args.devices} (or drop --devices)")
    return args.placement


def _say(rank: int):
    return print if rank == 0 else (lambda *a, **k: None)


def _write_timeline(timeline: Timeline, out: Path, name: str = "timeline") -> list[str]:
    """timeline.json, plus a Chrome trace and a picture when timeline.py offers them."""
    written = [f"{name}.json"]
    timeline.to_json(out / f"{name}.json")
    if hasattr(timeline, "to_chrome_trace"):
        timeline.to_chrome_trace(out / f"{name}.trace.json")
        written.append(f"{name}.trace.json")
    if hasattr(timeline, "plot"):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        drawn = timeline.plot()
        figure = getattr(drawn, "figure", drawn)
        if hasattr(figure, "savefig"):
            figure.savefig(out / f"{name}.png", dpi=100)
            written.append(f"{name}.png")
            plt.close(figure)
    return written


def run_train(args) -> int:
    from .data import load_corpus
    from .model import LSTMLM
    rank, world, device = setup(args.backend, args.timeout, args.heartbeat)
    say = _say(rank)
    apply_recipe(args, say)
    corpus = load_corpus(args.data)          # every rank reads the data: same batches, same order
    torch.manual_seed(args.seed)
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab))
    pipe = DistributedPipeline(model, _placement_arg(args, world), args.schedule, args.micro_batches,
                               device=device, clip=args.clip or None, width=args.batch_size)
    say(f"mpedu.distributed train: {args.config} model on {corpus.name} ({len(corpus.vocab):,} words); "
        f"{world} processes ({dist.get_backend()}, {device.type}); placement {pipe.placement}; schedule "
        f"{pipe.plan.schedule} -> {pipe.plan.cls.__name__}, {args.micro_batches} micro-batches")
    history = fit(
        model, corpus, runner=pipe, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, clip=None,
        seed=args.seed, out=None, limit_batches=args.limit_batches, log=say,
        progress=rank == 0 and not args.no_progress and sys.stderr.isatty())
    state = pipe.gather_state_dict()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        model.load_state_dict(state)
        save_model(out / "model.pt", model, corpus.vocab, placement=str(pipe.placement))
        written = ["model.pt"]
        if pipe.last_timeline is not None:
            written += _write_timeline(pipe.last_timeline, out)
            say(pipe.last_timeline.summary())
        say(f"wrote {', '.join(written)} in {out}")
        if args.json:
            summary = {"config": args.config, "data": corpus.name, **history.summary(),
                       "batch_size": args.batch_size, "seed": args.seed, "out": str(out), "runner": "distributed",
                       "world_size": world, "backend": dist.get_backend(), "devices": pipe.devices,
                       "placement": str(pipe.placement), "schedule": pipe.plan.schedule,
                       "torch_schedule": pipe.plan.cls.__name__, "micro_batches": args.micro_batches,
                       "shapes": len(pipe.shapes), "bubble_fraction_over": "mean of all training steps"}
            print(json_line(summary))
    dist.barrier()
    pipe.close()
    dist.destroy_process_group()
    return 0


def run_check(args) -> int:
    """One step per schedule; rank 0 compares loss and gradients with the whole model in one process."""
    import copy

    from .bucketing import BucketIterator
    from .data import load_corpus
    from .model import LSTMLM
    rank, world, device = setup(args.backend, args.timeout, args.heartbeat)
    say = _say(rank)
    if device.type == "cuda":
        # The comparison claims equality up to fp32 rounding: cuDNN's LSTM (and cuBLAS, where enabled)
        # would otherwise multiply in TF32, whose 10-bit mantissa differs from the CPU by ~1e-3.
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        say("TF32 off for this check (cuDNN and cuBLAS multiply in plain fp32), so the GPUs can be compared "
            "with the CPU reference")
    schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
    if not schedules:
        raise ValueError("--schedule names no schedule; e.g. --schedule gpipe,1f1b")
    placement = _placement_arg(args, world)
    corpus = load_corpus(args.data)
    torch.manual_seed(args.seed)
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout {args.dropout}: expected a probability, 0 <= P < 1")
    # positional dropout masks (mpedu.dropout): the ranks draw the one-process masks, so --dropout is exact too
    model = LSTMLM.from_config(args.config, vocab_size=len(corpus.vocab), dropout=args.dropout)
    batch = next(iter(BucketIterator(corpus.train, args.batch_size, seed=args.seed)))  # has padding
    out = Path(args.out) if args.out else None
    if rank == 0:
        reference = copy.deepcopy(model)
        one = SingleDevice(reference)          # the reference runner: its dropout masks at (seed, step 0)
        one.dropout_seed = args.seed
        ref_loss = torch.tensor(one.train_step(batch).loss, dtype=torch.float64)
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        if out:   # what the ranks start from, so a test can compute the reference itself
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"state": model.state_dict(), "config": model.config.to_dict(),
                        "vocab_size": model.vocab_size, "seed": args.seed}, out / "check-init.pt")
            torch.save({"inputs": batch.inputs, "targets": batch.targets}, out / "check-batch.pt")
    dist.barrier()
    # a GPU's kernels (cuDNN LSTM) sum in other orders than the CPU reference
    rtol, atol = (1e-3, 1e-5) if device.type == "cuda" else (1e-5, 1e-7)
    report, ok = {}, True
    for name in schedules:
        model.zero_grad(set_to_none=True)
        pipe = DistributedPipeline(model, placement, name, args.micro_batches, device=device)
        pipe.dropout_seed = args.seed
        result = pipe.train_step(batch)
        grads = pipe.owned_grads()
        if out:
            torch.save(grads, out / f"grads-{name}-rank{rank}.pt")
        parts = [None] * world if rank == 0 else None
        dist.gather_object(grads, parts, dst=0)
        if rank == 0:
            merged = {k: v for part in parts for k, v in part.items()}
            missing = sorted(set(ref_grads) - set(merged))
            worst, where = max(((merged[k] - ref_grads[k]).abs().max().item(), k) for k in merged)
            equal = (not missing and math.isclose(result.loss, ref_loss.item(), rel_tol=10 * rtol)
                     and all(torch.allclose(merged[k], ref_grads[k], rtol=rtol, atol=atol) for k in merged))
            ok &= equal
            report[name] = {"torch_schedule": pipe.plan.cls.__name__, "loss": result.loss,
                            "single_process_loss": ref_loss.item(), "max_abs_grad_diff": worst,
                            "worst_parameter": where, "missing_grads": missing, "equal": equal,
                            "bubble_fraction": result.timeline.bubble_fraction}
            say(f"{name:>11} ({pipe.plan.cls.__name__}): loss {result.loss:.7f}, one process {ref_loss.item():.7f}; "
                f"max |grad diff| {worst:.2e} ({where})"
                + (f"; no gradient for {', '.join(missing)}" if missing else "") + ("  OK" if equal else "  DIFFERENT"))
            say("  " + result.timeline.summary().replace("\n", "\n  "))
            if out:
                _write_timeline(result.timeline, out, f"timeline-{name}")
        pipe.close()
    if rank == 0 and out:
        (out / "check.json").write_text(json.dumps({"world_size": world, "placement": str(pipe.placement),
                                                    "micro_batches": args.micro_batches, "tokens": batch.tokens,
                                                    "schedules": report}, indent=2))
    verdict = torch.tensor([int(ok)], device=device)
    dist.broadcast(verdict, src=0)        # every rank exits 1 when the results differ
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print(f"mpedu.distributed: error: start it with torchrun, one process per device, e.g.\n"
              f"  torchrun --nproc-per-node 2 -m mpedu.distributed {args.command}\n"
              "(for the in-process pipeline on virtual devices, use `python -m mpedu train`)", file=sys.stderr)
        return 2
    try:
        return run_check(args) if args.command == "check" else run_train(args)
    except ValueError as e:   # a placement, schedule or size the pipeline cannot run: every rank says why
        print(f"mpedu.distributed: error (rank {os.environ.get('RANK', '?')}): {e}", file=sys.stderr)
        return 2
    except dist.DistError as e:   # a peer failed or timed out: one line, not the backend's traceback
        first = (str(e).splitlines() or [""])[0][:300]
        print(f"mpedu.distributed: error (rank {os.environ.get('RANK', '?')}): talking to the other ranks failed "
              f"({e.__class__.__name__}: {first}); see the other ranks' messages for the cause", file=sys.stderr)
        return 1
    finally:
        if _heartbeat is not None:
            _heartbeat.stop()


if __name__ == "__main__":
    sys.exit(main())
