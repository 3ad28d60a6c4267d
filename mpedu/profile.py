"""Measure each layer's forward and backward time and memory on a device: the simulator's cost model."""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass, fields

import torch

from . import dropout
from .devices import Worker, get_device
from .footprint import param_sizes
from .model import nll_sum
from .stage import count_saved


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch (seconds, bytes). Plain numbers are fine:
    `StageCost(1.0)` is the textbook unit stage, F = 1, B + W = 2, B = W = 1.

    backward is the fused backward (input and weight gradients in one pass, what
    a stage outside a zero-bubble schedule runs); backward_input (B) and
    backward_weight (W) are the two halves a zero-bubble schedule runs apart.
    They need not add up to backward: on CPU an LSTM's backward kernel computes
    both gradients whichever is asked for, so B and W each cost about a full backward.
    """

    forward: float
    backward: float | None = None          # default 2 x forward
    backward_input: float | None = None    # default backward / 2
    backward_weight: float | None = None   # default backward / 2
    output_bytes: int = 0                  # activation sent to the next stage (its gradient comes back)
    activation_bytes: int = 0              # what autograd keeps per micro-batch until the backward
    param_bytes: int = 0
    names: tuple[str, ...] = ()
    input_bytes: int = 0                   # the stage's input (0 for token ids): all a recomputing stage keeps
    input_saved_bytes: int = 0             # the part of activation_bytes that is the input itself
    trainable_bytes: int | None = None     # weights that get a gradient (default: param_bytes)

    def __post_init__(self):
        if self.trainable_bytes is None:
            object.__setattr__(self, "trainable_bytes", self.param_bytes)
        if self.forward < 0:
            raise ValueError(f"a stage cannot take negative time: forward={self.forward}")
        if self.backward is None:
            object.__setattr__(self, "backward", 2.0 * self.forward)
        for half in ("backward_input", "backward_weight"):
            if getattr(self, half) is None:
                object.__setattr__(self, half, self.backward / 2)


@dataclass
class Costs:
    """Per-layer costs of one micro-batch, measured by `profile` on one device.

    Times are medians in seconds; bytes are per micro-batch. `param_bytes` counts a weight
    shared by two layers (tied embedding and decoder) once, in the first. `shared_bytes[l]` is
    what layer l and layer l-1 both save (l's input is l-1's output): counted once
    when the two layers sit in one stage.
    """

    names: list[str]
    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    activation_bytes: list[int]
    output_bytes: list[int]
    param_bytes: list[int]
    shared_bytes: list[int]
    micro_batch: tuple[int, int]     # (T, b)
    device: str = "vgpu:0"
    trainable_bytes: list[int] | None = None     # weights that get a gradient; None: all of param_bytes
    input_saved_bytes: list[int] | None = None   # bytes of its own input a layer saves; None: 0

    def __post_init__(self):
        self.micro_batch = tuple(self.micro_batch)
        n = len(self.names)
        if self.trainable_bytes is None:
            self.trainable_bytes = list(self.param_bytes)
        if self.input_saved_bytes is None:
            self.input_saved_bytes = [0] * n

    def stages(self, placement) -> list[StageCost]:
        """One StageCost per stage of a Placement (or of a list of layer-name lists).

        F and the fused backward add up over the stage's layers. B (input gradient)
        is zero on a stage whose input is token ids (nothing to send back). W
        re-walks the stage's graph from its output to reach every weight, so every
        layer but the first runs its full backward again: W = W(first) + sum of the rest.
        """
        groups = [names for _, names in placement.stages] if hasattr(placement, "stages") else placement
        index = {name: k for k, name in enumerate(self.names)}
        out = []
        for s, names in enumerate(groups):
            missing = [n for n in names if n not in index]
            if missing:
                raise ValueError(f"layer {missing[0]!r} was not profiled; these costs cover {', '.join(self.names)}")
            ks = [index[n] for n in names]
            if ks != list(range(ks[0], ks[0] + len(ks))):
                raise ValueError(f"stage {s} ({', '.join(names)}) is not a run of consecutive layers")
            first, rest = ks[0], ks[1:]
            out.append(StageCost(
                forward=sum(self.forward[k] for k in ks),
                backward=sum(self.backward[k] for k in ks),
                backward_input=0.0 if first == 0 else sum(self.backward_input[k] for k in ks),
                backward_weight=self.backward_weight[first] + sum(self.backward[k] for k in rest),
                output_bytes=self.output_bytes[ks[-1]],
                activation_bytes=sum(self.activation_bytes[k] for k in ks) - sum(self.shared_bytes[k] for k in rest),
                param_bytes=sum(self.param_bytes[k] for k in ks),
                names=tuple(names),
                input_bytes=self.output_bytes[first - 1] if first > 0 else 0,
                input_saved_bytes=self.input_saved_bytes[first],
                trainable_bytes=sum(self.trainable_bytes[k] for k in ks)))
        return out

    def table(self) -> str:
        """A text table: one row per layer (ms and MB per micro-batch), then the totals."""
        T, b = self.micro_batch
        head = (f"{'layer':<8}{'F ms':>8}{'B+W ms':>8}{'B ms':>8}{'W ms':>8}"
                f"{'act MB':>9}{'out MB':>9}{'param MB':>9}")
        rows = [f"costs of one micro-batch (T={T}, b={b}) on {self.device}", head]
        for k, name in enumerate(self.names):
            rows.append(f"{name:<8}{self.forward[k] * 1e3:>8.2f}{self.backward[k] * 1e3:>8.2f}"
                        f"{self.backward_input[k] * 1e3:>8.2f}{self.backward_weight[k] * 1e3:>8.2f}"
                        f"{self.activation_bytes[k] / 1e6:>9.2f}{self.output_bytes[k] / 1e6:>9.2f}"
                        f"{self.param_bytes[k] / 1e6:>9.2f}")
        rows.append(f"{'total':<8}{sum(self.forward) * 1e3:>8.2f}{sum(self.backward) * 1e3:>8.2f}"
                    f"{sum(self.backward_input) * 1e3:>8.2f}{sum(self.backward_weight) * 1e3:>8.2f}"
                    f"{(sum(self.activation_bytes) - sum(self.shared_bytes)) / 1e6:>9.2f}{'':>9}"
                    f"{sum(self.param_bytes) / 1e6:>9.2f}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def median(cls, runs: list["Costs"]) -> "Costs":
        """Element-wise median of several profiles of one model (steadier when the machine is busy)."""
        if not runs or any(r.names != runs[0].names for r in runs):
            raise ValueError("Costs.median needs one or more profiles of the same layers")
        d = runs[0].to_dict()
        for key in ("forward", "backward", "backward_input", "backward_weight"):
            d[key] = [statistics.median(getattr(r, key)[k] for r in runs) for k in range(len(runs[0].names))]
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Costs fields {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)


def profile(model, batch, device="vgpu:0", micro_batches: int = 1, warmup: int = 2, repeats: int = 5) -> Costs:
    """Time and weigh every layer of `model` on one micro-batch of `batch`, on `device`.

    The layers run on the device's own worker (single-threaded on a virtual device,
    like in a Pipeline), each as a one-layer stage would: input detached at the
    boundary, the last layer including the loss. They are a copy of the model's, on
    the device: the caller's model stays where it is, with its gradients and mode (a
    live Pipeline keeps its layers on its GPUs).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    dev = get_device(device)
    micro = batch.split(micro_batches)[0]
    twin = _copy_without_grads(model).to(dev.torch_device).train()
    layers = [twin.layers[name] for name in model.layer_names]
    worker = Worker(dev)
    try:
        measured, input_saved = worker.submit(lambda: _measure(layers, micro, dev, warmup, repeats)).result()
    finally:
        worker.stop()
    params, trainable = param_sizes(twin, model.layer_names)      # a tied weight once
    f, bw, b, w, act, out, _, shared = measured
    return Costs(model.layer_names, f, bw, b, w, act, out, params, shared, micro_batch=tuple(micro.inputs.shape),
                 device=dev.name, trainable_bytes=trainable, input_saved_bytes=input_saved)


