"""The runner contract: what one step reports, which batches a runner accepts, and the protocol (with
its defaults, BaseRunner) SingleDevice, Pipeline and the torchrun pipeline share. The ground floor: executors import this,
never the training loop."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from ..lm.data import PAD_ID
from .schedules import Schedule, ScheduleError


class StepInterrupted(KeyboardInterrupt):
    """Ctrl-C (Jupyter's Kernel > Interrupt) stopped a step. Still a KeyboardInterrupt, so whoever stops on
    Ctrl-C still does; its one line says what a learner needs to know."""

    def __str__(self) -> str:
        return ("the step was interrupted; the pipeline is ready for the next one. The backwards that ran before "
                "the interrupt added into .grad: zero the gradients before the next step")


@dataclass
class StepResult:
    """What one training or evaluation step reports; gradients stay in the model."""

    loss: float                  # nll_sum / tokens for this batch
    nll_sum: float
    tokens: int
    timeline: object | None = None
    # False: some gradient of the model is not finite, perhaps on another process (a rank whose layers are
    # all frozen has no gradient to see it in), so no process may step
    finite: bool = True


@runtime_checkable
class Runner(Protocol):
    """What the training loop and the fault search use from whatever runs a step (one device, threads,
    or torchrun ranks): every member, so that none is probed for (a renamed one would silently take a
    default). BaseRunner gives the defaults; SingleDevice, Pipeline and DistributedPipeline build on it.

    train_step accumulates the mean NLL's gradients into the model's `.grad` (the caller zeroes
    them and steps the optimizer); eval_step computes without gradients. Both refuse a batch
    check_batch refuses. reset_state forgets recurrent state carried between batches (stream mode).
    Dropout masks are those of mpedu.lm.dropout's Position(dropout_seed, dropout_step); a train_step
    counts dropout_step up, and the loop sets it from the global step so a resumed run matches.
    """

    model: object
    placement: object            # a Placement (where the layers sit), or None on one device
    device: object               # a one-device runner's torch device, or None (read from the weights)
    micro_batches: int           # the pieces a batch is split into (its width must divide by it)
    micro_batch_sizes: tuple | None  # unequal pieces' widths, side by side (their sum is the batch width); None:
                                 # micro_batches equal ones
    chunks: int                  # time chunks per micro-batch (the wavefront)
    owned: list | None           # the layers this process holds (a torchrun rank), None: every layer
    world: int                   # processes taking part in a step
    clip: float | None           # a gradient clip the runner applies itself in every train_step
    bad_before_clip: list | None  # a torchrun rank's layers whose gradients were not finite before its clip
    carries_state: bool          # stream mode resumes exactly: carried_state / load_carried_state work
    dropout_seed: int
    dropout_step: int

    def train_step(self, batch) -> StepResult: ...

    def eval_step(self, batch) -> StepResult: ...

    def reset_state(self) -> None: ...

    def carried_state(self) -> dict | None: ...

    def load_carried_state(self, state: dict | None) -> None: ...

    def clip_grad_norm(self, max_norm: float) -> None: ...

    def agree_on_fault(self, found): ...

    def close(self) -> None: ...


class BaseRunner:
    """The defaults of the Runner contract: a runner of the whole model in one process."""

    placement = None
    device = None
    micro_batches = 1
    micro_batch_sizes = None
    chunks = 1
    owned = None
    world = 1
    clip = None
    bad_before_clip = None
    carries_state = False
    dropout_seed = 0
    dropout_step = 0

    def reset_state(self) -> None:
        pass

    def carried_state(self) -> dict | None:
        return None

    def load_carried_state(self, state: dict | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} carries no recurrent state between batches")

    def clip_grad_norm(self, max_norm: float) -> None:
        """Scale the gradients so that their norm over the whole model is at most max_norm."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def agree_on_fault(self, found):
        """The fault every process names (one process: its own)."""
        return found

    def close(self) -> None:
        pass


def check_carried(state, model) -> int:
    """Refuse a carried recurrent state (a runner's carried_state, perhaps read from a checkpoint) that is not
    {recurrent layer of `model`: tensors (1, B, H) of one width B}; return B."""
    widths = set()
    if not isinstance(state, dict):
        raise TypeError(f"a carried state is a dict {{layer: (h, c)}}, got {type(state).__name__}")
    for name, tensors in state.items():
        if name not in model.layer_names or not isinstance(tensors, (tuple, list)) or not tensors or not all(
                torch.is_tensor(t) and t.is_floating_point() and t.dim() == 3 and t.shape[0] == 1 for t in tensors):
            raise ValueError(f"the carried state of {name!r} is not (1, B, H) tensors of a layer of this model")
        widths |= {t.shape[1] for t in tensors}
    if len(widths) != 1:
        raise ValueError(f"the carried state's layers are {sorted(widths)} sequences wide; one width expected")
    return widths.pop()


def check_batch(batch, vocab_size: int) -> int:
    """Refuse a batch the model cannot read, naming what is wrong, before torch fails deep inside;
    return its real (non-padding) target tokens. Two parts, each where a Pipeline needs it: `check_inputs`
    (the caller, before any worker runs) and `count_targets` (the last stage's worker, while the first computes)."""
    check_inputs(batch, vocab_size)
    return count_targets(batch, vocab_size)


def check_inputs(batch, vocab_size: int) -> None:
    """The batch's fields, their shapes and dtypes, and the input ids' range: what stage 0 must read (on a GPU
    an id outside the vocabulary stops the device, not only the step). A min-and-max pass."""
    inputs, targets, mask = (getattr(batch, k, None) for k in ("inputs", "targets", "mask"))
    if not all(torch.is_tensor(t) for t in (inputs, targets, mask)):
        fields = {"inputs": inputs, "targets": targets, "mask": mask}
        wrong = ", ".join(f"{k} is {type(v).__name__}" for k, v in fields.items() if not torch.is_tensor(v))
        raise TypeError(f"expected a Batch with tensors inputs, targets and mask, got {type(batch).__name__} "
                        f"({wrong}); make batches with BucketIterator or StreamIterator")
    if inputs.dim() != 2 or inputs.shape != targets.shape or mask.shape != targets.shape or inputs.numel() == 0:
        raise ValueError(f"a batch needs inputs, targets and mask of one (T, B) shape with T, B >= 1; got "
                         f"{tuple(inputs.shape)}, {tuple(targets.shape)} and {tuple(mask.shape)}")
    for what, t, dtypes in (("inputs", inputs, (torch.int64, torch.int32)), ("targets", targets, (torch.int64,))):
        if t.dtype not in dtypes:
            raise ValueError(f"batch {what} must be token ids of dtype {' or '.join(map(str, dtypes))}, got "
                             f"{t.dtype}" + ("; convert with .long()" if not t.is_floating_point() else ""))
    _check_ids(inputs, vocab_size)


def count_targets(batch, vocab_size: int) -> int:
    """The target ids' range and the mask (of a batch check_inputs passed); the real target tokens, at least one.
    A min-and-max pass, a compare and a sum."""
    targets, mask = batch.targets, batch.mask
    _check_ids(targets, vocab_size)
    # The loss skips <pad> (id 0) targets whatever the mask says, and is divided by the mask's count:
    # a mask that disagrees would scale every gradient wrongly, without a word.
    real = targets != PAD_ID
    if mask.dtype != torch.bool or not torch.equal(mask, real):
        raise ValueError(f"the batch's mask must be a bool tensor True exactly where a target is a real token "
                         f"(targets != {PAD_ID}); got dtype {mask.dtype} with {int(mask.sum())} True against "
                         f"{int(real.sum())} real targets: make it as targets != {PAD_ID}")
    tokens = int(real.sum())
    if tokens == 0:
        raise ValueError("the batch has no real (non-padding) target tokens")
    return tokens


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    lo, hi = (int(v) for v in torch.aminmax(ids))       # one pass
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"the batch holds token id {bad}, but the model's vocabulary has ids 0..{vocab_size - 1}; "
                         "were the batches made with another vocabulary?")


