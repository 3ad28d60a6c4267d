"""The floor: devices (a real GPU, or a virtual one that is a CPU worker thread) and their workers,
GPU streams, the step clock, the emulated link, the --out folder's files, and the checks of values
people give. Imports nothing else of mpedu."""
from . import allocator, streams
from .allocator import keep_freed_memory
from .clock import Clock
from .devices import Device, describe_devices, get_device, get_devices, list_devices, usable_cores, virtual_count
from .files import LOCK_NAME, OutFolderError, OutLock, atomic_write, prepare_out, why
from .link import LINKS, Channel, Link
from .streams import MicroBatches, chunk_bounds
from .values import check_number, format_size, parse_size, shorten
from .workers import (PR_GET_TIMERSLACK, PR_SET_TIMERSLACK, STEP_SWITCH_S, CallerThread, QuickSwitching, Worker,
                      own_cores, start_workers, stop_workers, wait_interruptibly, wait_uninterrupted)

__all__ = [
    "CallerThread", "Channel", "Clock", "Device", "Link", "LINKS", "LOCK_NAME", "MicroBatches",
    "OutFolderError", "OutLock", "PR_GET_TIMERSLACK", "PR_SET_TIMERSLACK", "QuickSwitching", "STEP_SWITCH_S",
    "Worker", "allocator", "atomic_write",
    "check_number", "chunk_bounds", "describe_devices", "format_size", "get_device", "get_devices",
    "keep_freed_memory", "list_devices", "own_cores", "parse_size", "prepare_out", "shorten",
    "start_workers", "stop_workers", "streams", "usable_cores", "virtual_count", "wait_interruptibly", "wait_uninterrupted", "why",
]
