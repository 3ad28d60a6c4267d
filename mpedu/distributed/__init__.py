"""The same model, placement and schedule on torch.distributed.pipelining: one process per device, under torchrun.

    torchrun --nproc-per-node 2 -m mpedu.distributed train --schedule 1f1b
    torchrun --nproc-per-node 2 -m mpedu.distributed check      # equal to one process?
    torchrun --nproc-per-node 4 -m mpedu.distributed train --pipeline-devices 2   # 2 replicas x 2 stages

Devices become ranks: the k-th distinct device of the placement (in order of first
appearance) is pipeline rank k, so "embed,lstm0:vgpu0 | lstm1,decode:vgpu1" runs embed
and lstm0 in rank 0 and the rest in rank 1. Each rank builds the whole model from the
seed (so every rank starts from the same weights), keeps its own layers, and wraps each
of its stages in a PipelineStage. The schedule is mpedu's own: its per-device action
lists (built from a name, or written by hand) run in PyTorch's pipeline-order runtime
(bridge), so one Schedule drives the threads, the simulator and torchrun. CPU ranks
talk through gloo, GPU ranks through NCCL on `cuda:LOCAL_RANK`.

State. Stage outputs must be tensors, so an LSTM's (h, c) cannot travel between ranks;
each stage starts every micro-batch from zero state and keeps it inside. That is the
bucketed trainer's contract (state reset per batch); stream mode (--bptt) and time
chunks (wavefront) are not offered here.

Modules: stages (StageModule, TimedStage), heartbeat (the ranks' watchdog), bridge (Schedule -> torch's runtime),
native (PyTorch's own classes by name), placement (ranks), group (process group, mesh),
timing (per-rank recording), pipeline (DistributedPipeline, the runner), cli and
commands (the command line).
"""
from . import group
from .bridge import ActionListSchedule, ScheduleRefused, read_schedule, resolve, schedule_arg, torch_order
from .cli import NOT_OFFERED, build_parser, main, pipeline_devices
from .commands import compare
from .group import Mesh, choose_backend, mesh, setup
from .heartbeat import LIMIT, Heartbeat
from .native import TorchPlan, plan_schedule
from .pipeline import DistributedPipeline
from .placement import rank_placement
from .stages import ContiguousGrad, StageModule, TimedStage, whole_backward_in_b
from .timing import Recorder, merge, shared_origin

__all__ = ["ActionListSchedule", "ContiguousGrad", "DistributedPipeline", "Heartbeat", "LIMIT", "Mesh",
           "NOT_OFFERED", "Recorder", "ScheduleRefused", "StageModule", "TimedStage", "TorchPlan", "build_parser",
           "choose_backend", "compare", "group", "main", "merge", "mesh", "pipeline_devices", "plan_schedule",
           "rank_placement", "read_schedule", "resolve", "schedule_arg", "setup", "shared_origin", "torch_order",
           "whole_backward_in_b"]