def check_layers(model, stages) -> None:
    """The stages run the layers they were given: one the model has swapped for another since would not train."""
    now = model.layers._modules            # the ModuleDict's own dict: no __getitem__ per layer, every step
    for stage in stages:
        for name, layer in zip(stage.names, stage.layers):
            if now.get(name) is not layer:
                raise RuntimeError(f"the model's layer {name!r} was replaced after this Pipeline was built, "
                                   "which would go on running the old one; build a new Pipeline on the model")


def checked_schedule(schedule, built: tuple) -> "Schedule":
    """A pipeline's `schedule`, checked again if it was edited or replaced since it was checked: its rows are
    lists a caller can change, and an edited row would run unchecked (a missing backward: wrong gradients; a
    missing forward: a wait with nobody to send). `built`: (stage devices, micro-batches, time chunks) the
    pipeline was built for. Cheap when unchanged: one hash."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"pipe.schedule was replaced by {schedule!r}, not a Schedule; build a new Pipeline "
                        "with the schedule you want")
    counts = (list(schedule.stage_devices), schedule.micro_batches, schedule.chunks)
    if counts != built:
        raise ScheduleError(
            f"pipe.schedule was changed after the Pipeline was built: it now puts stages on devices "
            f"{counts[0]} with {counts[1]} micro-batches and {counts[2]} time chunks, this pipeline "
            f"{built[0]}, {built[1]} and {built[2]}; build a new Pipeline")
    try:
        return schedule.validated()
    except ScheduleError as e:
        raise ScheduleError(f"pipe.schedule was edited after the Pipeline was built and cannot run, so "
                            f"no step ran: {e}") from None


def fit_width(batch, micro_batches):
    """Pad the batch dimension with empty columns (all <pad>, no targets) up to a width the micro-batches
    split: a multiple of m for `micro_batches` = m, the sizes' sum for a list of unequal sizes.

    A pipeline splits a (T, B) batch into m micro-batches of B/m columns (or of the given sizes), but a
    bucket's last batch can be narrower. Empty columns add no tokens, no loss and no gradient (columns
    are independent), so the step's result is that of the narrow batch; they only cost compute. With
    sizes the empty columns fill the last micro-batches; a batch wider than the sizes' sum is refused.
    """
    B = batch.inputs.shape[1]
    if isinstance(micro_batches, (list, tuple)):
        width = sum(micro_batches)
        if B > width:
            raise ValueError(f"a batch of {B} sentences does not fit micro-batches of sizes {list(micro_batches)}, "
                             f"which add up to {width}; give sizes that add up to the batch size")
        extra = width - B
    else:
        extra = -B % micro_batches
    if not extra:
        return batch
    pad = batch.inputs.new_zeros((batch.inputs.shape[0], extra))  # (T, extra) of <pad> (id 0)
    return replace(batch, inputs=torch.cat([batch.inputs, pad], 1), targets=torch.cat([batch.targets, pad], 1),
                   mask=torch.cat([batch.mask, pad.bool()], 1))


def fitted(runner, batch):
    """`batch` padded to a width `runner` can split into its micro-batches (unchanged for one)."""
    if runner.micro_batch_sizes is not None:
        return fit_width(batch, runner.micro_batch_sizes)
    m = runner.micro_batches
    return fit_width(batch, m) if m > 1 else batch
