"""Pipeline schedules as data: per device, an ordered list of actions such as `1F3`.

Letters used throughout: p devices, n stages (n >= p when a device holds several),
m micro-batches, s a stage, i a micro-batch, c a time chunk, k a clock tick.

An action is (kind, stage, micro-batch[, chunk]) with kind
    F  forward of one micro-batch through one stage
    B  backward: the input gradient (and, when the schedule has no W for that
       stage, the weight gradient too)
    W  weight gradient only (zero-bubble schedules split the backward into B + W)
Its string form is `<stage><kind><micro-batch>` (`1F3`), with `.c` for a time
chunk other than 0 (`1F3.2`).

One Schedule drives the executor (mpedu.core.pipeline), the simulator (mpedu.predict.simulator)
and the printers here. `Schedule.validate()` proves it can run before anything does.

Modules: actions (Action, Schedule, validate, run_order: the data and its checks), generators (the
named schedules and `make`), vshapes (ZB-V, DualPipeV), vmem (V-Half, V-Min: V-shapes that hold less), capped (zero
bubble under a memory cap), files (hand-written schedules, and PyTorch's CSV schedule files). Use them
through this package: `schedules.make("1f1b", [0, 1], 4)`, `schedules.F(0, 1)`, `schedules.read_csv(path)`.
"""
from .actions import KINDS, MAX_UNITS, Action, B, F, Schedule, ScheduleError, W, run_order
from .capped import zb_capped
from .files import from_option, read, read_csv, read_file
from .generators import (ALIASES, GENERATORS, V_SHAPED, canonical, fewest_micro_batches, for_runner, forwards_only,
                         gpipe, interleaved, is_round_robin, looped_bfs, make, naive, one_f_one_b, wavefront, zb1)
from .vmem import v_half, v_min
from .vshapes import dualpipev, is_v_shape, zbv

__all__ = ["ALIASES", "Action", "B", "F", "GENERATORS", "KINDS", "MAX_UNITS", "Schedule", "ScheduleError", "V_SHAPED",
           "W", "canonical", "dualpipev", "fewest_micro_batches", "for_runner", "forwards_only", "from_option", "gpipe", "interleaved",
           "is_round_robin", "is_v_shape", "looped_bfs", "make", "naive", "one_f_one_b", "read", "read_csv",
           "read_file", "run_order", "v_half", "v_min", "wavefront", "zb1", "zb_capped", "zbv"]
