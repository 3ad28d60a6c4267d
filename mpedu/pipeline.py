"""Pipeline: runs a schedule's action lists on the devices' workers and records a Timeline."""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION
from dataclasses import dataclass, field, replace

import torch

from . import capacity, dropout, footprint, schedules, streams
from .footprint import Footprint, recomputes
from .clock import Clock
from .devices import (CallerThread, Device, Worker, get_devices, own_cores, stop_workers, wait_interruptibly,
                      wait_uninterrupted)
from .link import Link, format_duration
from .mailbox import Aborted, Mailbox
from .placement import Placement
from .runner import BaseRunner, StepResult, check_batch, check_carried
from .schedules import Action, Schedule, ScheduleError
from .stage import Stage
from .timeline import Event, Timeline


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nothing() -> None:
    """An empty job: a worker has finished every job queued before it once it has run."""


class Pipeline(BaseRunner):
    """A model split into stages over devices, trained one schedule step at a time.

        pipe = Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=4)
        result = pipe.train_step(batch)     # gradients accumulate in model's .grad
        print(result.loss, result.timeline.summary())

    `placement` is a Placement, a placement string, a dict layer -> device, or a
    device count (an even split). `schedule` is a name (then `micro_batches`, default 4,
    and `chunks`, default 1, shape it) or a Schedule, which brings its own. Workers
    persist across steps; `close()` (or garbage collection, or a `with` block) ends them.

    `memory_cap` limits what a device may hold: one size for every device ("2MB",
    or a number of bytes) or a dict device -> size ({"vgpu:0": "2MB"}). Before the
    first step on each batch shape, `memory_estimate` (parameters, gradients and the
    activations of the micro-batches the schedule holds at once) is checked against
    it; a device over its cap raises MemoryCapError naming a placement that fits.

    `link` joins virtual devices by an emulated interconnect: a Link, or text for
    Link.parse ("pcie4", "10gbe/100", "5ms,10MB/s"); None is shared memory (no added
    delay). A tensor sent at time t then reaches the other device no earlier than
    t + link.time(bytes): the sender goes on, the receiver sleeps, transfers in one
    direction queue for the bandwidth (see Link), and the timeline's send event spans
    the link's time. Between real GPUs copies take their real time: link= is refused.

    `recompute` trades time for memory (activation recomputation, as in GPipe and torchgpipe):
    None keeps every activation from a forward to its backward; "all" keeps only each stage's
    input and runs the forward again at the start of the backward (an "R" box in the timeline);
    "all-but-last" does so for every micro-batch but the last (torchgpipe's default; see
    mpedu.footprint for what it saves here); {stage: mode} chooses per stage. Gradients are the same either way:
    dropout draws the same masks on the re-run (mpedu.dropout).
    """

    carries_state = True

    def __init__(self, model, placement: Placement | str | dict | int = 2, schedule: str | Schedule = "gpipe",
                 micro_batches: int | None = None, chunks: int | None = None, memory_cap=None, link: Link | str | None = None,
                 recompute=None):
        self.model = model
        self.placement = _as_placement(placement, model)
        if not isinstance(schedule, (str, Schedule)):
            raise TypeError(f"schedule must be a name such as 'gpipe' or a Schedule, got {schedule!r}")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks must be a whole number >= 1, got {chunks!r}")
        if isinstance(micro_batches, bool):
            raise ValueError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}")
        self.placement.check_tied_weights(model)
        stage_devices = self.placement.stage_devices
        if isinstance(schedule, Schedule):
            if list(schedule.stage_devices) != stage_devices:
                raise ValueError(f"schedule {schedule.name!r} was built for stage devices "
                                 f"{list(schedule.stage_devices)}, but this placement gives {stage_devices}")
            # its own copy of the rows: an edit of the caller's schedule after this would otherwise reach the
            # steps unchecked (and a cycle between devices would wait for ever)
            self.schedule = replace(schedule, actions=[list(row) for row in schedule.actions]).validate()
            schedule.check_counts(micro_batches, chunks)
        else:
            self.schedule = schedules.make(schedule, stage_devices, 4 if micro_batches is None else micro_batches,
                                           1 if chunks is None else chunks)
        self.micro_batches = self.schedule.micro_batches
        self.chunks = self.schedule.chunks
        self._counts = (stage_devices, self.micro_batches, self.chunks)     # what a step's schedule must keep
        self.devices: list[Device] = self.placement.devices
        self.link = Link.parse(link)
        gpus = [d.name for d in self.devices if d.is_cuda]
        if self.link.emulated and gpus and len(self.devices) > 1:
            raise ValueError(f"link={self.link.name!r} emulates an interconnect between virtual devices, but this "
                             f"placement uses {', '.join(gpus)}, whose copies take their real time; drop link= "
                             "here (to predict another interconnect, give it to simulate(..., link=...))")
        self.memory_cap = capacity.parse_caps(memory_cap, self.devices)
        # per stage: None (keep activations), "all" or "all-but-last" (re-run the forward in the backward)
        self.recompute = footprint.recompute_modes(recompute, len(self.placement.stages))
        runs = self.placement.stages
        self.stages = []
        for s, (dev, names) in enumerate(runs):
            layers = [model.layers[name].to(dev.torch_device) for name in names]
            self.stages.append(Stage(s, names, layers, dev, is_last=s == len(runs) - 1))
        for dev in self.devices:
            # The copies to a GPU (and the LSTM's weight flattening) ran on this thread's stream;
            # the workers' streams do not wait for it: let them finish before any worker reads them.
            if dev.is_cuda:
                torch.cuda.current_stream(dev.torch_device).synchronize()
        # Forward-only order for eval_step: the fill order (GPipe's, or the wavefront's), no backwards.
        fill = (schedules.wavefront(stage_devices, self.micro_batches, self.chunks) if self.chunks > 1
                else schedules.gpipe(stage_devices, self.micro_batches))
        self._eval_actions = [[a for a in row if a.kind == "F"] for row in fill.actions]
        self.bucket_cache: dict[tuple[int, int], BucketPlan] = {}
        self.last_timeline: Timeline | None = None   # the latest train_step's, for the command line
        self._workers = []
        # virtual devices with a core each: each worker pinned to its core, and polling for a hand-off
        # (Mailbox) when it waits, since no one else needs that core
        cores = own_cores(self.devices) if len(self.devices) > 1 else None
        self._core_each = cores is not None
        try:
            # one virtual device runs on the caller's thread (see CallerThread: nothing to overlap)
            lone = len(self.devices) == 1 and self.devices[0].virtual
            for k, dev in enumerate(self.devices):
                self._workers.append(CallerThread(dev) if lone else Worker(dev, core=cores[k] if cores else None))
        except BaseException:     # a GPU that cannot start: end the workers already started
            stop_workers(self._workers)
            raise
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        self._stepping = threading.Lock()     # one step at a time: the stages hold one step's tensors
        self._carry_shape = None
        # Dropout masks are a function of (seed, step, layer, sequence, time step): see mpedu.dropout.
        # Each train_step uses dropout_step, then counts it up; train() sets both from its seed and
        # global step, so a resumed run draws the masks the uninterrupted one drew.
        self.dropout_seed = 0
        self.dropout_step = 0

    def __repr__(self) -> str:
        link = f", link={self.link.name}" if self.link.emulated else ""
        modes = set(self.recompute)
        recompute = "" if modes == {None} else f", recompute={self.recompute[0]!r}" if len(modes) == 1 else (
            f", recompute={ {s: m for s, m in enumerate(self.recompute) if m} }")
        return (f"Pipeline({self.placement}, schedule={self.schedule.name}, micro_batches={self.micro_batches}"
                f"{link}{recompute})")

    # -- public ---------------------------------------------------------------------
    def train_step(self, batch) -> StepResult:
        """Forward and backward one batch along the schedule; gradients accumulate in the model.

        The loss is the mean NLL per real token of the whole batch: each micro-batch
        adds nll_sum / batch.tokens, so the micro-batch losses add up exactly.
        A step that raises (an error, Ctrl-C) leaves the pipeline ready for the next one, but the
        backwards that ran before it stopped have added into `.grad`: zero the gradients first.
        """
        if not all(module.training for module in self.model.modules()):   # (train() itself: 20 us a step)
            self.model.train()
        return self._step(batch, self._checked_schedule().actions, train=True)

    def _checked_schedule(self) -> Schedule:
        """`self.schedule`, checked again if it was edited or replaced since it was checked: its rows are
        lists a caller can change, and an edited row would run unchecked (a missing backward: wrong
        gradients; a missing forward: a wait with nobody to send). Cheap when unchanged: one hash."""
        schedule = self.schedule
        if not isinstance(schedule, Schedule):
            raise TypeError(f"pipe.schedule was replaced by {schedule!r}, not a Schedule; build a new Pipeline "
                            "with the schedule you want")
        counts = (list(schedule.stage_devices), schedule.micro_batches, schedule.chunks)
        if counts != self._counts:
            raise ScheduleError(
                f"pipe.schedule was changed after the Pipeline was built: it now puts stages on devices "
                f"{counts[0]} with {counts[1]} micro-batches and {counts[2]} time chunks, this pipeline "
                f"{self.placement.stage_devices}, {self.micro_batches} and {self.chunks}; build a new Pipeline")
        try:
            return schedule.validated()
        except ScheduleError as e:
            raise ScheduleError(f"pipe.schedule was edited after the Pipeline was built and cannot run, so "
                                f"no step ran: {e}") from None

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
            seconds = self.transfer_time(batch)
            if seconds > LINK_LIMIT_S:
                raise ValueError(
                    f"link {self.link}: one step's hand-offs on a ({T}, {B}) batch would take at least "
                    f"{format_duration(seconds)}, and a step waits for them; mpedu refuses a link slower than "
                    f"{LINK_LIMIT_S:g} s of transfers a step. A typo? '1ms,1GB/s' is 1 ms + bytes / (1 GB/s); "
                    f"'10gbe/100' is 10 Gb Ethernet slowed 100x")
            plan = BucketPlan(T, B, B // self.micro_batches, streams.chunk_bounds(T, self.chunks))
            self.bucket_cache[T, B] = plan
        return plan

    def transfer_time(self, batch) -> float:
        """At least how long one training step's hand-offs take on this pipeline's link, in seconds (0 on
        shared memory): between two devices each direction queues its tensors for the bandwidth, and
        the last one lands a latency later. A stage's output is (T, B/m, width) floats, its gradient too."""
        if not self.link.emulated:
            return 0.0
        T, B = batch.inputs.shape
        itemsize = next(self.model.parameters()).element_size()
        config, routes = self.model.config, {}
        for here, there in zip(self.stages, self.stages[1:]):
            width = config.embed_size if here.names[-1] == "embed" else config.hidden_size
            nbytes = T * -(-B // self.micro_batches) * width * itemsize * self.micro_batches   # all micro-batches
            for route in ((here.device.name, there.device.name), (there.device.name, here.device.name)):
                routes[route] = routes.get(route, 0) + nbytes
        return max((self.link.time(n) for n in routes.values()), default=0.0)

    def memory_estimate(self, batch) -> list[Footprint]:
        """What each device holds for a training step on batches of this shape: its weights, their
        gradients, and the activations at the schedule's peak (mpedu.footprint), with this pipeline's
        recomputation. The activations of one micro-batch come from a dry run of its forward with
        saved-tensor hooks (the counting a training step records in its timeline), made once per
        bucket shape. Not counted: optimizer state (the pipeline never sees the optimizer; plain SGD
        keeps none) and short-lived buffers inside an op."""
        check_batch(batch, self.model.vocab_size)
        plan = self._plan(batch)
        sizes = self._layer_sizes(batch, plan)              # per time chunk
        return footprint.device_footprints(sizes[0], self.placement, self.schedule, self.recompute,
                                           caps=self.memory_cap, chunk_costs=sizes)

    def _which_train(self) -> tuple[bool, ...]:
        """Which of the stages' weights require grad now: a key for what a step saves."""
        return tuple(p.requires_grad for stage in self.stages for p in stage._all_params)

    def _layer_sizes(self, batch, plan: "BucketPlan"):
        # what a step saves depends on which weights train now (a layer frozen or thawed after the pipeline was
        # built): one dry run per such choice; always of a training step (train mode, dropout masks and all)
        trains = self._which_train()
        if trains not in plan.sizes:
            layers = [layer for stage in self.stages for layer in stage.layers]
            modes = [layer.training for layer in layers]
            try:
                for layer in layers:
                    layer.train()
                plan.sizes[trains] = capacity.layer_sizes(self.stages, batch.split(self.micro_batches)[0],
                                                          plan.chunk_bounds, self.model)
            finally:
                for layer, mode in zip(layers, modes):
                    layer.train(mode)
        return plan.sizes[trains]

    def reset_state(self) -> None:
        """Forget carried recurrent state (stream mode)."""
        self._carry_shape = None
        for stage in self.stages:
            stage.reset()

    def carried_state(self) -> dict | None:
        """The recurrent state stream mode carries into the next batch: {layer: (h, c)}, each (1, B, H) for the
        whole batch width (the micro-batches side by side), on the CPU; None when nothing is carried. The
        form is the placement's business no more: any runner loads it (load_carried_state). B is the width the
        pipeline ran: a batch widened by empty columns (mpedu.runner.fitted) leaves them at the end; keep the
        first columns, the stream's (mpedu.training.stream_columns)."""
        if self._carry_shape is None:
            return None
        out = {}
        for stage in self.stages:
            for name in stage.names:
                parts = [stage.state.get(mb, {}).get(name) for mb in range(self.micro_batches)]
                if parts and all(p is not None for p in parts):
                    out[name] = tuple(torch.cat([p[i].detach().cpu() for p in parts], dim=1)
                                      for i in range(len(parts[0])))
        return out or None

    def load_carried_state(self, state: dict | None) -> None:
        """Carry `state` (carried_state's form, from any runner) into the next stream-mode batch of its width
        (widened, as mpedu.runner.fitted widens that batch, by empty columns when the micro-batches do not
        divide it: their state is zeros, and no loss or gradient depends on it)."""
        self.reset_state()
        if not state:
            return
        width = check_carried(state, self.model)
        extra = -width % self.micro_batches
        state = {name: tuple(torch.cat([t, t.new_zeros(t.shape[0], extra, t.shape[2])], 1) for t in ts)
                 for name, ts in state.items()}
        width += extra
        b = width // self.micro_batches
        # On a GPU the copies run on this thread's stream, which the workers' streams wait for at the step's
        # start (streams.after); but a worker frees the state once its kernels are queued, and the memory, this
        # stream's, could be handed out again before they ran: record that the worker's stream uses it.
        worker_streams = {w.device.name: w.stream for w in self._workers}
        for stage in self.stages:
            stream = worker_streams.get(stage.device.name)
            for name in stage.names:
                if name in state:
                    for mb in range(self.micro_batches):
                        parts = tuple(t[:, mb * b:(mb + 1) * b].to(stage.device.torch_device).contiguous()
                                      for t in state[name])
                        if stream is not None:
                            for part in parts:
                                part.record_stream(stream)
                        stage.state.setdefault(mb, {})[name] = parts
        self._carry_shape = (0, width)

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
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("this Pipeline is running a step in another thread; a pipeline runs one step at a "
                               "time (its stages hold that step's activations): wait for it, or build a second "
                               "Pipeline on other devices")
        try:
            return self._one_step(batch, actions, train)
        finally:
            self._stepping.release()

    def _one_step(self, batch, actions: list[list[Action]], train: bool) -> StepResult:
        if not self._finalizer.alive:
            raise RuntimeError("this Pipeline is closed; build a new one")
        tokens = check_batch(batch, self.model.vocab_size)
        for stage in self.stages:        # the stages run the layers they were given: a swapped one would not train
            for name, layer in zip(stage.names, stage.layers):
                if self.model.layers[name] is not layer:
                    raise RuntimeError(f"the model's layer {name!r} was replaced after this Pipeline was built, "
                                       "which would go on running the old one; build a new Pipeline on the model")
        plan = self._plan(batch)
        # before the step: nothing has run yet (again when other weights train now: a thawed layer saves more);
        # which weights train is read only where a cap is set, off an uncapped pipeline's step
        if train and self.memory_cap and (trains := self._which_train()) not in plan.memory_checked:
            capacity.check_memory(self.memory_estimate(batch), self._layer_sizes(batch, plan), self.placement,
                                  self.schedule, self.recompute, self.memory_cap, (plan.T, plan.B))
            plan.memory_checked.add(trains)
        plan.steps += 1
        micro = streams.MicroBatches(batch, self.micro_batches, plan.chunk_bounds,
                                     pin_inputs=self.stages[0].device.is_cuda,
                                     pin_targets=self.stages[-1].device.is_cuda)
        # Stream mode carries each micro-batch's state into the next batch of the same width B, as
        # SingleDevice does: a shorter window (the last of a pass) keeps it too. Micro-batch i is
        # columns i*B/m .. of every batch, so its state belongs to the same sequences whatever T is.
        carry = bool(getattr(batch, "carry_state", False))
        keep_state = carry and self._carry_shape is not None and self._carry_shape[1] == batch.inputs.shape[1]
        self._carry_shape = tuple(batch.inputs.shape) if carry else None
        for stage in self.stages:
            stage.reset(keep_state=keep_state, carry=carry, chunks=len(plan.chunk_bounds))
        # the step's dropout Position; each (micro-batch, chunk) draws at its first column and time step
        key = dropout.Position(self.dropout_seed, self.dropout_step) if train else None
        mailbox = Mailbox(self.link, spin=self._core_each, workers=len(actions), describe=_sender_of)
        timeline = Timeline([d.name for d in self.devices])
        t0 = time.perf_counter()
        callers = streams.caller_streams(self.devices)
        futures = []
        try:
            # Submitted inside the try: a Ctrl-C between two submissions must still abort the jobs
            # already queued, which would otherwise wait for the others' messages for ever.
            for d, (worker, row) in enumerate(zip(self._workers, actions)):
                futures.append(worker.submit(streams.after(callers.get(worker.device.name), self._device_job(
                    d, row, micro, 1.0 / tokens, train, mailbox, timeline, t0, key, plan))))
            done, _ = wait_interruptibly(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                mailbox.abort()
                wait_interruptibly(futures)
                errors = [f.exception() for f in futures if f.exception() is not None
                          and not isinstance(f.exception(), Aborted)]
                raise errors[0] if errors else mailbox.failure or RuntimeError("pipeline step aborted")
        except BaseException:
            # Ctrl-C or a failure: wake every worker, let each finish its current action,
            # then drop the step's tensors so the next step starts clean.
            mailbox.abort()
            # A worker runs its jobs in order: once an empty job has run on each, every job of this
            # step has ended, also one queued by a submit that Ctrl-C kept from returning its future.
            wait_uninterrupted(futures + [w.submit(_nothing) for w in self._workers if w.alive])
            for stage in self.stages:
                stage.reset()
            self._carry_shape = None
            raise
        # ...and the caller's next work on each GPU (clip, optimizer step, zero_grad) waits for this
        # step's. (Each worker also waits for its stream before it reports, so this costs nothing; after
        # a failure that wait alone orders them.)
        for worker in self._workers:
            if worker.stream is not None:
                callers[worker.device.name].wait_stream(worker.stream)
        last = self.stages[-1]
        nll = float(torch.stack(list(last.nll.values())).double().sum())   # one sync, not one per micro-batch
        if train:
            for stage in self.stages:
                stage.saved.clear()
            self.last_timeline = timeline
            self.dropout_step += 1
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens, timeline=timeline)

    def _device_job(self, d: int, row: list[Action], micro, scale: float, train: bool,
                    mailbox: Mailbox, timeline: Timeline, t0: float, key=None, plan=None):
        device = self.devices[d]
        here = device.torch_device
        stages, last = self.stages, len(self.stages) - 1
        homes = [stage.device.torch_device for stage in stages]
        copies = [home != here for home in homes]    # a real copy to that stage (virtual devices share the host)
        on_host = here.type == "cpu"                 # the micro-batches live on the host
        split = self.schedule.split_backward

        def send(tensor, kind, src: int, dst: int, a: Action, clock, marks):
            """Hand `tensor` from stage src to stage dst (always another device)."""
            start = clock.mark()
            moved, ready = tensor, None     # the receiver detaches it (Stage.forward); a gradient has no graph
            if copies[dst]:            # a real copy; virtual devices all use the CPU's memory: nothing to move
                moved = tensor.detach().to(homes[dst], non_blocking=True)
                if moved.is_cuda or tensor.is_cuda:
                    # the copy is queued on the source GPU's current stream (this worker's), or on
                    # the target GPU's when the source is the CPU; mark its end there
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(tensor.device if tensor.is_cuda else moved.device))
            end = clock.mark()
            peer, nbytes = stages[dst].device.name, _nbytes(tensor)
            # on an emulated link (virtual devices only) the send lasts until the tensor lands
            landing = mailbox.put((kind, dst, a.mb, a.chunk), (moved, ready), (device.name, peer), nbytes)
            marks.append(("send", src, a, start, end if landing is None else landing, nbytes, peer, 0))

        def receive(kind, a: Action):
            moved, ready = mailbox.get((kind, a.stage, a.mb, a.chunk), (device.name, a))
            if ready is not None and moved.is_cuda:   # make this device's stream wait for the copy
                stream = torch.cuda.current_stream()
                stream.wait_event(ready)
                moved.record_stream(stream)
            elif ready is not None:                   # GPU -> CPU: the host must wait for the copy itself
                ready.synchronize()
            return moved

        def job():
            clock = Clock(device, t0)
            marks = []
            try:
                for a in row:
                    if mailbox.aborted:
                        raise Aborted
                    stage = stages[a.stage]
                    if a.kind == "F":
                        # (t, b) slices of the batch, pinned on the host when the device is a GPU (the copy
                        # does not block); on a virtual device no torch call at all (see MicroBatches)
                        if a.stage == 0:
                            x = micro.inputs(a.mb, a.chunk)
                            x = x if on_host else x.to(here, non_blocking=True)
                        else:
                            x = receive("act", a)
                        targets = micro.targets(a.mb, a.chunk) if a.stage == last else None
                        if targets is not None and not on_host:
                            targets = targets.to(here, non_blocking=True)
                        # dropout draws at the slice's first batch column and time step
                        where = key and key.at(a.mb * plan.micro_batch, plan.chunk_bounds[a.chunk][0])
                        again = train and recomputes(self.recompute[a.stage], a.mb, self.micro_batches)
                        start = clock.mark()
                        out = stage.forward(a.mb, a.chunk, x, targets, scale, train=train, where=where,
                                            recompute=again)
                        held = stage.saved_bytes(a.mb, a.chunk)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "", held))
                        if a.stage < last:
                            send(out, "act", a.stage, a.stage + 1, a, clock, marks)
                    elif a.kind == "B":
                        grad = receive("grad", a) if a.stage < last else None
                        if stage.recomputes(a.mb, a.chunk):
                            # R: the forward again, now keeping what backward needs (its own box)
                            start = clock.mark()
                            grown = stage.recompute_forward(a.mb, a.chunk)
                            marks.append(("R", a.stage, a, start, clock.mark(), 0, "", grown))
                        held = stage.saved_bytes(a.mb, a.chunk)
                        start = clock.mark()
                        grad_in = stage.backward(a.mb, a.chunk, grad, weights=a.stage not in split)
                        # freed (fused), or kept for W with the output's gradient besides (split)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "",
                                      stage.saved_bytes(a.mb, a.chunk) - held))
                        if a.stage > 0:
                            send(grad_in, "grad", a.stage, a.stage - 1, a, clock, marks)
                    else:
                        held = stage.saved_bytes(a.mb, a.chunk)
                        start = clock.mark()
                        stage.backward_weight(a.mb, a.chunk)
                        marks.append((a.kind, a.stage, a, start, clock.mark(), 0, "", -held))
                mailbox.finished()      # this device sends nothing more (a receive that waits for it never ends)
            finally:
                if device.is_cuda:
                    torch.cuda.current_stream().synchronize()
                # the events are made when someone reads the timeline, not on the step's critical path
                timeline.add_later(lambda: [
                    Event(device.name, kind, s, a.mb, clock.seconds(start), clock.seconds(end), a.chunk, nbytes,
                          peer, memory) for kind, s, a, start, end, nbytes, peer, memory in marks])
        return job


