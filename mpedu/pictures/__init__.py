"""Matplotlib pictures drawn from plain data: timelines as Gantt charts, the planner's front.
Imports nothing else of mpedu."""
from .planplot import plot_plans
from .plot import KIND_NAMES, plot_timeline

__all__ = [
    "KIND_NAMES", "plot_plans", "plot_timeline",
]