def _copy_without_grads(model):
    """A deep copy of `model` (tied weights stay tied) whose parameters have no .grad yet."""
    grads = {p: p.grad for p in model.parameters()}
    try:
        for p in grads:
            p.grad = None
        return copy.deepcopy(model)
    finally:
        for p, g in grads.items():
            p.grad = g


def _measure(layers, micro, dev, warmup, repeats):
    """Runs on the device's worker. Dropout draws random numbers: put the generator back after.
    Positional dropout, as a runner's step draws it (its bool masks are what a step saves)."""
    with torch.random.fork_rng(devices=[dev.torch_device.index or 0] if dev.is_cuda else []), \
            dropout.at(dropout.Position(0, 0)):
        return _measure_layers(layers, micro, dev, warmup, repeats)


def _measure_layers(layers, micro, dev, warmup, repeats):
    """Inputs per layer, saved bytes, then the timings."""
    # (T, b), copied: a micro-batch is a view of its whole batch's block, whose bytes the
    # embedding's saved indices would otherwise count
    tokens = micro.inputs.to(dev.torch_device, copy=True)
    targets = micro.targets.to(dev.torch_device, copy=True)
    scale = 1.0 / max(int(micro.tokens), 1)
    last = len(layers) - 1

    def sync():
        if dev.is_cuda:
            torch.cuda.synchronize(dev.torch_device)

    def forward(k, x):
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)         # the boundary, as in a Stage
        y, _ = layers[k](x)
        if k == last:
            y = nll_sum(y, targets) * scale
        return x, y

    # One forward pass: every layer's input, output size and saved storages.
    inputs, saved, output_bytes = [], [], []
    params = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    data = {tokens.untyped_storage().data_ptr(), targets.untyped_storage().data_ptr()}
    x = tokens
    for k in range(len(layers)):
        storages: dict[int, int] = {}

        inputs.append(x)
        # weights are param_bytes, not activations; nor are the token ids and targets, which a runner
        # holds for the whole step whatever the schedule (as Stage counts a step's saved tensors)
        with torch.autograd.graph.saved_tensors_hooks(count_saved(storages, params | data), lambda t: t):
            _, y = forward(k, x)
        saved.append(storages)
        output_bytes.append(0 if k == last else y.numel() * y.element_size())
        x = y.detach()
    shared = [0] + [sum(n for ptr, n in saved[k].items() if ptr in saved[k - 1]) for k in range(1, len(layers))]
    # what a recomputing stage starting at layer k keeps anyway (its input) and need not count twice
    input_saved = [saved[k].get(x.untyped_storage().data_ptr(), 0) if x.is_floating_point() else 0
                   for k, x in enumerate(inputs)]

    times = {"F": [[] for _ in layers], "BW": [[] for _ in layers], "B": [[] for _ in layers],
             "W": [[] for _ in layers]}
    for r in range(warmup + repeats):
        for k, layer in enumerate(layers):
            weights = [p for p in layer.parameters() if p.requires_grad]
            sync()
            t0 = time.perf_counter()
            x, y = forward(k, inputs[k])
            sync()
            t1 = time.perf_counter()
            grad = None if k == last else torch.ones_like(y)
            leaves = [x] if x.requires_grad else []
            torch.autograd.backward([y], [grad], inputs=leaves + weights)   # fused B + W
            sync()
            t2 = time.perf_counter()
            x, y = forward(k, inputs[k])
            sync()
            t3 = time.perf_counter()
            if leaves := ([x] if x.requires_grad else []):                 # B: input gradient only
                torch.autograd.grad([y], leaves, [grad], retain_graph=True)
            sync()
            t4 = time.perf_counter()
            if weights:                                                     # W: weights only
                torch.autograd.backward([y], [grad], inputs=weights)
            sync()
            t5 = time.perf_counter()
            if r >= warmup:
                b, w = (t4 - t3 if leaves else 0.0), (t5 - t4 if weights else 0.0)
                for key, value in (("F", t1 - t0), ("BW", t2 - t1), ("B", b), ("W", w)):
                    times[key][k].append(value)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    med = {key: [statistics.median(v) for v in per] for key, per in times.items()}
    param_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return (med["F"], med["BW"], med["B"], med["W"], [sum(s.values()) for s in saved], output_bytes,
            param_bytes, shared), input_saved


