"""The pipeline itself: schedules as data, placements and stages, the mailbox between workers, the
runners (SingleDevice, Pipeline) and the Timeline a step records. Read reference.py first: the
whole idea on one page. Imports runtime, pictures and lm."""
from . import mailbox, schedules
from .mailbox import POLL_NAP_S, Aborted, Mailbox
from .pipeline import Pipeline
from .placement import Placement
from .recompute import parse_recompute, recompute_modes, recomputes
from .reference import ReferencePipeline
from .runner import BaseRunner, Runner, StepInterrupted, StepResult, check_batch, fit_width, fitted
from .schedules import Action, B, F, Schedule, ScheduleError, W, make, one_f_one_b, run_order, wavefront, zb1
from .single import SingleDevice
from .stage import Stage, is_recurrent
from .timeline import ALL_REDUCE, Event, Mark, Timeline, plot_timelines

__all__ = [
    "Aborted", "Action", "ALL_REDUCE", "B", "BaseRunner", "Event", "F", "Mailbox", "Mark", "Pipeline",
    "Placement", "POLL_NAP_S", "ReferencePipeline", "Runner", "Schedule", "ScheduleError", "SingleDevice",
    "Stage", "StepInterrupted", "StepResult", "Timeline", "W", "check_batch", "fit_width", "fitted", "is_recurrent",
    "mailbox", "make", "one_f_one_b", "parse_recompute", "plot_timelines", "recompute_modes", "recomputes", "run_order", "schedules", "wavefront", "zb1",
]
