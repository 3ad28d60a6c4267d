"""Pipeline: runs a schedule's action lists on the devices' workers and records a Timeline."""
from __future__ import annotations

import re
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass

import torch

from . import schedules
from .devices import Device, Worker, format_size, get_device, get_devices, list_devices, parse_size
from .placement import Placement
from .schedules import Action, Schedule
from .stage import Stage
from .timeline import Event, Timeline
from .train import StepResult, check_batch


MAX_UNITS = 2**16      # (micro-batch, chunk) units per step: far beyond any batch this course uses


class MemoryCapError(ValueError):
    """A step would need more memory on a device than its memory_cap; the message says what fits."""


class _Aborted(Exception):
    """Raised inside a worker when another worker failed: stop, nothing to report."""


class _Mailbox:
    """Tensors in flight between stages, keyed by (what, stage, micro-batch, chunk).

    A receive waits until its tensor arrives or the step is aborted, so a failure
    anywhere wakes everyone up and no worker stays blocked. Each waiting receive has
    its own Event, so a send wakes exactly the one device that waits for it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict = {}
        self._waiting: dict = {}
        self.aborted = False

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.set()

    def get(self, key):
        with self._lock:
            if key in self._items:
                return self._items.pop(key)
            if self.aborted:
                raise _Aborted
            waiter = self._waiting[key] = threading.Event()
        waiter.wait()
        with self._lock:
            if key in self._items:
                return self._items.pop(key)
        raise _Aborted

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            waiters, self._waiting = list(self._waiting.values()), {}
        for waiter in waiters:
            waiter.set()


class _Clock:
    """Timestamps for one device during one step: perf_counter on CPU, CUDA events on a GPU
    (read after the step, so timing never blocks the stream)."""

    def __init__(self, device: Device, t0: float):
        self.cuda = device.is_cuda
        self.t0 = t0
        if self.cuda:
            self.ref_cpu = time.perf_counter()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark) -> float:
        if self.cuda:
            return self.ref_cpu - self.t0 + self.ref.elapsed_time(mark) / 1e3
        return mark - self.t0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Pipeline:
    """A model split into stages over devices, trained one schedule step at a time.

        pipe = Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=4)
        result = pipe.train_step(batch)     # gradients accumulate in model's .grad
        print(result.loss, result.timeline.summary())

    `placement` is a Placement, a placement string, a dict layer -> device, or a
    device count (an even split). Workers persist across steps; `close()` (or
    garbage collection, or a `with` block) ends them.

    `memory_cap` limits what a device may hold: one size for every device ("2MB",
    or a number of bytes) or a dict device -> size ({"vgpu:0": "2MB"}). Before the
    first step on each batch shape, `memory_estimate` (parameters, gradients and the
    activations of the micro-batches the schedule holds at once) is checked against
    it; a device over its cap raises MemoryCapError naming a placement that fits.
    """

    def __init__(self, model, placement: Placement | str | dict | int = 2, schedule: str | Schedule = "gpipe",
                 micro_batches: int = 4, chunks: int = 1, memory_cap=None):
        self.model = model
        self.placement = _as_placement(placement, model)
        if not isinstance(schedule, (str, Schedule)):
            raise TypeError(f"schedule must be a name such as 'gpipe' or a Schedule, got {schedule!r}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a whole number >= 1, got {chunks!r}")
        if isinstance(micro_batches, bool):
            raise ValueError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}")
        if isinstance(micro_batches, int) and micro_batches * chunks > MAX_UNITS:
            # writing down a schedule of 2**70 actions would never finish: refuse it first
            raise ValueError(f"micro_batches={micro_batches} x chunks={chunks} is more than the {MAX_UNITS:,} "
                             f"pieces a step may be cut into; a batch of B sentences splits into at most B "
                             f"micro-batches, so use at most the batch size")
        if model.config.tie_weights:
            embed_dev, decode_dev = self.placement.assignment["embed"], self.placement.assignment["decode"]
            if embed_dev != decode_dev:
                raise ValueError(f"tied weights: embed ({embed_dev}) and decode ({decode_dev}) share one weight "
                                 "matrix, so they must sit on the same device; place them together or build "
                                 "the model with tie_weights=False")
        stage_devices = self.placement.stage_devices
        if isinstance(schedule, Schedule):
            if list(schedule.stage_devices) != stage_devices:
                raise ValueError(f"schedule {schedule.name!r} was built for stage devices "
                                 f"{list(schedule.stage_devices)}, but this placement gives {stage_devices}")
            self.schedule = schedule.validate()
        else:
            self.schedule = schedules.make(schedule, stage_devices, micro_batches, chunks)
        self.micro_batches = self.schedule.micro_batches
        self.chunks = self.schedule.chunks
        self.devices: list[Device] = self.placement.devices
        self.memory_cap = _parse_caps(memory_cap, self.devices)
        runs = self.placement.stages
        self.stages = []
        for s, (dev, names) in enumerate(runs):
            layers = [model.layers[name].to(dev.torch_device) for name in names]
            self.stages.append(Stage(s, names, layers, dev, is_last=s == len(runs) - 1))
        # Forward-only order for eval_step: the fill order (GPipe's, or the wavefront's), no backwards.
        fill = (schedules.wavefront(stage_devices, self.micro_batches, self.chunks) if self.chunks > 1
                else schedules.gpipe(stage_devices, self.micro_batches))
        self._eval_actions = [[a for a in row if a.kind == "F"] for row in fill.actions]
        self.bucket_cache: dict[tuple[int, int], BucketPlan] = {}
        self.last_timeline: Timeline | None = None   # the latest train_step's, for the command line
        self._workers = [Worker(dev) for dev in self.devices]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._carry_shape = None

    def __repr__(self) -> str:
        return (f"Pipeline({self.placement}, schedule={self.schedule.name}, "
                f"micro_batches={self.micro_batches})")

    # -- public ---------------------------------------------------------------------
    def train_step(self, batch) -> StepResult:
        """Forward and backward one batch along the schedule; gradients accumulate in the model.

        The loss is the mean NLL per real token of the whole batch: each micro-batch
        adds nll_sum / batch.tokens, so the micro-batch losses add up exactly.
        """
        self.model.train()
        return self._step(batch, self.schedule.actions, train=True)

    def eval_step(self, batch) -> StepResult:
        """Forward only (no gradients), in GPipe's fill order."""
        self.model.eval()
        return self._step(batch, self._eval_actions, train=False)

    def _plan(self, batch) -> "BucketPlan":
        """The shape-specific part of a step, made once per bucket shape (MXNet built one
        executor per bucket): micro-batch size and time-chunk boundaries."""
        T, B = batch.inputs.shape
        plan = self.bucket_cache.get((T, B))
        if plan is None:
            if B % self.micro_batches:
                batch.split(self.micro_batches)   # raises the explanatory error
            if T < self.chunks:
                raise ValueError(f"chunks={self.chunks} but this batch has only T={T} time steps; "
                                 f"use at most {T} chunks or longer buckets")
            edges = [round(k * T / self.chunks) for k in range(self.chunks + 1)]
            plan = BucketPlan(T, B, B // self.micro_batches, list(zip(edges, edges[1:])))
            self.bucket_cache[T, B] = plan
        return plan

    # -- memory ---------------------------------------------------------------------
    def memory_estimate(self, batch) -> list["DeviceNeed"]:
        """What each device needs for one training step on batches of this shape, in bytes:
        its parameters, their gradients, and the activations autograd saves for backward of
        the micro-batches (and time chunks) the schedule holds at once on that device.

        The activations of one micro-batch come from a dry run of its forward with
        saved-tensor hooks (the counting a training step records in its timeline), made
        once per bucket shape. Not counted: optimizer state (the pipeline never sees the
        optimizer; plain SGD keeps none) and short-lived buffers inside an op.
        """
        check_batch(batch, self.model.vocab_size)
        plan = self._plan(batch)
        return self._needs(self.placement.stages, self.schedule, self._layer_storages(batch, plan))

    def _layer_storages(self, batch, plan) -> dict[str, dict[int, int]]:
        """Per layer, the storages saved for backward by one (micro-batch, chunk) unit: {address: bytes}."""
        if plan.layer_storages is None:
            micro = batch.split(self.micro_batches)[0]
            lo, hi = max(plan.chunk_bounds, key=lambda b: b[1] - b[0])     # the longest time chunk
            held, storages = [], {}
            cuda = sorted({d.torch_device.index or 0 for d in self.devices if d.is_cuda})
            # the dry run must not move the generators a real step (dropout) draws from
            with torch.random.fork_rng(devices=cuda):
                x = micro.inputs[lo:hi]
                for stage in self.stages:
                    dev = stage.device.torch_device
                    targets = micro.targets[lo:hi].to(dev) if stage.is_last else None
                    out, per_layer = stage.measure(x.to(dev), targets)
                    held.append(out)    # keep every graph alive: no address is reused while counting
                    storages.update(zip(stage.names, per_layer))
                    x = out.detach()
            del held
            plan.layer_storages = storages
        return plan.layer_storages

    def _needs(self, stages, schedule: Schedule, storages: dict) -> list["DeviceNeed"]:
        """DeviceNeed per device for `stages` [(device, layer names)] run by `schedule`."""
        devices = list(dict.fromkeys(dev for dev, _ in stages))
        fixed = {dev: [0, 0] for dev in devices}          # parameters, gradients
        seen: set[int] = set()
        for dev, names in stages:
            for name in names:
                for p in self.model.layers[name].parameters():
                    if id(p) not in seen:                   # tied weights: one tensor, counted once
                        seen.add(id(p))
                        fixed[dev][0] += p.numel() * p.element_size()
                        fixed[dev][1] += p.numel() * p.element_size() if p.requires_grad else 0
        per_unit = [_union_bytes(storages[name] for name in names) for _, names in stages]
        needs = []
        for d, (dev, row) in enumerate(zip(devices, schedule.actions)):
            held = units = peak = peak_units = 0
            for a in row:
                if a.kind == "F":
                    held, units = held + per_unit[a.stage], units + 1
                    peak, peak_units = max(peak, held), max(peak_units, units)
                elif a.kind == "W" or a.stage not in schedule.split_backward:   # what frees the unit
                    held, units = held - per_unit[a.stage], units - 1
            needs.append(DeviceNeed(dev.name, *fixed[dev], peak, peak_units, self.memory_cap.get(dev.name)))
        return needs

    def _check_memory(self, batch, plan) -> None:
        needs = self.memory_estimate(batch)
        over = [n for n in needs if not n.fits]
        if not over:
            plan.memory_checked = True
            return
        what = (f"a training step on batches of T={plan.T}, B={plan.B} ({self.schedule.name}, "
                f"{self.micro_batches} micro-batches" + (f", {self.chunks} time chunks" if self.chunks > 1 else "")
                + ")")
        lines = [f"{n.device} needs {format_size(n.total)} for {what}: {n.parts()}; more than its memory_cap "
                 f"{format_size(n.cap)}." for n in over]
        raise MemoryCapError(" ".join(lines) + " " + self._what_fits(plan))

    def _what_fits(self, plan) -> str:
        """A placement that fits the caps (over these devices, else over more), or why none does."""
        names, storages = self.model.layer_names, plan.layer_storages
        p, n = len(self.devices), len(names)
        caps = [self.memory_cap.get(d.name) for d in self.devices]
        smallest = min(c for c in caps if c is not None)

        def need(i, j, device, units) -> DeviceNeed:     # one stage, layers i..j-1
            return self._needs([(device, names[i:j])], _one_row(units), storages)[0]

        for q in range(p, n + 1):
            devices = self._devices_for(q)
            if devices is None:
                return (f"No placement over {p} devices fits, and this machine offers too few devices of "
                        f"this kind to spread the layers further; raise the cap." + self._fewer_in_flight_hint())
            units, limits = self._units_per_stage(q), caps + [smallest] * (q - p)
            counts = _min_ratio_split(n, q, lambda i, j, k: (
                need(i, j, devices[k], units[k]).total / limits[k] if limits[k] else 0.0))
            if counts is None:
                continue
            starts = [sum(counts[:k]) for k in range(q)]
            fits = Placement(names, {name: devices[k] for k in range(q)
                                     for name in names[starts[k]:starts[k] + counts[k]]})
            totals = ", ".join(f"{devices[k]} {format_size(need(starts[k], starts[k] + counts[k], devices[k], units[k]).total)}"
                               for k in range(q))
            where = "A placement that fits" if q == p else (
                f"No placement over these {p} devices fits; over {q} devices with {format_size(smallest)} each, one does")
            return f"{where}: '{fits}' (needs {totals})." + self._fewer_in_flight_hint()
        worst = max(range(n), key=lambda i: need(i, i + 1, self.devices[0], units[0]).total)
        return (f"No placement fits, even one layer per device: {names[worst]} alone needs "
                f"{format_size(need(worst, worst + 1, self.devices[0], units[0]).total)} with {units[0]} "
                f"micro-batches in flight; raise the cap, or use smaller batches or shorter buckets."
                + self._fewer_in_flight_hint())

    def _fewer_in_flight_hint(self) -> str:
        p = len(self.devices)
        if self.schedule.name == "gpipe" and self.micro_batches > p:
            return (f" Or hold fewer micro-batches at once: 1f1b keeps at most {p} per device where gpipe "
                    f"keeps all {self.micro_batches}.")
        return ""

    def _devices_for(self, q: int) -> list[Device] | None:
        """This pipeline's devices, then unused ones of the same kind, q in all (None: not enough)."""
        virtual = self.devices[0].virtual
        spare = [d for d in list_devices() if d.virtual == virtual and d not in self.devices]
        devices = self.devices + spare[:q - len(self.devices)]
        return devices if len(devices) == q else None

    def _units_per_stage(self, q: int) -> list[int]:
        """Units each stage of a one-stage-per-device split over q devices holds at most, under this
        schedule's kind (gpipe: every micro-batch; 1f1b: at most q - s)."""
        try:
            schedule = schedules.make(self.schedule.name, list(range(q)), self.micro_batches, self.chunks)
        except ValueError:                       # e.g. interleaved needs several stages per device
            return [self.micro_batches * self.chunks] * q
        peaks = []
        for row in schedule.actions:
            units = peak = 0
            for a in row:
                units += 1 if a.kind == "F" else -1 if (a.kind == "W" or a.stage not in schedule.split_backward) else 0
                peak = max(peak, units)
            peaks.append(peak)
        return peaks

    def reset_state(self) -> None:
        """Forget carried recurrent state (stream mode)."""
        self._carry_shape = None
        for stage in self.stages:
            stage.reset()

    def close(self) -> None:
        """End the workers and wait for them. The pipeline cannot run afterwards."""
        self._finalizer()
        for worker in self._workers:
            worker.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one step -------------------------------------------------------------------
    def _step(self, batch, actions: list[list[Action]], train: bool) -> StepResult:
        if not self._finalizer.alive:
            raise RuntimeError("this Pipeline is closed; build a new one")
        check_batch(batch, self.model.vocab_size)
        plan = self._plan(batch)
        if train and self.memory_cap and not plan.memory_checked:
            self._check_memory(batch, plan)       # before the step: nothing has run yet
        plan.steps += 1
        micro = [[(mb.inputs[lo:hi], mb.targets[lo:hi]) for lo, hi in plan.chunk_bounds]
                 for mb in batch.split(self.micro_batches)]
        tokens = int(batch.tokens)
        if tokens == 0:
            raise ValueError("the batch has no real (non-padding) target tokens")
        keep_state = bool(getattr(batch, "carry_state", False)) and self._carry_shape == tuple(batch.inputs.shape)
        self._carry_shape = tuple(batch.inputs.shape) if getattr(batch, "carry_state", False) else None
        for stage in self.stages:
            stage.reset(keep_state=keep_state)
        mailbox = _Mailbox()
        timeline = Timeline([d.name for d in self.devices])
        t0 = time.perf_counter()
        futures = [worker.submit(self._device_job(d, row, micro, 1.0 / tokens, train, mailbox, timeline, t0))
                   for d, (worker, row) in enumerate(zip(self._workers, actions))]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                mailbox.abort()
                wait(futures)
                errors = [f.exception() for f in futures if f.exception() is not None
                          and not isinstance(f.exception(), _Aborted)]
                raise errors[0] if errors else RuntimeError("pipeline step aborted")
        except BaseException:
            # Ctrl-C or a failure: wake every worker, let each finish its current action,
            # then drop the step's tensors so the next step starts clean.
            mailbox.abort()
            _wait_uninterrupted(futures)
            for stage in self.stages:
                stage.reset()
            self._carry_shape = None
            raise
        last = self.stages[-1]
        nll = float(sum(v.double().item() for v in last.nll.values()))
        if train:
            for stage in self.stages:
                stage.saved.clear()
            self.last_timeline = timeline
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens, timeline=timeline)

    def _device_job(self, d: int, row: list[Action], micro, scale: float, train: bool,
                    mailbox: _Mailbox, timeline: Timeline, t0: float):
        device = self.devices[d]
        stages, last = self.stages, len(self.stages) - 1
        split = self.schedule.split_backward

        def send(tensor, kind, src: int, dst: int, a: Action, clock, marks):
            """Hand `tensor` from stage src to stage dst (always another device)."""
            start = clock.mark()
            moved = tensor.detach().to(stages[dst].device.torch_device, non_blocking=True)
            ready = None
            if moved.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            end = clock.mark()
            marks.append(("send", src, a, start, end, _nbytes(tensor), stages[dst].device.name, 0))
            mailbox.put((kind, dst, a.mb, a.chunk), (moved, ready))

        def receive(kind, a: Action):
            moved, ready = mailbox.get((kind, a.stage, a.mb, a.chunk))
            if ready is not None:  # make this device's stream wait for the copy
                stream = torch.cuda.current_stream()
                stream.wait_event(ready)
                moved.record_stream(stream)
            return moved

        def job():
            clock = _Clock(device, t0)
            marks = []
            try:
                for a in row:
                    if mailbox.aborted:
                        raise _Aborted
                    stage = stages[a.stage]
                    inputs, targets = micro[a.mb][a.chunk]          # (t, b) slices of the batch
                    if a.kind == "F":
                        x = inputs.to(device.torch_device) if a.stage == 0 else receive("act", a)
                        targets = targets.to(device.torch_device) if a.stage == last else None
                        start = clock.mark()
                        out = stage.forward(a.mb, a.chunk, x, targets, scale, train=train)
                        held = stage.saved_bytes(a.mb, a.chunk)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "", held))
                        if a.stage < last:
                            send(out, "act", a.stage, a.stage + 1, a, clock, marks)
                    elif a.kind == "B":
                        grad = receive("grad", a) if a.stage < last else None
                        held = stage.saved_bytes(a.mb, a.chunk) if a.stage not in split else 0
                        start = clock.mark()
                        grad_in = stage.backward(a.mb, a.chunk, grad, weights=a.stage not in split)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "", -held))
                        if a.stage > 0:
                            send(grad_in, "grad", a.stage, a.stage - 1, a, clock, marks)
                    else:
                        held = stage.saved_bytes(a.mb, a.chunk)
                        start = clock.mark()
                        stage.backward_weight(a.mb, a.chunk)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "", -held))
            finally:
                if device.is_cuda:
                    torch.cuda.current_stream().synchronize()
                for kind, s, a, start, end, nbytes, peer, memory in marks:
                    timeline.add(Event(device.name, kind, s, a.mb, clock.seconds(start), clock.seconds(end),
                                       a.chunk, nbytes, peer, memory))
        return job


