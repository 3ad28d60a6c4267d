"""What the notebooks use beside the engine: the explorer widget and the step-through of a timeline (they need
the notebooks extra, so they are imported only when asked for), claims judged from measurements, baselines, checked exercises (the
learner's own pipeline code and schedules), the explorer's words and refusals. Imports the layers
below (runtime ... training)."""
from . import exercises
from .baselines import Baselines, measure_baselines
from .claims import (NEEDS_CORES, NEIGHBOURS, SLOW_LINK, Verdict, compare, free_cores, in_turn, measure_placements,
                     within)
from .layout import SCHEDULE_MENU, V_SCHEDULES
from .refusals import Refusal, check, dealt, read_sizes
from .wording import RECOMPUTE, SCHEDULES, SLOWDOWNS, cost_note, far_from_prediction, link_label, sequences

__all__ = [
    "Baselines", "BOARD_CSS", "BOARD_ESM", "LayerBoard", "NEEDS_CORES", "NEIGHBOURS", "PipelineExplorer",
    "RECOMPUTE", "Refusal", "SCHEDULE_MENU", "SCHEDULES", "SLOW_LINK", "SLOWDOWNS", "Step", "StepThrough",
    "TIMELINE_CSS",
    "TIMELINE_ESM", "TimelineView", "Verdict", "check", "compare", "cost_note", "dealt", "describe", "exercises",
    "far_from_prediction", "free_cores", "in_turn", "link_label", "measure_baselines",
    "measure_placements", "read_sizes", "same_plan", "sequences", "step_through", "timeline_panel", "V_SCHEDULES",
    "walk_timeline", "within",
]

_NEEDS_WIDGETS = {'describe': 'bestplans', 'same_plan': 'bestplans', 'BOARD_CSS': 'board', 'BOARD_ESM': 'board', 'LayerBoard': 'board', 'PipelineExplorer': 'explorer', 'TIMELINE_CSS': 'timeline_view', 'TIMELINE_ESM': 'timeline_view', 'TimelineView': 'timeline_view', 'timeline_panel': 'timeline_view', 'Step': 'stepper', 'StepThrough': 'stepper', 'step_through': 'stepper', 'walk_timeline': 'stepper'}


def __getattr__(name):
    # the explorer needs the notebooks extra (ipywidgets, anywidget): import it only when asked for
    if name in _NEEDS_WIDGETS:
        import importlib
        return getattr(importlib.import_module(f".{_NEEDS_WIDGETS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