def _sender_of(key) -> str:
    """A mailbox key in words: what is awaited and which action sends it."""
    kind, stage, mb, chunk = key
    sender = Action("F", stage - 1, mb, chunk) if kind == "act" else Action("B", stage + 1, mb, chunk)
    what = "the activation" if kind == "act" else "the gradient"
    return f"{what} {sender} sends to stage {stage}"


LINK_LIMIT_S = 60.0     # seconds of hand-offs a step may need on an emulated link: more is a typo, not a lesson


@dataclass
class BucketPlan:
    """What a pipeline prepared for one batch shape (T, B): every micro-batch of the bucket
    has shape (T, micro_batch) through all stages, cut in time at `chunk_bounds`."""

    T: int
    B: int
    micro_batch: int
    chunk_bounds: list[tuple[int, int]]
    steps: int = 0      # how many steps used this plan
    # the layers' bytes per time chunk (Costs without times) for memory_estimate, by which weights train
    sizes: dict = field(default_factory=dict)
    memory_checked: set = field(default_factory=set)     # those choices checked against memory_cap

    def __str__(self) -> str:
        chunks = ", ".join(f"[{lo}:{hi})" for lo, hi in self.chunk_bounds)
        return (f"bucket T={self.T}, B={self.B}: micro-batches of {self.micro_batch}, "
                f"time chunks {chunks}, used {self.steps}x")


def _as_placement(placement, model) -> Placement:
    if isinstance(placement, Placement):
        if placement.layer_names != model.layer_names:
            raise ValueError(f"the placement is for layers {placement.layer_names}, "
                             f"but the model has {model.layer_names}")
        return placement
    if isinstance(placement, str):
        return Placement.parse(placement, model)
    if isinstance(placement, dict):
        return Placement.from_dict(placement, model)
    if isinstance(placement, int) and not isinstance(placement, bool):
        return Placement.even(model, get_devices(placement))
    raise TypeError(f"placement must be a Placement, a string like 'embed,lstm0:vgpu0 | lstm1,decode:vgpu1', "
                    f"a dict or a device count; got {type(placement).__name__}")
