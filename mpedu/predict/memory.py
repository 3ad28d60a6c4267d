"""Memory per device: parameters, gradients, optimizer state and the activations saved for backward."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..runtime.values import SIZE_UNITS
from .footprint import device_footprints, param_sizes, unique_params
from .profiling import Costs

# Stacked in this order, bottom to top. Activations take the forward's colour in the Gantt
# chart (forwards create them); the rest are Okabe-Ito colours not used there.
PARTS = ("params", "grads", "optimizer", "peak_activations")
PART_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
              "peak_activations": "activations (peak)"}
PART_COLOURS = {"params": "#0072B2", "grads": "#D55E00", "optimizer": "#CC79A7", "peak_activations": "#56B4E9"}
LINE_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000")
# What a GPU holds beyond what mpedu estimates (say it wherever the two stand side by side)
GPU_LEAVES_OUT = ("the estimate leaves out the CUDA context (a few hundred MB per GPU, outside PyTorch's "
                  "allocator), cuDNN/cuBLAS workspaces, blocks PyTorch's caching allocator keeps for reuse "
                  "(torch.cuda.memory_reserved) and short-lived buffers inside an op; the measured peak "
                  "counts every tensor on the GPU since the process started (or since "
                  "torch.cuda.reset_peak_memory_stats)")


def measured_peak(device: str) -> int | None:
    """The most bytes PyTorch's allocator has held at once on a GPU (torch.cuda.max_memory_allocated),
    measured, for a device name such as "cuda:0"; None for a virtual device or the CPU."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(torch.device(str(device)))


@dataclass
class DeviceMemory:
    """Bytes one device holds for training. Activations change during a step; the rest does not."""

    device: str
    params: int
    grads: int
    optimizer: int
    peak_activations: int
    activations: list[tuple[float, int]] = field(default_factory=list)   # (seconds, bytes held) over the step
    measured: int | None = None    # on a GPU: the allocator's peak (see measured_peak); None elsewhere

    @property
    def total(self) -> int:
        """The most the device needs at once: everything fixed plus the activation peak."""
        return self.params + self.grads + self.optimizer + self.peak_activations


