"""The schedule bridge: any validated mpedu Schedule runs in PyTorch's pipeline-order runtime.

mpedu writes a schedule as one ordered action list per device (`0F0 0F1 0B0 ...`, see
mpedu.core.schedules); the thread engine and the simulator play exactly those lists. PyTorch's
pipelining has a runtime that plays per-rank action lists too (the one its looped and
zero-bubble schedules are built on): it takes compute actions only and inserts the sends
and receives itself. So the bridge translates action by action:

    mpedu F            -> torch F (FORWARD)
    mpedu B            -> torch B (FULL_BACKWARD: input and weight gradient), or
                          torch I (BACKWARD_INPUT) on a stage whose backward is split (zero bubble)
    mpedu W            -> torch W (BACKWARD_WEIGHT)
    an overlapped pair -> torch OVERLAP_F_B holding the two (DualPipeV's (F;I)OVERLAP_F_B, the W after it);
                          the runtime runs the forward and then the backward, as mpedu's threads do

(PyTorch's split runs an LSTM's backward kernel in I and again in W, so a stage after the first that holds
an LSTM runs its whole backward in I and its W does nothing: stages.whole_backward_in_b.)
And device d becomes pipeline rank d. Torch reads its stage -> rank map off the lists (stage s runs in the
rank whose list holds its actions), so the V of zbv and dualpipev, rank r holding stages r and 2p-1-r (torch's
"v" style), runs as any other layout; its two stages on rank p-1 hand their tensors over in memory. A schedule
a learner writes by hand runs here as soon as `Schedule.validate()` accepts it.

Refused, with the reason: time chunks (wavefront). Torch's runtime indexes work by (stage,
micro-batch) and a stage passes one tensor per micro-batch; chunk c+1 of a micro-batch starts
from the (h, c) state chunk c left behind, and chunk c's backward needs the state gradient from
chunk c+1. That recurrent state would have to travel with the chunks (and between ranks when a
stage's next chunk meets its neighbour's), which PyTorch's stages, whose outputs must be tensors
and which keep nothing between actions, cannot express.

The runtime class is PyTorch's `_PipelineScheduleRuntime` (private in torch 2.13, but the base
of its public ScheduleLoopedBFS, ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble).
"""
from __future__ import annotations

from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

from ..core.schedules import Schedule, ScheduleError, from_option, make
from ..core.schedules import read as read_schedule  # mpedu.distributed.read_schedule: a hand-written schedule

RUNTIME = _PipelineScheduleRuntime


class ScheduleRefused(ValueError):
    """A valid mpedu Schedule that PyTorch's pipelining cannot run; the message says why."""


def resolve(schedule: str | Schedule, stage_ranks: list[int], micro_batches: int) -> Schedule:
    """A validated Schedule for these stages: a name is built by mpedu.core.schedules.make (its names and
    aliases), a Schedule is checked against the stage layout and micro-batch count, then validated."""
    if isinstance(schedule, str):
        return make(schedule, list(stage_ranks), micro_batches)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name such as 'gpipe' or an mpedu.core.schedules.Schedule, "
                        f"got {type(schedule).__name__}")
    if list(schedule.stage_devices) != list(stage_ranks):
        raise ValueError(f"the schedule {schedule.name!r} puts stages on devices {list(schedule.stage_devices)}, "
                         f"but the placement puts them on ranks {list(stage_ranks)}; write the schedule for "
                         "this placement (stage s on the device that holds it)")
    if schedule.micro_batches != micro_batches:
        raise ValueError(f"the schedule {schedule.name!r} has {schedule.micro_batches} micro-batches but the "
                         f"pipeline splits each batch into {micro_batches}; pass micro_batches="
                         f"{schedule.micro_batches}")
    return schedule.validate()