@dataclass
class BucketPlan:
    """What a pipeline prepared for one batch shape (T, B): every micro-batch of the bucket
    has shape (T, micro_batch) through all stages, cut in time at `chunk_bounds`."""

    T: int
    B: int
    micro_batch: int
    chunk_bounds: list[tuple[int, int]]
    steps: int = 0      # how many steps used this plan
    layer_storages: dict | None = None    # per layer, what one unit saves for backward (memory_estimate)
    memory_checked: bool = False

    def __str__(self) -> str:
        chunks = ", ".join(f"[{lo}:{hi})" for lo, hi in self.chunk_bounds)
        return (f"bucket T={self.T}, B={self.B}: micro-batches of {self.micro_batch}, "
                f"time chunks {chunks}, used {self.steps}x")


@dataclass
class DeviceNeed:
    """Bytes one device needs for a training step (see Pipeline.memory_estimate)."""

    device: str
    params: int
    grads: int
    activations: int      # the most saved-for-backward bytes held at once
    in_flight: int        # the most (micro-batch, chunk) units held at once
    cap: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.activations

    @property
    def fits(self) -> bool:
        return self.cap is None or self.total <= self.cap

    def parts(self) -> str:
        held = f"{self.in_flight} micro-batch{'es' if self.in_flight != 1 else ''}"
        return (f"parameters {format_size(self.params)} + gradients {format_size(self.grads)} + activations "
                f"{format_size(self.activations)} ({held} held at once)")

    def __str__(self) -> str:
        cap = f", cap {format_size(self.cap)}" if self.cap is not None else ""
        return f"{self.device}: {format_size(self.total)} = {self.parts()}{cap}"