@dataclass
class MemoryReport:
    """Per device memory of a Pipeline step; `table()` for text, `plot()` and `plot_over_time()` for pictures."""

    devices: list[DeviceMemory]
    optimizer_note: str = ""

    def __getitem__(self, device: str) -> DeviceMemory:
        for d in self.devices:
            if d.device == device:
                return d
        raise KeyError(f"no device {device!r} in this report; it has {[d.device for d in self.devices]}")

    def table(self) -> str:
        """One line per device, all in one unit so the numbers compare at a glance."""
        measured = any(d.measured is not None for d in self.devices)
        unit, scale = _unit(max([d.total for d in self.devices] + [d.measured or 0 for d in self.devices] + [1]))
        head = ["device", *(PART_NAMES[p] for p in PARTS), "total"] + (["measured peak"] if measured else [])
        rows = [[d.device, *(f"{getattr(d, p) / scale:.2f}" for p in PARTS), f"{d.total / scale:.2f}"]
                + ([f"{d.measured / scale:.2f}" if d.measured is not None else "-"] if measured else [])
                for d in self.devices]
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        lines = [f"memory per device ({unit})"]
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in [head] + rows]
        if self.optimizer_note:
            lines.append(self.optimizer_note)
        if measured:
            lines.append("measured peak: torch.cuda.max_memory_allocated; " + GPU_LEAVES_OUT)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, ax=None):
        """Stacked bars, one per device: parameters, gradients, optimizer state, peak activations."""
        ax = ax if ax is not None else _new_axes(max(4.0, 1.2 * len(self.devices) + 2.5))
        unit, scale = _unit(max([d.total for d in self.devices] + [1]))
        x = range(len(self.devices))
        bottom = [0.0] * len(self.devices)
        for part in PARTS:
            heights = [getattr(d, part) / scale for d in self.devices]
            ax.bar(x, heights, bottom=bottom, width=0.6, color=PART_COLOURS[part], label=PART_NAMES[part],
                   edgecolor="white", linewidth=0.5)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for i, total in enumerate(bottom):
            ax.annotate(f"{total:.2f}", (i, total), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(list(x), [d.device for d in self.devices])
        ax.set_ylabel(f"memory ({unit})")
        ax.set_title("memory per device", loc="left", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], fontsize=8, frameon=False,   # legend top to bottom, like the stack
                  loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        return ax

    def plot_over_time(self, ax=None, time_unit: str = "ms"):
        """Activation memory held on each device during the step, one line per device."""
        scale_t = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
        ax = ax if ax is not None else _new_axes(7.0)
        unit, scale = _unit(max([b for d in self.devices for _, b in d.activations] + [1]))
        for i, d in enumerate(self.devices):
            if d.activations:
                ts, bs = zip(*d.activations)
                ax.step([t * scale_t for t in ts], [b / scale for b in bs], where="post", label=d.device,
                        color=LINE_COLOURS[i % len(LINE_COLOURS)], linewidth=1.5)
        ax.set_xlabel(f"time ({time_unit})")
        ax.set_ylabel(f"activations held ({unit})")
        ax.set_title("activation memory during the step", loc="left", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # off the lines
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        return ax


def memory_report(pipe, timeline, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """What each device of `pipe` holds: its stages' parameters, their gradients, the optimizer's
    state for them, and (from the measured `timeline` of a training step) the activations saved
    for backward, at their peak and over time.

    Gradients are counted as one tensor the size of each trainable parameter (what backward
    allocates). Optimizer state is read from the optimizer; before its first `step()`, when
    torch has not yet created it, it is worked out by stepping a small copy of the optimizer.
    On a GPU the report also gives the measured peak (`measured_peak`) beside the estimate.
    `timeline` may also be the StepResult itself.
    """
    timeline = getattr(timeline, "timeline", timeline)     # a StepResult: the step's timeline
    if not hasattr(pipe, "placement") or not hasattr(timeline, "peak_memory"):
        raise TypeError(f"memory_report(pipe, timeline) needs a Pipeline and a training step's timeline, got "
                        f"{type(pipe).__name__} and {type(timeline).__name__}; e.g. "
                        "memory_report(pipe, pipe.train_step(batch).timeline)")
    missing = [d.name for d in pipe.placement.devices if d.name not in timeline.devices]
    if missing:
        raise ValueError(f"the timeline has no device {', '.join(missing)} of this pipeline (its devices: "
                         f"{', '.join(timeline.devices)}); give the timeline of a step this pipeline ran")
    per_param = _optimizer_bytes(optimizer) if optimizer is not None else None
    model, placement = pipe.model, pipe.placement
    # the optimizer's state per device, for each distinct weight (a tied one once: footprint.unique_params)
    home = {name: dev.name for dev, names in placement.stages for name in names}
    state = dict.fromkeys((d.name for d in placement.devices), 0)
    if per_param:
        for name, p in unique_params(model, model.layer_names):
            if p.requires_grad:
                state[home[name]] += per_param(p)
    note = ""
    if per_param and per_param.estimated:
        note = (f"optimizer state: {type(optimizer).__name__} has not stepped yet, so its sizes are "
                "what its first step will create")
    # weights, gradients and optimizer state from the one memory model; activations as the step measured them
    params, trainable = param_sizes(model, model.layer_names)
    n = len(model.layer_names)
    sizes = Costs(model.layer_names, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0] * n, [0] * n, params, [0] * n,
                  micro_batch=(0, 0), trainable_bytes=trainable)
    fixed = device_footprints(sizes, placement, pipe.schedule, optimizer_state=state)
    devices = [DeviceMemory(f.device, f.weights, f.gradients, f.optimizer_state,
                            timeline.peak_memory(f.device) if f.device in timeline.devices else 0,
                            timeline.memory_over_time(f.device) if f.device in timeline.devices else [],
                            measured_peak(f.device))
               for f in fixed]
    return MemoryReport(devices, note)


def _optimizer_bytes(optimizer):
    """A function: parameter -> bytes of optimizer state it has (or will have after one step)."""
    probe_multiple = {}

    def state_bytes(p):
        state = optimizer.state.get(p)
        if state:
            return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        group = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), None)
        if group is None:           # a trainable weight the optimizer does not update (fine-tuning part of a model)
            return 0
        key = id(group)
        if key not in probe_multiple:
            probe_multiple[key] = _probe(optimizer, group)
        state_bytes.estimated |= probe_multiple[key] > 0
        return probe_multiple[key] * p.numel() * p.element_size()

    state_bytes.estimated = False
    return state_bytes


def _probe(optimizer, group, n: int = 64) -> int:
    """How many parameter-sized tensors the optimizer keeps per parameter: step a copy of it,
    with the same settings, on one small parameter (SGD: 0, or 1 with momentum; Adam: 2)."""
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.ones(n)
    try:
        copy = type(optimizer)([param], **settings)
        copy.step()
    except Exception:          # an optimizer we cannot copy: count nothing rather than fail the report
        return 0
    return sum(1 for v in copy.state[param].values() if torch.is_tensor(v) and v.numel() == n)


def _unit(largest: float) -> tuple[str, float]:
    """The unit format_size would write `largest` in, for a plot's axis."""
    return next((unit, scale) for unit, scale in SIZE_UNITS.items() if largest >= scale or unit == "bytes")


def _new_axes(width: float):
    from ..pictures.plot import new_figure
    return new_figure(width, 3.2).add_subplot()
