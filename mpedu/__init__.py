"""mpedu: learn model-parallel training of a stacked LSTM language model, step by step."""
from .bucketing import Batch, BucketIterator, StreamIterator
from .data import Corpus, Vocabulary, load_corpus
from .devices import Device, describe_devices, get_device, get_devices, list_devices
from .model import LSTMLM
from .pipeline import Pipeline
from .placement import Placement
from .schedules import Action, Schedule
from .timeline import Event, Timeline
from .train import SingleDevice, train

__all__ = [
    "Action", "Batch", "BucketIterator", "Corpus", "Device", "Event", "LSTMLM", "Pipeline", "Placement",
    "Schedule", "SingleDevice", "StreamIterator", "Timeline", "Vocabulary", "describe_devices", "get_device",
    "get_devices", "list_devices", "load_corpus", "train",
]
__version__ = "0.1.0"