def schedule_arg(value: str, stage_ranks: list[int], micro_batches: int) -> str | Schedule:
    """A --schedule value under torchrun: a hand-written schedule file (mpedu.core.schedules.from_option), else a
    name; the wavefront is refused here (its time chunks cannot cross ranks)."""
    if value.strip().lower() == "wavefront":
        raise ValueError("--schedule wavefront cuts sentences into time chunks, whose LSTM state cannot travel "
                         "between ranks (no --chunks here); with one chunk it is GPipe: use gpipe, or run the "
                         "wavefront on mpedu's threads (python -m mpedu train --schedule wavefront --chunks 4)")
    return from_option(value, stage_ranks, micro_batches)


def torch_order(schedule: Schedule) -> dict[int, list[_Action]]:
    """mpedu's per-device action lists as torch's per-rank compute actions (ScheduleRefused if it cannot run)."""
    if schedule.chunks > 1:
        raise ScheduleRefused(
            f"the schedule {schedule.name!r} cuts each micro-batch into {schedule.chunks} time chunks, which "
            "torch.distributed.pipelining cannot run: chunk c+1 starts from the LSTM state (h, c) that chunk c "
            "left, and chunk c's backward needs that state's gradient from chunk c+1, but a PyTorch stage passes "
            "one tensor per (stage, micro-batch) and keeps no state between its actions, so the recurrent state "
            "cannot travel with the chunks between ranks. Run it with mpedu's threads (python -m mpedu train "
            "--schedule wavefront) or use a schedule without time chunks (chunks=1)")
    try:
        schedule.validate()
    except ScheduleError as e:
        raise ValueError(f"the schedule {schedule.name!r} cannot run anywhere: {e}") from None

    def translate(a) -> _Action:
        if a.kind == "F":
            kind = _ComputationType.FORWARD
        elif a.kind == "W":
            kind = _ComputationType.BACKWARD_WEIGHT
        elif a.stage in schedule.split_backward:
            kind = _ComputationType.BACKWARD_INPUT
        else:
            kind = _ComputationType.FULL_BACKWARD
        return _Action(a.stage, kind, a.mb)

    def rank(d: int, row) -> list[_Action]:
        out, k = [], 0
        while k < len(row):
            if (d, k) in schedule.overlapped:            # validate(): a forward, then a backward of another stage
                pair = (translate(row[k]), translate(row[k + 1]))
                out.append(_Action(-1, _ComputationType.OVERLAP_F_B, None, pair))
                k += 2
            else:
                out.append(translate(row[k]))
                k += 1
        return out

    return {d: rank(d, row) for d, row in enumerate(schedule.actions)}


class ActionListSchedule(RUNTIME):
    """PyTorch's pipeline-order runtime playing an mpedu Schedule's action lists on this rank's stages.

    Built like torch's schedules (stages, n_microbatches, loss_fn, scale_grads); `step()` and
    `eval()` as theirs. The sends and receives are inserted by torch from the compute order.
    """

    def __init__(self, stages: list, schedule: Schedule, *, loss_fn, scale_grads: bool = False):
        order = torch_order(schedule)
        if len(order) != stages[0].group_size:
            raise ValueError(f"the schedule {schedule.name!r} is written for {len(order)} devices but the pipeline "
                             f"group has {stages[0].group_size} ranks")
        super().__init__(stages, schedule.micro_batches, loss_fn=loss_fn, scale_grads=scale_grads)
        self.schedule = schedule
        self.pipeline_order = order
        # the runtime's lowering pass: checks the order, maps stage -> rank, adds sends and receives
        self._prepare_schedule_with_comms({d: list(row) for d, row in order.items()})

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        # torch keeps the last stage's losses in the order its forwards ran and reads them back by
        # micro-batch index: right for its own schedules, but a valid order of ours whose last stage takes
        # micro-batch 1 before 0 would start backward 0 from micro-batch 1's loss. Kept by index instead.
        if stage.is_last and self._loss_fn is not None:
            losses = self._internal_losses
            losses.extend([None] * (mb_index + 1 - len(losses)))
            losses[mb_index] = self._compute_loss(output, target_mbs[mb_index], loss_kwargs)
