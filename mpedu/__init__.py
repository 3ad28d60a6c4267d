"""mpedu: learn model-parallel training of a stacked LSTM language model, step by step."""
from .allocator import keep_freed_memory

keep_freed_memory()     # glibc keeps freed memory for the next step; early, before any worker thread exists
from .balance import balance, balance_by_params, balance_by_time
from .bucketing import Batch, BucketIterator, StreamIterator
from .checkpoint import load_model
from .data import Corpus, Vocabulary, load_corpus
from .devices import Device, describe_devices, get_device, get_devices, list_devices
from .link import Link
from .memory import memory_report
from .model import LSTMLM
from .pipeline import Pipeline
from .placement import Placement
from .planner import plan
from .profile import Costs, profile
from .schedules import Action, Schedule
from .simulate import simulate
from .single import SingleDevice
from .timeline import Event, Timeline, plot_timelines
from .training import train

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
        from .widgets import PipelineExplorer
        return PipelineExplorer
    raise AttributeError(f"module 'mpedu' has no attribute {name!r}")