def measure_cores(n: int = 2, repeats: int = 5, model=None, batch=None, steps: int = 4) -> float:
    """How many virtual devices' worth of work this machine does at once, now.

    Times some work on one worker alone, then the same work on n workers together:
    n x alone / together. About n on an idle machine with n cores (less when the
    cores fight over memory bandwidth), nearer 1 when other work takes the cores.
    The work is a copy of `model`'s forward and backward on `batch` (one
    micro-batch: the pipeline's own work) or, without them, a 256-wide LSTM layer.
    Each measurement runs `steps` forward-and-backward steps (long enough that timer
    and thread start-up noise do not count); the result is the median of `repeats`.
    Pass the result as simulate(..., cores=...).
    """
    if n < 2:
        raise ValueError(f"measure_cores needs n >= 2 workers to compare with one, got {n}")
    if model is not None:
        copies = [copy.deepcopy(model).train() for _ in range(n)]     # backward writes each copy's .grad
        step = lambda m: nll_sum(m(batch.inputs)[0], batch.targets).backward()    # noqa: E731
    else:
        copies = [torch.nn.LSTM(256, 256) for _ in range(n)]
        x = torch.randn(35, 8, 256)                                   # (T, b, H), like a micro-batch
        step = lambda m: m(x)[0].sum().backward()                     # noqa: E731
    workers = [Worker(get_device(f"vgpu:{k}")) for k in range(n)]

    def job(m):
        def run():
            start = time.perf_counter()
            for _ in range(steps):
                step(m)
            return time.perf_counter() - start
        return run

    ratios = []
    try:
        # Warm every worker up, together: a worker's first steps fault in its own allocator arena,
        # which would count as "the cores are busy" in the first measurement.
        for f in [w.submit(job(m)) for w, m in zip(workers, copies)]:
            f.result()
        for _ in range(repeats):
            alone = workers[0].submit(job(copies[0])).result()
            together = max(f.result() for f in [w.submit(job(m)) for w, m in zip(workers, copies)])
            ratios.append(min(n * alone / together, float(n)))
    finally:
        for w in workers:
            w.stop()
    return statistics.median(ratios)


