"""mpedu: learn model-parallel training of a stacked LSTM language model, step by step.

Layers, each importing only the ones above it in this list (tests/test_layers.py holds them to it):
runtime, pictures, lm, core, predict, training, course, cli, distributed. Each subpackage's
__init__ is its public face; this module gathers the names a notebook needs most."""
from .runtime import keep_freed_memory

keep_freed_memory()     # glibc keeps freed memory for the next step; early, before any worker thread exists
from .core import Action, Event, Pipeline, Placement, Schedule, SingleDevice, Timeline, plot_timelines  # noqa: E402
from .lm import LSTMLM, Batch, BucketIterator, Corpus, StreamIterator, Vocabulary, load_corpus  # noqa: E402
from .predict import (Costs, balance, balance_by_params, balance_by_time, memory_report, plan,  # noqa: E402
                      profile, simulate)
from .runtime import Device, Link, describe_devices, get_device, get_devices, list_devices  # noqa: E402
from .training import load_model, train  # noqa: E402

__all__ = [
    "Action", "Batch", "BucketIterator", "Corpus", "Costs", "Device", "Event", "LSTMLM", "Link", "Pipeline",
    "Placement", "Schedule", "SingleDevice", "StreamIterator", "Timeline", "Vocabulary", "balance",
    "balance_by_params", "balance_by_time", "describe_devices", "get_device", "get_devices", "list_devices",
    "load_corpus", "load_model", "memory_report", "plan", "plot_timelines", "profile", "simulate",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The explorer widget needs the notebooks extra (ipywidgets, anywidget): import it only when asked for.
    if name == "PipelineExplorer":
        from .course import PipelineExplorer
        return PipelineExplorer
    raise AttributeError(f"module 'mpedu' has no attribute {name!r}")
