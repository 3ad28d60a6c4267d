"""Measure each layer's forward and backward time and memory on a device: the simulator's cost model."""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, fields

import torch

from ..core.runner import check_batch
from ..core.stage import count_saved, is_recurrent
from ..lm import dropout
from ..lm.model import nll_sum
from ..runtime.devices import get_device
from ..runtime.values import check_number
from ..runtime.workers import Worker, result_of
from .footprint import param_sizes

# the fields of StageCost and Costs that are seconds (CostCurve scales them with the shape)
TIME_FIELDS = ("forward", "backward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch (seconds, bytes). Plain numbers are fine:
    `StageCost(1.0)` is the textbook unit stage, F = 1, B + W = 2, B = W = 1.

    backward is the fused backward (input and weight gradients in one pass, what
    a stage outside a zero-bubble schedule runs); backward_input (B) and
    backward_weight (W) are the two halves a zero-bubble schedule runs apart.
    They need not add up to backward: an LSTM's backward kernel computes both
    gradients whichever is asked for, so measured apart B and W each cost about a full
    backward; a stage's B therefore takes its recurrent layers' weights along (Costs.stages).
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
        check_number("a stage's forward (seconds)", self.forward)     # before 2 x forward: '1' x 2 is '11'
        if self.backward is None:
            object.__setattr__(self, "backward", 2.0 * self.forward)
        for half in ("backward_input", "backward_weight"):
            if getattr(self, half) is None:
                object.__setattr__(self, half, self.backward / 2)
        _check_times(self, "a stage")
        for name in ("output_bytes", "activation_bytes", "param_bytes", "input_bytes", "input_saved_bytes",
                     "trainable_bytes"):     # a negative size would give a peak of 0, a NaN fail in a sum
            check_number(f"a stage's {name}", getattr(self, name), minimum=0)


def _check_times(costs, what: str) -> None:
    """Refuse a time no machine measures (negative, NaN or infinite): the simulator would draw it."""
    for name in TIME_FIELDS:
        value = getattr(costs, name)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            check_number(f"{what}'s {name} (seconds)", v)


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
    recurrent: list[bool] | None = None          # layers with a recurrent kernel (Stage); None: none known
    profiled: bool = False                       # measured by profile(): its weight sizes are a model's

    def __post_init__(self):
        self.micro_batch = tuple(self.micro_batch)
        n = len(self.names)
        if self.trainable_bytes is None:
            self.trainable_bytes = list(self.param_bytes)
        if self.input_saved_bytes is None:
            self.input_saved_bytes = [0] * n
        if self.recurrent is None:
            self.recurrent = [False] * n
        _check_times(self, "a layer")

    def check_model(self, model) -> None:
        """Refuse costs profiled on another model: the same layer names are not enough (every LSTMLM has
        embed, lstm0, ..., decode), their weights' sizes tell models apart. Hand-written costs (not
        `profiled`) describe whatever model their author means: only their names are checked."""
        if list(self.names) != list(model.layer_names):
            raise ValueError(f"these costs cover layers {', '.join(self.names)}, the model has "
                             f"{', '.join(model.layer_names)}: profile this model, mpedu.profile(model, batch)")
        if not self.profiled:
            return
        params, _ = param_sizes(model)
        for name, theirs, ours in zip(self.names, self.param_bytes, params):
            if theirs != ours:
                raise ValueError(f"these costs were profiled on another model: its {name} holds {theirs:,} bytes "
                                 f"of weights, this model's {ours:,}; profile this model, "
                                 "mpedu.profile(model, batch)")

    def stages(self, placement) -> list[StageCost]:
        """One StageCost per stage of a Placement (or of a list of layer-name lists).

        F and the fused backward add up over the stage's layers. Split (zero bubble), as a
        Stage splits it: the layers up to the stage's last recurrent one get their weight
        gradients in B (their backward kernels compute them anyway), so they cost B their
        fused backward; the layers after them cost B their input gradient (none on a stage
        whose input is token ids and that has no recurrent layer: nothing to send back).
        W is left those later layers, and re-walks their graph from the stage's output to
        reach every weight: W = W(first of them) + the full backward of the others.
        """
        groups = [names for _, names in placement.stages] if hasattr(placement, "stages") else placement
        layers = list(getattr(placement, "layer_names", self.names))
        if layers != list(self.names):
            raise ValueError(f"these costs cover layers {', '.join(self.names)}, the placement places "
                             f"{', '.join(layers)}: profile the model this placement is for")
        index = {name: k for k, name in enumerate(self.names)}
        out = []
        for s, names in enumerate(groups):
            missing = [n for n in names if n not in index]
            if missing:
                raise ValueError(f"layer {missing[0]!r} was not profiled; these costs cover {', '.join(self.names)}")
            ks = [index[n] for n in names]
            if ks != list(range(ks[0], ks[0] + len(ks))):
                raise ValueError(f"stage {s} ({', '.join(names)}) is not a run of consecutive layers")
            first = ks[0]
            # The first stage's frozen lead (a frozen embedding on token ids, and frozen layers after it): no
            # gradient flows into or through it, so autograd keeps nothing there and the backward never
            # reaches it. Any later stage's input wants a gradient at the boundary, so its layers all count.
            lead = next((i for i, k in enumerate(ks) if self.trainable_bytes[k]), len(ks)) if first == 0 else 0
            live = ks[lead:]
            last = max((k for k in live if self.recurrent[k]), default=first - 1)
            early, late = [k for k in live if k <= last], [k for k in live if k > last]
            out.append(StageCost(
                forward=sum(self.forward[k] for k in ks),
                backward=sum(self.backward[k] for k in live),
                backward_input=0.0 if first == 0 and not early else
                sum(self.backward[k] for k in early) + sum(self.backward_input[k] for k in late),
                backward_weight=(self.backward_weight[late[0]] + sum(self.backward[k] for k in late[1:])
                                 if late else 0.0),
                output_bytes=self.output_bytes[ks[-1]],
                activation_bytes=sum(self.activation_bytes[k] for k in live)
                - sum(self.shared_bytes[k] for k in live[1:]),
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
        for key in TIME_FIELDS:
            d[key] = [statistics.median(getattr(r, key)[k] for r in runs) for k in range(len(runs[0].names))]
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        known = {f.name for f in fields(cls)}
        # a profile saved before a recomputing stage's first forward ran with autograd (keeping nothing)
        # timed that forward without autograd; it now costs the forward
        d = {k: v for k, v in d.items() if k != "forward_nograd"}
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
    live Pipeline keeps its layers on its GPUs). repeats=0 weighs them only: the bytes, every
    time 0 (a dry forward pass, for the memory model).
    """
    check_number("repeats", repeats, integer=True, minimum=0)
    check_number("warmup", warmup, integer=True)
    check_batch(batch, model.vocab_size)       # the batch a step would accept, named before torch fails inside
    dev = get_device(device)
    micro = batch.split(micro_batches)[0]
    twin = _copy_without_grads(model).to(dev.torch_device).train()
    if dev.is_cuda:     # the copy (and the LSTM's weight flattening) ran on this thread's stream: let it finish
        torch.cuda.current_stream(dev.torch_device).synchronize()    # before the worker's stream reads it
    layers = [twin.layers[name] for name in model.layer_names]
    worker = Worker(dev)
    try:
        measured, input_saved = result_of(worker.submit(lambda: _measure(layers, micro, dev, warmup, repeats)))
    finally:
        worker.stop()
    params, trainable = param_sizes(twin, model.layer_names)      # a tied weight once
    f, bw, b, w, act, out, _, shared = measured
    return Costs(model.layer_names, f, bw, b, w, act, out, params, shared, micro_batch=tuple(micro.inputs.shape),
                 recurrent=[is_recurrent(twin.layers[name]) for name in model.layer_names],
                 device=dev.name, trainable_bytes=trainable, input_saved_bytes=input_saved, profiled=True)


def _copy_without_grads(model):
    """A deep copy of `model` (tied weights stay tied) whose parameters have no .grad yet. The model itself is
    only read: another thread may be training it (the explorer profiles in the background while a learner's cell
    trains), and unsetting its gradients even for a moment loses that thread's or breaks its backward."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():     # Parameter.__deepcopy__ leaves .grad behind; this holds under any version
        p.grad = None
    return twin


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
    for r in range(warmup + repeats if repeats else 0):
        for k, layer in enumerate(layers):
            weights = [p for p in layer.parameters() if p.requires_grad]
            sync()
            t0 = time.perf_counter()
            x, y = forward(k, inputs[k])
            sync()
            t1 = time.perf_counter()
            grad = None if k == last else torch.ones_like(y)
            leaves = [x] if x.requires_grad else []
            if leaves or weights:           # (a frozen layer on token ids has no backward at all)
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
            if r < warmup:
                continue
            b, w = (t4 - t3 if leaves else 0.0), (t5 - t4 if weights else 0.0)
            for key, value in (("F", t1 - t0), ("BW", t2 - t1), ("B", b), ("W", w)):
                times[key][k].append(value)
        # The weights' .grad is kept from round to round: a step's backwards add into it (all but the first
        # micro-batch's, which finds none after zero_grad), and that addition reads and writes every weight
        # once more: about a quarter of a small micro-batch's backward (bench/fidelity.py's time chunks).
    med = {key: [statistics.median(v) if v else 0.0 for v in per] for key, per in times.items()}
    param_bytes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return (med["F"], med["BW"], med["B"], med["W"], [sum(s.values()) for s in saved], output_bytes,
            param_bytes, shared), input_saved
