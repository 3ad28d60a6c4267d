"""What a pipeline prepares per batch shape (T, B), as MXNet built one executor per bucket: the micro-batches'
widths, the time chunks, and a check that the emulated link can carry one step's hand-offs."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..lm import check_sizes
from ..runtime import streams
from ..runtime.link import format_duration


@dataclass
class BucketPlan:
    """What a pipeline prepared for one batch shape (T, B): micro-batch i has shape (T, sizes[i]) through
    all stages, starting at batch column starts[i], cut in time at `chunk_bounds`.

        equal (micro_batches=4), B = 8:      sizes (2, 2, 2, 2), starts [0, 2, 4, 6]
        unequal (micro_batches=[1, 3, 2, 2]): sizes (1, 3, 2, 2), starts [0, 1, 4, 6]
    """

    T: int
    B: int
    sizes: tuple[int, ...]
    chunk_bounds: list[tuple[int, int]]
    micro: streams.MicroBatches | None = None    # the blocks each step's batch is copied into, and their views
    steps: int = 0      # how many steps used this plan
    starts: list[int] = field(init=False)     # each micro-batch's first column: where its dropout masks start
    chunk_starts: list[int] = field(init=False)   # each time chunk's first time step
    equal: bool = field(init=False)           # all one width (read every step: worked out once)

    def __post_init__(self):
        self.starts = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.chunk_starts = [lo for lo, _ in self.chunk_bounds]
        self.equal = len(set(self.sizes)) == 1

    def __str__(self) -> str:
        chunks = ", ".join(f"[{lo}:{hi})" for lo, hi in self.chunk_bounds)
        widths = self.sizes[0] if self.equal else ", ".join(map(str, self.sizes))
        return (f"bucket T={self.T}, B={self.B}: micro-batches of {widths}, "
                f"time chunks {chunks}, used {self.steps}x")


def split_form(micro_batches) -> tuple[int | None, tuple[int, ...] | None]:
    """(count, sizes) of a Pipeline's micro_batches=: a count m (or None, the default) gives (m, None), equal
    micro-batches of every batch's width / m; a list of sizes gives (len, the sizes), micro-batches of those
    widths (mpedu.lm.check_sizes). Anything else is refused, naming both forms."""
    if isinstance(micro_batches, (list, tuple)):
        sizes = check_sizes(micro_batches)
        return len(sizes), sizes
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)):
        raise ValueError(f"micro_batches must be a count such as 4 (equal micro-batches) or a list of sizes such as "
                         f"[8, 16, 24, 16] (sentences each, adding up to the batch width), got {micro_batches!r}")
    return micro_batches, None


def plan_bucket(pipe, batch) -> BucketPlan:
    """The BucketPlan of `batch`'s shape for Pipeline `pipe`, refused in words where it cannot run."""
    T, B = batch.inputs.shape
    sizes = pipe.micro_batch_sizes
    if sizes is None and B % pipe.micro_batches or sizes is not None and sum(sizes) != B:
        batch.split(pipe.micro_batches if sizes is None else list(sizes))   # raises the explanatory error
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
    m = pipe.micro_batches
    plan = BucketPlan(T, B, sizes or (B // m,) * m, streams.chunk_bounds(T, pipe.chunks))
    plan.micro = streams.MicroBatches(T, B, m, plan.chunk_bounds, sizes=None if plan.equal else plan.sizes,
                                      pin_inputs=pipe.stages[0].device.is_cuda,
                                      pin_targets=pipe.stages[-1].device.is_cuda)
    return plan


LINK_LIMIT_S = 60.0     # seconds of hand-offs a step may need on an emulated link: more is a typo, not a lesson


def transfer_time(pipe, batch) -> float:
    """At least how long one training step's hand-offs take on this pipeline's link, in seconds (0 on
    shared memory): between two devices each direction queues its tensors for the bandwidth, and
    the last one lands a latency later. A stage's output is (T, b_i, width) floats per micro-batch (b_i
    its width: B/m, or its own size), its gradient too."""
    if not pipe.link.emulated:
        return 0.0
    T, B = batch.inputs.shape
    m, sizes = pipe.micro_batches, pipe.micro_batch_sizes
    columns = -(-B // m) * m if sizes is None else sum(sizes)       # what all micro-batches carry together
    itemsize = next(pipe.model.parameters()).element_size()
    config, routes = pipe.model.config, {}
    for here, there in zip(pipe.stages, pipe.stages[1:]):
        if here.device == there.device:          # two stages of one device (a V shape): nothing travels
            continue
        width = config.embed_size if here.names[-1] == "embed" else config.hidden_size
        nbytes = T * columns * width * itemsize
        for route in ((here.device.name, there.device.name), (there.device.name, here.device.name)):
            routes[route] = routes.get(route, 0) + nbytes
    return max((pipe.link.time(n) for n in routes.values()), default=0.0)