# -- costs that depend on the micro-batch shape (bucket-aware prediction) ---------------------------
_TIMES = ("forward", "backward", "backward_input", "backward_weight")
_BYTES = ("activation_bytes", "output_bytes", "shared_bytes", "input_saved_bytes")


@dataclass
class CostCurve:
    """Per-layer costs as a function of the micro-batch shape (T, b), from a few profiles.

    `widths` holds Costs measured at one length T0 for several micro-batch widths b
    (the planner's micro-batch counts change b = B / m); `lengths` holds Costs at one
    width for several lengths T (the buckets). `at(T, b)` reads the width profiles
    piecewise-linearly in b at T0 (linearly extrapolated past the ends), then scales
    each layer by its own straight line in T, fitted by least squares on the length
    profiles: an LSTM layer pays per time step, so its time is close to a + c T.
    With one length only, times scale in proportion to T. Parameter bytes do not
    depend on the shape; activation and output bytes are counted the same way as times.
    """

    widths: list[Costs]
    lengths: list[Costs]

    def __post_init__(self):
        if not self.widths:
            raise ValueError("CostCurve needs at least one profile in widths")
        self.widths = sorted(self.widths, key=lambda c: c.micro_batch[1])
        self.lengths = sorted(self.lengths or [], key=lambda c: c.micro_batch[0])
        names = self.widths[0].names
        if any(c.names != names for c in self.widths + self.lengths):
            raise ValueError("CostCurve profiles must all cover the same layers")
        T0s = {c.micro_batch[0] for c in self.widths}
        if len(T0s) != 1:
            raise ValueError(f"the width profiles must share one length T, got {sorted(T0s)}")
        self.T0 = T0s.pop()

    @property
    def names(self) -> list[str]:
        return self.widths[0].names

    def _line(self, key: str, k: int, b: int) -> tuple[float, float]:
        """(a, c) of value ~ a + c T for layer k, fitted on the length profiles (a = 0 with one length)."""
        if not self.lengths:
            return 0.0, 1.0
        # the length profiles of the width nearest b (by ratio); the width profile at (T0, that width)
        # is a point of the line too
        near = min({c.micro_batch[1] for c in self.lengths}, key=lambda w: abs(math.log(w / b)))
        pts = [(c.micro_batch[0], getattr(c, key)[k]) for c in self.lengths + self.widths if c.micro_batch[1] == near]
        if len({T for T, _ in pts}) < 2:
            return 0.0, 1.0                                  # proportional to T
        n = len(pts)
        mT = sum(T for T, _ in pts) / n
        mv = sum(v for _, v in pts) / n
        slope = sum((T - mT) * (v - mv) for T, v in pts) / sum((T - mT) ** 2 for T, _ in pts)
        return mv - slope * mT, slope

    def _in_T(self, key: str, k: int, T: float, b: int) -> float:
        """value(T) / value(T0) for layer k: how the length changes this layer's cost."""
        a, c = self._line(key, k, b)
        at_T0 = a + c * self.T0
        if at_T0 <= 0:
            return T / self.T0
        return max(a + c * T, 0.0) / at_T0

    def _in_b(self, key: str, k: int, b: float) -> float:
        """value at length T0 and width b: piecewise linear through the width profiles."""
        pts = [(c.micro_batch[1], getattr(c, key)[k]) for c in self.widths]
        if len(pts) == 1:
            return pts[0][1] * b / pts[0][0]                 # one width: proportional to b
        i = next((j for j in range(1, len(pts) - 1) if b <= pts[j][0]), len(pts) - 1)
        (b0, v0), (b1, v1) = pts[i - 1], pts[i]
        return max(v0 + (v1 - v0) * (b - b0) / (b1 - b0), 0.0)

    def at(self, T: int, b: int, chunks: int = 1) -> Costs:
        """The Costs of one micro-batch of shape (T, b), for simulate, balance or the planner.

        With `chunks` > 1 (wavefront): `chunks` times the cost of one time chunk (T / chunks, b).
        simulate charges 1/chunks of a micro-batch's cost per chunk, so it then charges what one
        chunk really costs, per-call overheads included, not a slice of the whole sequence's."""
        if T < 1 or b < 1 or chunks < 1 or chunks > T:
            raise ValueError(f"a micro-batch shape needs T >= 1, b >= 1 and 1 <= chunks <= T, got T={T}, "
                             f"b={b}, chunks={chunks}")
        n, base = len(self.names), self.widths[0]
        length = T / chunks
        d = base.to_dict()
        for key in _TIMES:
            d[key] = [chunks * self._in_b(key, k, b) * self._in_T(key, k, length, b) for k in range(n)]
        for key in _BYTES:
            d[key] = [int(round(chunks * self._in_b(key, k, b) * self._in_T(key, k, length, b))) for k in range(n)]
        d["micro_batch"] = (int(T), int(b))
        return Costs.from_dict(d)

    def to_dict(self) -> dict:
        return {"widths": [c.to_dict() for c in self.widths], "lengths": [c.to_dict() for c in self.lengths]}

    @classmethod
    def median(cls, curves: list["CostCurve"]) -> "CostCurve":
        """Profile by profile median of several curves of the same shapes (steadier on a busy machine)."""
        shapes = [[c.micro_batch for c in curve.widths + curve.lengths] for curve in curves]
        if not curves or any(s != shapes[0] for s in shapes):
            raise ValueError("CostCurve.median needs one or more curves profiled at the same shapes")
        return cls([Costs.median([curve.widths[k] for curve in curves]) for k in range(len(curves[0].widths))],
                   [Costs.median([curve.lengths[k] for curve in curves]) for k in range(len(curves[0].lengths))])

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls([Costs.from_dict(c) for c in d["widths"]], [Costs.from_dict(c) for c in d.get("lengths", [])])


