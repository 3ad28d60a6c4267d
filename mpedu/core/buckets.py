"""What a pipeline prepares per batch shape (T, B), as MXNet built one executor per bucket: the micro-batch
width, the time chunks, and a check that the emulated link can carry one step's hand-offs."""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import streams
from ..runtime.link import format_duration


@dataclass
class BucketPlan:
    """What a pipeline prepared for one batch shape (T, B): every micro-batch of the bucket
    has shape (T, micro_batch) through all stages, cut in time at `chunk_bounds`."""

    T: int
    B: int
    micro_batch: int
    chunk_bounds: list[tuple[int, int]]
    steps: int = 0      # how many steps used this plan

    def __str__(self) -> str:
        chunks = ", ".join(f"[{lo}:{hi})" for lo, hi in self.chunk_bounds)
        return (f"bucket T={self.T}, B={self.B}: micro-batches of {self.micro_batch}, "
                f"time chunks {chunks}, used {self.steps}x")


def plan_bucket(pipe, batch) -> BucketPlan:
    """The BucketPlan of `batch`'s shape for Pipeline `pipe`, refused in words where it cannot run."""
    T, B = batch.inputs.shape
    if B % pipe.micro_batches:
        batch.split(pipe.micro_batches)   # raises the explanatory error
    if T < pipe.chunks:
        raise ValueError(f"chunks={pipe.chunks} but this batch has only T={T} time steps; "
                         f"use at most {T} chunks or longer buckets")
    seconds = transfer_time(pipe, batch)
    if seconds > LINK_LIMIT_S:
        raise ValueError(
            f"link {pipe.link}: one step's hand-offs on a ({T}, {B}) batch would take at least "
            f"{format_duration(seconds)}, and a step waits for them; mpedu refuses a link slower than "
            f"{LINK_LIMIT_S:g} s of transfers a step. A typo? '1ms,1GB/s' is 1 ms + bytes / (1 GB/s); "
            f"'10gbe/100' is 10 Gb Ethernet slowed 100x")
    return BucketPlan(T, B, B // pipe.micro_batches, streams.chunk_bounds(T, pipe.chunks))


LINK_LIMIT_S = 60.0     # seconds of hand-offs a step may need on an emulated link: more is a typo, not a lesson


def transfer_time(pipe, batch) -> float:
    """At least how long one training step's hand-offs take on this pipeline's link, in seconds (0 on
    shared memory): between two devices each direction queues its tensors for the bandwidth, and
    the last one lands a latency later. A stage's output is (T, B/m, width) floats, its gradient too."""
    if not pipe.link.emulated:
        return 0.0
    T, B = batch.inputs.shape
    itemsize = next(pipe.model.parameters()).element_size()
    config, routes = pipe.model.config, {}
    for here, there in zip(pipe.stages, pipe.stages[1:]):
        if here.device == there.device:          # two stages of one device (a V shape): nothing travels
            continue
        width = config.embed_size if here.names[-1] == "embed" else config.hidden_size
        nbytes = T * -(-B // pipe.micro_batches) * width * itemsize * pipe.micro_batches   # all micro-batches
        for route in ((here.device.name, there.device.name), (there.device.name, here.device.name)):
            routes[route] = routes.get(route, 0) + nbytes
    return max((pipe.link.time(n) for n in routes.values()), default=0.0)
