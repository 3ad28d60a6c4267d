"""DistributedPipeline: this rank's share of the model, trained by torch.distributed.pipelining.

Static shapes. A PipelineStage allocates its receive buffers once, for one input
shape, so every step must bring the shape it was built for. Bucketing gives
batches of several lengths T (and a bucket's last batch may be narrower). We build
one stage set and schedule per shape and cache them: MXNet's "one unrolled graph per
bucket", no compute wasted on padding, and with static metadata a new shape costs
no extra forward pass, only its buffers. Narrow batches are widened with empty
columns to the batch size, so there is one shape per bucket length.

Loss. The last stage's loss is nll_sum(micro-batch) / (real tokens in the whole
batch) and PyTorch's own scaling is off, so micro-batch losses add up to the
batch's mean NLL per token and the gradients equal the single-process model's.

Data parallel x pipeline. With `pipeline_devices` p < world size, the world is
world / p replicas of one p-rank pipeline (mpedu.distributed.group.Mesh). Replica r
trains columns [r B/R, (r+1) B/R) of every batch, still scaled by the whole batch's
tokens, so summing the replicas' gradients (one all-reduce per step over the ranks
that hold the same stages) gives the whole batch's gradient. Dropout masks are
positional (mpedu.lm.dropout): each micro-batch draws the slice of the one-process
masks at its columns, so every layout gives the one-process numbers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.placement import Placement
from ..core.runner import BaseRunner, StepResult, fit_width
from ..core.schedules import Schedule
from ..core.timeline import ALL_REDUCE
from ..lm import dropout
from ..lm.model import nll_sum
from ..training.faults import Fault, all_finite, first_of
from .bridge import RUNTIME, ActionListSchedule, resolve
from .group import mesh as make_mesh
from .native import plan_schedule
from .placement import rank_placement
from .stages import StageModule, TimedStage, out_width
from .timing import Recorder, merge, shared_origin


class DistributedPipeline(BaseRunner):
    """This rank's share of a model, trained with a torch.distributed.pipelining runtime.

    Call in every rank, after init_process_group, with the same model (same seed),
    placement and schedule; every rank then calls train_step/eval_step on the same
    batches in the same order. It is a Runner (mpedu.core.runner), so
    `mpedu.train(model, corpus, runner=pipe, ...)` trains with it: train's clip goes through
    `clip_grad_norm`, over all ranks' gradients. clip= here clips inside every train_step instead
    (for a loop of your own).

    schedule: a name (built by mpedu.core.schedules.make) or any Schedule that validates, e.g.
    one written by hand; its action lists run as they are (mpedu.distributed.bridge).
    runtime="torch" runs PyTorch's own class for a schedule name instead (native.plan_schedule).
    pipeline_devices: ranks per pipeline; the world holds world / pipeline_devices replicas.
    width: widen every batch to this many columns (the batch size), so each bucket
    length gives one shape and one cached schedule.
    """

    def __init__(self, model, placement: str | Placement | None = None, schedule: str | Schedule = "gpipe",
                 micro_batches: int = 4, *, device: torch.device | str | None = None, clip: float | None = None,
                 width: int | None = None, record: bool = True, pipeline_devices: int | None = None,
                 runtime: str = "mpedu"):
        if isinstance(micro_batches, (list, tuple)):
            # asked first, before any process group: the answer is the same in every rank
            raise ValueError(f"micro_batches={list(micro_batches)}: torchrun's pipeline runs on torch.distributed."
                             "pipelining, whose stages allocate their receive buffers once for one static shape, "
                             "so every micro-batch must be as wide as the others; give a count (micro_batches=4). "
                             "Unequal micro-batches run on virtual devices: mpedu.Pipeline(model, placement, "
                             "schedule, micro_batches=[8, 16, 24, 16])")
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group (or mpedu.distributed.setup) first; "
                               "launch with torchrun --nproc-per-node N -m mpedu.distributed ...")
        if runtime not in ("mpedu", "torch"):
            raise ValueError(f"runtime={runtime!r}: 'mpedu' (mpedu's action lists in torch's runtime) or "
                             "'torch' (PyTorch's own schedule class for the name)")
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = make_mesh(pipeline_devices)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.placement = rank_placement(model, placement, self.mesh.pipeline, schedule)   # None: even, or the V
        self.placement.check_tied_weights(model)
        self.stage_ranks = self.placement.stage_devices          # stage s runs in pipeline rank stage_ranks[s]
        self.micro_batches = micro_batches
        if runtime == "torch":
            if not isinstance(schedule, str):
                raise ValueError("runtime='torch' takes a schedule name; a Schedule runs with runtime='mpedu'")
            self.plan = plan_schedule(schedule, self.stage_ranks, micro_batches)
            self.per_call, self.schedule_name = self.plan.per_call, self.plan.schedule
            self.torch_schedule, self.actions = self.plan.cls.__name__, None
        else:
            self.plan, self.actions = None, resolve(schedule, self.stage_ranks, micro_batches)
            self.per_call, self.schedule_name = micro_batches, self.actions.name
            self.torch_schedule = RUNTIME.__name__
        self.runtime = runtime
        split = self.mesh.replicas * micro_batches
        if width is not None and width % split:
            raise ValueError(f"the batch size {width} must be a multiple of {self.mesh.replicas} replica(s) x "
                             f"{micro_batches} micro-batches = {split}: torch's pipelining splits every batch "
                             "into equal micro-batches of one static shape")
        self.width, self.clip = width, clip
        runs = self.placement.stages
        self.num_stages = len(runs)
        self.last_rank = self.mesh.global_rank(self.mesh.replica, self.stage_ranks[-1])
        self.local = [s for s, r in enumerate(self.stage_ranks) if r == self.mesh.pipeline_rank]
        self.modules: dict[int, StageModule] = {}
        self.widths: list[int] = []                               # output features of each stage
        for s, (_, names) in enumerate(runs):
            self.widths.append(out_width(names[-1], model.layers[names[-1]]))
            if s in self.local:
                self.modules[s] = StageModule(names, [model.layers[n] for n in names]).to(self.device)
        self.owned = [name for s in self.local for name in runs[s][1]]
        # each weight once: a tied one (embed and decode on this rank) would count twice in the clip's norm
        # and be scaled twice by it
        self._weights = list({id(p): p for s in self.local for p in self.modules[s].parameters()}.values())
        self.dtype = next(model.parameters()).dtype
        self.recorder = Recorder(self.device, shared_origin())   # one time axis for every rank's row
        self.recorder.enabled = record
        self._cache: dict[tuple, tuple] = {}
        self._nll: list[torch.Tensor] = []
        self._scale = 1.0
        self.last_timeline = None
        self.bad_before_clip: list[str] | None = None     # this rank's layers with non-finite gradients, before a clip
        # Positional dropout (mpedu.lm.dropout), as Pipeline and SingleDevice: train() sets both
        self.dropout_seed, self.dropout_step = 0, 0
        self._key: dropout.Position | None = None     # this step's, while it trains
        self._micro_width = self._first_column = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """This rank's weights that train now (a layer frozen or thawed after the pipeline was built counts as
        it is at the step: clipped and all-reduced, or not)."""
        return [p for p in self._weights if p.requires_grad]

    # -- runner interface ----------------------------------------------------------
    @property
    def devices(self) -> list[str]:
        return [f"rank:{r}" for r in range(self.world)]

    @property
    def schedule(self) -> str:
        return self.schedule_name

    @property
    def replicas(self) -> int:
        return self.mesh.replicas

    def __repr__(self) -> str:
        dp = f", {self.mesh.replicas} replicas" if self.mesh.replicas > 1 else ""
        return (f"DistributedPipeline({self.placement}, schedule={self.schedule_name} -> {self.torch_schedule}, "
                f"micro_batches={self.micro_batches}{dp}, rank {self.rank}/{self.world})")

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
        the step's Timeline with every rank's actions, the all-reduce included.
        """
        if getattr(batch, "carry_state", False):
            raise ValueError("stream mode (carry_state batches, --bptt) is not supported by mpedu.distributed: "
                             "stage outputs must be tensors, so (h, c) cannot be carried; use bucketed batches")
        for module in self.modules.values():
            module.train()
        batch, tokens = self._prepare(batch)
        self.bad_before_clip = None
        self.recorder.start_step()
        self._key = dropout.Position(self.dropout_seed, self.dropout_step)
        try:
            self._run(batch, tokens, train=True)
        finally:
            self._key = None
        self.dropout_step += 1
        if self.mesh.replicas > 1:
            self._note_bad_layers()          # the all-reduce spreads a NaN to the other replicas' layers
            self._all_reduce_grads()
        if self.clip:
            self.clip_grad_norm(self.clip)
        events = self.recorder.events() if self.recorder.enabled else []
        nll = float(sum(t.double().item() for t in self._nll)) if self.rank == self.last_rank else None
        finite = all_finite([p.grad for p in self.params if p.grad is not None])
        if not finite:
            self._note_bad_layers(finite=False)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, (nll, events, finite))   # the loss lives on the last ranks; events on each
        nll = sum(part[0] for part in gathered if part[0] is not None)
        everywhere = all(part[2] for part in gathered)
        if finite and not everywhere:
            # another rank's gradients are not finite: the step must fail here too, or this rank would step
            # on while that one stops, and wait for it until --timeout
            for p in self.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            self.bad_before_clip = []
        timeline = None
        if self.recorder.enabled:
            timeline = merge([part[1] for part in gathered], self.devices)
            self.last_timeline = timeline
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens, timeline=timeline, finite=everywhere)

    @torch.no_grad()
    def eval_step(self, batch) -> StepResult:
        """Forward only, dropout off; the last ranks' summed NLL is added up over all ranks."""
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
        dist.all_reduce(total)
        nll = total.item()
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens)

    # -- pieces --------------------------------------------------------------------
    def _prepare(self, batch):
        """Widen the batch with empty columns (no tokens, no gradient) to the fixed width and a multiple
        of replicas x micro-batches; (the whole batch, its real tokens)."""
        if self.width and batch.inputs.shape[1] < self.width:
            batch = fit_width(batch, self.width)                 # B < width: exactly width - B empty columns
        batch = fit_width(batch, self.mesh.replicas * self.micro_batches)
        tokens = int(batch.tokens)
        if tokens == 0:
            raise ValueError("the batch has no real (non-padding) target tokens")
        return batch, tokens

    def _position(self, mb: int) -> dropout.Position | None:
        """Micro-batch `mb` of the current step() call: its first column in the whole batch."""
        if self._key is None:
            return None
        column = self._first_column + (self.recorder.mb_offset * self.per_call + mb) * self._micro_width
        return self._key.at(sequence=column)

    def _run(self, batch, tokens: int, train: bool) -> None:
        self._nll.clear()
        cols = batch.inputs.shape[1] // self.mesh.replicas                 # this replica's columns
        self._first_column = self.mesh.replica * cols
        self._micro_width = cols // self.micro_batches
        self._scale = 1.0 / tokens if train else 1.0
        # torch's step() splits its arguments along dim 0, so hand it batch-first (b, T) tensors;
        # the first stage turns them back to time-major. Torch's naive: m calls of one micro-batch.
        part = slice(self._first_column, self._first_column + cols)
        x = batch.inputs[:, part].t().contiguous().to(self.device)         # (cols, T)
        y = batch.targets[:, part].t().contiguous().to(self.device)
        pieces = x.chunk(self.micro_batches) if self.per_call == 1 and self.micro_batches > 1 else [x]
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
        """The cached stages and schedule for one (b, T) input shape (static shapes: see the module doc)."""
        key = (shape[1], shape[0], train)     # (T, B, train), as a learner reads batch shapes
        if key not in self._cache:
            B, T = shape
            n = self.per_call
            b = B // n
            stages = []
            for s in self.local:
                if s == 0:
                    x = torch.empty((b, T), dtype=torch.long, device=self.device)          # token ids
                else:
                    x = torch.empty((T, b, self.widths[s - 1]), dtype=self.dtype, device=self.device,
                                    requires_grad=True)
                y = torch.empty((T, b, self.widths[s]), dtype=self.dtype, device=self.device, requires_grad=True)
                stages.append(TimedStage(self.modules[s], s, self.num_stages, self.device, input_args=x,
                                         output_args=y, group=self.mesh.pp, recorder=self.recorder,
                                         position=self._position))
            if self.plan is None:
                schedule = ActionListSchedule(stages, self.actions, loss_fn=self._loss)
            else:
                try:
                    schedule = self.plan.cls(stages if self.plan.multi else stages[0], n, loss_fn=self._loss,
                                             scale_grads=False)
                except ValueError as e:   # plan_schedule checks what we know of; name the class if torch finds more
                    raise ValueError(f"torch's {self.plan.cls.__name__} refuses {n} micro-batches on "
                                     f"{self.mesh.pipeline} ranks: {e}") from e
            self._cache[key] = (stages, schedule)
        return self._cache[key][1]

    def _all_reduce_grads(self) -> None:
        """Sum this rank's gradients over the replicas (one flat buffer, one all-reduce), recorded in the timeline."""
        params = self.params
        if not params:           # every layer here is frozen, on every replica of this stage: nothing to sum
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        start = self.recorder.now()
        dist.all_reduce(flat, group=self.mesh.dp)
        self.recorder.add(ALL_REDUCE, self.local[0], 0, start, self.recorder.now(),
                          flat.numel() * flat.element_size(), "replicas")
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def clip_grad_norm(self, max_norm: float) -> float:
        """clip_grad_norm_ over the whole model: each rank of a pipeline holds some gradients, so sum the squares
        over the pipeline (after the all-reduce every replica holds the same gradients). A collective: every
        rank calls it. Returns the norm before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            local += torch.linalg.vector_norm(g).float() ** 2
        # the clip is about to spread a NaN to every layer: note where it was (the norm says whether there is one)
        self._note_bad_layers(finite=bool(torch.isfinite(local)))
        dist.all_reduce(local, group=self.mesh.pp)
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.item()

    def _note_bad_layers(self, finite: bool | None = None) -> None:
        """Before a collective that mixes gradients: this rank's non-finite layers ([] when none), unless
        noted already (the first collective saw them as they came out of the backward). `finite`: whether
        every gradient here is, when the caller knows; else one check over them all (a step's usual case
        costs no per-layer search)."""
        if self.bad_before_clip is None:
            if finite is None:
                finite = all_finite([p.grad for p in self.params if p.grad is not None])
            self.bad_before_clip = [] if finite else self._bad_layers()

    def _bad_layers(self) -> list[str]:
        """This rank's layers whose gradients hold a NaN or inf."""
        return [name for s in self.local for name, layer in zip(self.modules[s].names, self.modules[s].layers)
                if any(p.grad is not None and not all_finite([p.grad]) for p in layer.parameters())]

    def agree_on_fault(self, fault: Fault) -> Fault:
        """Every rank's finding in its own layers (mpedu.training.faults.find_fault), gathered: the same fault on all."""
        found = [None] * self.world
        dist.all_gather_object(found, fault)
        return first_of(found, self.model.layer_names)

    def gather_state_dict(self, dst: int = 0) -> dict | None:
        """The whole model's weights on rank `dst` (None elsewhere): each rank sends its layers'."""
        own = {k: v.detach().cpu() for k, v in self.model.state_dict().items()
               if k.split(".")[1] in self.owned} if self.mesh.replica == 0 else {}
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