def profile_curve(model, batch, device="vgpu:0", widths=None, lengths=None, length_widths=None,
                  **profile_args) -> CostCurve:
    """Profile `model` at several micro-batch shapes: every width b in `widths` (default: the
    batch's whole width and a few divisors of it) at the batch's length T, and every length in
    `lengths` (default: none; give two or three bucket lengths) at each width in `length_widths`
    (default: the narrowest).

        curve = profile_curve(model, batch, widths=[2, 8, 16], lengths=[10, 20, 35])
        curve.at(20, 4)          # Costs of a (T=20, b=4) micro-batch, interpolated
    """
    T, B = batch.inputs.shape
    widths = sorted(set(widths or [d for d in (1, 2, 4, 8, B) if d <= B and B % d == 0]))
    bad = [b for b in widths if b < 1 or B % b]
    if bad:
        divisors = ", ".join(str(d) for d in range(1, B + 1) if B % d == 0)
        raise ValueError(f"width {bad[0]} does not divide the batch's {B} columns; pick widths among {divisors}")
    by_width = [profile(model, batch, device, micro_batches=B // b, **profile_args) for b in widths]
    by_length = []
    for L in sorted(set(lengths or []) - {T}):
        if not 1 <= L <= T:
            raise ValueError(f"length {L} is outside the batch's 1..{T} time steps; profile a longer batch")
        short = _first_steps(batch, L)
        for b in sorted(set(length_widths or widths[:1])):
            if b not in widths:
                raise ValueError(f"length_widths has {b}, which is not among the widths {widths}")
            by_length.append(profile(model, short, device, micro_batches=B // b, **profile_args))
    return CostCurve(by_width, by_length)


def _first_steps(batch, L: int):
    """The batch cut to its first L time steps (a shorter bucket of the same sentences)."""
    return type(batch)(batch.inputs[:L], batch.targets[:L], batch.mask[:L], L, batch.carry_state)