def _union_bytes(dicts) -> int:
    """Bytes of the distinct storages in several {address: bytes} maps (a layer's output saved
    by the next layer too is counted once)."""
    merged: dict[int, int] = {}
    for d in dicts:
        merged.update(d)
    return sum(merged.values())


def _one_row(units: int) -> Schedule:
    """A one-device schedule that holds `units` forwards before their backwards (for estimates)."""
    row = [Action("F", 0, i) for i in range(units)] + [Action("B", 0, i) for i in range(units)]
    return Schedule("estimate", (0,), max(units, 1), [row])


def _min_ratio_split(n: int, q: int, ratio) -> list[int] | None:
    """Layer counts for q contiguous non-empty stages minimising the largest ratio(i, j, k)
    (stage k holds layers i..j-1), when that is <= 1; None when no split has every ratio <= 1."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(q + 1)]
    cut = [[0] * (n + 1) for _ in range(q + 1)]
    best[0][0] = 0.0
    for k in range(1, q + 1):
        for j in range(k, n - (q - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                value = max(best[k - 1][i], ratio(i, j, k - 1))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[q][n] > 1.0:
        return None
    counts, j = [], n
    for k in range(q, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]


def _parse_caps(memory_cap, devices: list[Device]) -> dict[str, int]:
    """{device name: bytes} from one size for all devices, or a dict device -> size."""
    if memory_cap is None:
        return {}
    if not isinstance(memory_cap, dict):
        size = parse_size(memory_cap)
        return {d.name: size for d in devices}
    caps = {}
    for name, size in memory_cap.items():
        dev = get_device(name)
        if dev not in devices:
            raise ValueError(f"memory_cap names {dev}, which this placement does not use; it uses "
                             f"{', '.join(d.name for d in devices)}")
        caps[dev.name] = parse_size(size)
    return caps


_RANGE_RE = re.compile(r"^([a-z_]+)(\d+)-(\d+)$")


def parse_placement(text: str, model) -> Placement:
    """Placement.parse, after refusing a layer range wider than the model ('lstm0-999999999'),
    which Placement.parse would spell out name by name (for minutes, in gigabytes), and with
    every mistake in the text a ValueError (Placement.parse raises IndexError for ':0')."""
    if isinstance(text, str):
        n = len(model.layer_names)
        for item in re.split(r"[|,:]", text):
            match = _RANGE_RE.match(item.strip())
            if match and (len(match.group(3)) > 6 or int(match.group(3)) - int(match.group(2)) >= n):
                raise ValueError(f"layer range {item.strip()!r} is wider than the model, which has {n} layers "
                                 f"({', '.join(model.layer_names)}); write a range such as lstm0-1")
    try:
        return Placement.parse(text, model)
    except (IndexError, KeyError, AttributeError) as e:   # Placement.parse trips over some text (':0')
        raise ValueError(f"cannot read placement {text!r} ({e.__class__.__name__}: {e}); write groups of "
                         f"layers and a device, e.g. 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1'") from None


def _as_placement(placement, model) -> Placement:
    if isinstance(placement, Placement):
        if placement.layer_names != model.layer_names:
            raise ValueError(f"the placement is for layers {placement.layer_names}, "
                             f"but the model has {model.layer_names}")
        return placement
    if isinstance(placement, str):
        return parse_placement(placement, model)
    if isinstance(placement, dict):
        return Placement.from_dict(placement, model)
    if isinstance(placement, int):
        return Placement.even(model, get_devices(placement))
    raise TypeError(f"placement must be a Placement, a string like 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1', "
                    f"a dict or a device count; got {type(placement).__name__}")


def _wait_uninterrupted(futures) -> None:
    """Wait for the workers to stop even if Ctrl-C is pressed again meanwhile."""
    while True:
        try:
            wait(futures)
            return
        except KeyboardInterrupt:
            continue


def _stop_workers(workers) -> None:
    for worker in workers:
        worker.stop(wait=False)
