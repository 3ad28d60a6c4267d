"""Pipeline: runs a schedule's action lists on the devices' workers and records a Timeline."""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION

from ..lm import dropout
from ..runtime import streams
from ..runtime.devices import Device
from ..runtime.link import Link
from ..runtime.workers import QuickSwitching, start_workers, stop_workers, wait_interruptibly, wait_uninterrupted
from . import schedules
from .buckets import BucketPlan, plan_bucket, split_form, transfer_time
from .carry import CarriedState
from .device_step import DeviceStep, sender_of
from .mailbox import Aborted, Mailbox
from .placement import Placement, as_placement
from .recompute import describe_modes, recompute_modes, recompute_table
from .runner import BaseRunner, StepInterrupted, StepResult, check_inputs, check_layers, checked_schedule
from .schedules import Action, Schedule
from .stage import Stage
from .timeline import Timeline


class Pipeline(BaseRunner):
    """A model split into stages over devices, trained one schedule step at a time.

        pipe = Pipeline(model, "embed,lstm0:vgpu0 | lstm1,decode:vgpu1", "gpipe", micro_batches=4)
        result = pipe.train_step(batch)     # gradients accumulate in model's .grad
        print(result.loss, result.timeline.summary())

    `placement` is a Placement, a placement string, a dict layer -> device, or a device count (an even split).
    `schedule` is a name (then `micro_batches`, default 4, and `chunks`, default 1, shape it) or a Schedule, which
    brings its own. Workers persist across steps; `close()` (or garbage collection, or a `with` block) ends them.

    `micro_batches` is a count m (each batch cut into m equal micro-batches of B/m sentences) or a list
    of sizes, micro-batches of unequal widths side by side, adding up to the batch width:

        Pipeline(model, 2, "1f1b", micro_batches=[8, 16, 24, 16])    # batches of 64: columns 0-7 | 8-23 | ..

    Small first and last micro-batches shorten a schedule's fill and drain. The schedule sees only the
    count (`micro_batches` is then 4, `micro_batch_sizes` the list); the loss is weighted by tokens and
    dropout masks start at each micro-batch's first column, so the gradients are one device's either way.

    `link` joins virtual devices by an emulated interconnect: a Link, or text for Link.parse ("pcie4", "10gbe/100",
    "5ms,10MB/s"); None is shared memory (no added delay). A tensor sent at time t then reaches the other device no
    earlier than t + link.time(bytes): the sender goes on, the receiver sleeps, transfers in one direction queue for
    the bandwidth (see Link), and the timeline's send event spans the link's time. Between real GPUs copies take
    their real time: link= is refused.

    `recompute` trades time for memory (activation recomputation, as in GPipe and torchgpipe): None keeps every
    activation from a forward to its backward; "all" keeps only each stage's input and runs the forward again at
    the start of the backward (an "R" box in the timeline); "all-but-last" does so for every micro-batch but the
    last (torchgpipe's default; see mpedu.predict.footprint for what it saves here); {stage: mode} chooses per
    stage. Gradients are the same either way: dropout draws the same masks on the re-run (mpedu.lm.dropout).

    A memory cap is a check installed around the step (mpedu.predict.cap_memory): each callable in
    `before_training_step` sees every training batch before any worker runs.
    """

    carries_state = True

    def __init__(self, model, placement: Placement | str | dict | int = 2, schedule: str | Schedule = "gpipe",
                 micro_batches: int | list[int] | None = None, chunks: int | None = None,
                 link: Link | str | None = None, recompute=None):
        self.model = model
        self.placement = as_placement(placement, model)
        self.placement.check_tied_weights(model)
        # a list of sizes: the schedule plays its count; the sizes shape each batch's split (mpedu.core.buckets)
        count, self.micro_batch_sizes = split_form(micro_batches)
        self.schedule = schedules.for_runner(schedule, self.placement.stage_devices, count, chunks)
        self.micro_batches, self.chunks = self.schedule.micro_batches, self.schedule.chunks
        self._counts = (self.placement.stage_devices, self.micro_batches, self.chunks)   # a step's must match
        self.devices: list[Device] = self.placement.devices
        self.link = Link.parse(link).check_devices(self.devices)
        # per stage: None (keep activations), "all" or "all-but-last" (re-run the forward in the backward)
        self.recompute = recompute_modes(recompute, len(self.placement.stages))
        runs = self.placement.stages
        self.stages = [Stage(s, names, [model.layers[name].to(dev.torch_device) for name in names], dev,
                             is_last=s == len(runs) - 1) for s, (dev, names) in enumerate(runs)]
        streams.settle(self.devices)     # the layers' copies to a GPU, before any worker reads them
        # what every step's device jobs read, worked out once: per stage and micro-batch, whether its forward is
        # re-run in the backward; per device, how its worker moves tensors (mpedu.runtime.streams)
        self.recomputing = recompute_table(self.recompute, self.micro_batches)
        self.copies = [streams.copies_for(d.torch_device, [s.device.torch_device for s in self.stages])
                       for d in self.devices]
        self._modules = list(model.modules())     # whose training flags each train_step reads
        self._eval_actions = schedules.forwards_only(self.placement.stage_devices, self.micro_batches, self.chunks)
        self.bucket_cache: dict[tuple[int, int], BucketPlan] = {}
        self.before_training_step: list = []          # checks installed around the step (a memory cap)
        self.last_timeline: Timeline | None = None   # the latest train_step's, for the command line
        self.carry = CarriedState(self.stages, self.micro_batches, self.micro_batch_sizes)
        self._workers, self._core_each = start_workers(self.devices)    # a core each: they poll for hand-offs
        self._switching = QuickSwitching if self._core_each else contextlib.nullcontext
        # a worker that is this very thread (CallerThread) runs its job as it is submitted: submitted last
        self._submit_order = sorted(range(len(self.devices)), key=lambda d: self._workers[d].runs_here)
        # whose job (in submit order) plays the last stage: its DeviceStep counts the tokens and sums the loss
        self._loss_job = self._submit_order.index(self.devices.index(self.stages[-1].device))
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        self._stepping = threading.Lock()     # one step at a time: the stages hold one step's tensors
        # Dropout masks are a function of (seed, step, layer, sequence, time step): see mpedu.lm.dropout. Each
        # train_step uses dropout_step, then counts it up; train() sets both from its seed and global step, so a
        # resumed run draws the masks the uninterrupted one drew.
        self.dropout_seed, self.dropout_step = 0, 0

    def __repr__(self) -> str:
        link = f", link={self.link.name}" if self.link.emulated else ""
        recompute = describe_modes(self.recompute)
        split = self.micro_batches if self.micro_batch_sizes is None else list(self.micro_batch_sizes)
        return (f"Pipeline({self.placement}, schedule={self.schedule.name}, micro_batches={split}"
                f"{link}{recompute})")

    # -- public ---------------------------------------------------------------------
    def train_step(self, batch) -> StepResult:
        """Forward and backward one batch along the schedule; gradients accumulate in the model.

        The loss is the mean NLL per real token of the whole batch: each micro-batch
        adds nll_sum / batch.tokens, so the micro-batch losses add up exactly.
        A step that raises (an error, Ctrl-C) leaves the pipeline ready for the next one, but the
        backwards that ran before it stopped have added into `.grad`: zero the gradients first.
        """
        if not all(module.training for module in self._modules):   # (train() itself: 20 us a step)
            self.model.train()
        return self._step(batch, checked_schedule(self.schedule, self._counts).actions, train=True)

    def eval_step(self, batch) -> StepResult:
        """Forward only (no gradients), in GPipe's fill order."""
        self.model.eval()
        return self._step(batch, self._eval_actions, train=False)

    def bucket_plan(self, batch) -> BucketPlan:
        """The shape-specific part of a step, made once per bucket shape (mpedu.core.buckets)."""
        T, B = batch.inputs.shape
        plan = self.bucket_cache.get((T, B))
        if plan is None:
            plan = self.bucket_cache[T, B] = plan_bucket(self, batch)
        return plan

    def transfer_time(self, batch) -> float:
        """At least how long one training step's hand-offs take on this pipeline's link, in seconds."""
        return transfer_time(self, batch)

    def reset_state(self) -> None:
        """Forget carried recurrent state (stream mode)."""
        self.carry.forget()

    def carried_state(self) -> dict | None:
        """The recurrent state stream mode carries into the next batch (mpedu.core.carry), in the form
        any runner loads: {layer: (h, c)}, each (1, B, H), on the host; None when nothing is carried."""
        return self.carry.collect()

    def load_carried_state(self, state: dict | None) -> None:
        """Carry `state` (carried_state's form, from any runner) into the next stream-mode batch of its width."""
        self.carry.load(state, self.model, {w.device.name: w.stream for w in self._workers})

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
            plan = self._prepare(batch, train)
            with self._switching():       # workers with a core each: the interpreter lock changes hands quickly
                return self._run(batch, plan, actions, train)
        finally:
            self._stepping.release()

    def _prepare(self, batch, train: bool):
        """Everything checked before a worker runs: the pipeline, the batch's inputs (its targets: the last stage's
        worker, mpedu.core.device_step), the installed checks."""
        if not self._finalizer.alive:
            raise RuntimeError("this Pipeline is closed; build a new one")
        check_inputs(batch, self.model.vocab_size)
        check_layers(self.model, self.stages)
        plan = self.bucket_plan(batch)
        for check in self.before_training_step if train else ():
            check(batch)
        plan.steps += 1
        return plan

    def _run(self, batch, plan: "BucketPlan", actions, train: bool) -> StepResult:
        """Every device plays its row at once; the caller waits (Ctrl-C still reaches it)."""
        micro = plan.micro.load(batch)      # this step's batch, copied into the bucket's blocks as first read
        reset = self.carry.begin(batch, len(plan.chunk_bounds))
        # the step's dropout Position; each (micro-batch, chunk) draws at its first column and time step
        key = dropout.Position(self.dropout_seed, self.dropout_step) if train else None
        mailbox = Mailbox(self.link, spin=self._core_each, workers=len(actions), describe=sender_of)
        timeline = Timeline([d.name for d in self.devices], micro_batch_sizes=plan.sizes)
        t0 = time.perf_counter()
        callers = streams.caller_streams(self.devices)
        futures = []
        try:
            # Submitted inside the try: a Ctrl-C between two submissions must still abort the jobs
            # already queued, which would otherwise wait for the others' messages for ever.
            for d in self._submit_order:
                worker = self._workers[d]
                play = functools.partial(DeviceStep.play, self, d, actions[d], batch, micro, train, mailbox, timeline,
                                         t0, key, plan, reset)
                futures.append(worker.submit(streams.after(callers.get(worker.device.name), play)))
            done, _ = wait_interruptibly(futures, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                mailbox.abort()
                wait_interruptibly(futures)
                in_device_order = [f for _, f in sorted(zip(self._submit_order, futures), key=lambda df: df[0])]
                errors = [f.exception() for f in in_device_order if f.exception() is not None
                          and not isinstance(f.exception(), Aborted)]
                raise errors[0] if errors else mailbox.failure or RuntimeError("pipeline step aborted")
        except KeyboardInterrupt:
            self._clean_up(mailbox, futures)
            raise StepInterrupted() from None       # one line that says what happened, not 40 of threads
        except BaseException:
            self._clean_up(mailbox, futures)
            raise
        # ...and the caller's next work on each GPU (clip, optimizer step, zero_grad) waits for this step's
        streams.wait_for_workers(callers, self._workers)
        last = futures[self._loss_job].result()         # the last stage's DeviceStep
        nll, tokens = last.nll_sum, last.tokens       # one sync, not one per micro-batch (DeviceStep.run)
        if train:
            for stage in self.stages:
                stage.saved.clear()
            self.last_timeline = timeline
            self.dropout_step += 1
        return StepResult(loss=nll / tokens, nll_sum=nll, tokens=tokens, timeline=timeline)

    def _clean_up(self, mailbox: Mailbox, futures) -> None:
        """After Ctrl-C or a failure: wake every worker, let each finish its current action, then drop
        the step's tensors so the next step starts clean. A worker runs its jobs in order: once an empty
        job has run on each, every job of this step has ended, also one queued by a submit that Ctrl-C
        kept from returning its future."""
        mailbox.abort()
        wait_uninterrupted(futures + [w.submit(_nothing) for w in self._workers if w.alive])
        self.carry.forget()


def _nothing() -> None:
    """An empty job: a worker has finished every job queued before it once it has run."""
