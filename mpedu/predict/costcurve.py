"""Per-layer costs at any micro-batch shape (T, b), read from a few profiles: CostCurve and profile_curve."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..lm.bucketing import Batch
from ..runtime.streams import chunk_bounds
from .profiling import TIME_FIELDS, Costs, profile

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
    depend on the shape. Activation bytes are exact, not noisy, but not smooth either (oneDNN's
    LSTM workspace grows in blocks: 36 kB at T = 6, 61 kB at T = 8, 62 kB at T = 10 for one
    sequence), so they are read at the shape itself where it was profiled or weighed (`weigh`),
    else piecewise-linearly in T through the profiles of that width, else as times are; with time
    chunks, each chunk's own length counts (T not a multiple of the chunk count gives two).
    """

    widths: list[Costs]
    lengths: list[Costs]
    weighed: dict = field(default_factory=dict)     # (T, b) -> Costs of bytes at that exact shape (weigh)

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
        return _piecewise(pts, b)

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
        for key in TIME_FIELDS:
            d[key] = [chunks * self._in_b(key, k, b) * self._in_T(key, k, length, b) for k in range(n)]
        lengths = [hi - lo for lo, hi in chunk_bounds(int(T), chunks)]
        for key in _BYTES:
            d[key] = [int(round(sum(self._bytes(key, k, L, b) for L in lengths))) for k in range(n)]
        d["micro_batch"] = (int(T), int(b))
        return Costs.from_dict(d)

    def _bytes(self, key: str, k: int, T: int, b: int) -> float:
        """Bytes of layer k at (T, b): where measured, as measured; else through the measured lengths of
        width b, piecewise linearly; else scaled as a time is."""
        if (T, b) in self.weighed:
            return getattr(self.weighed[T, b], key)[k]
        pts = sorted({c.micro_batch[0]: getattr(c, key)[k] for c in self.widths + self.lengths
                      if c.micro_batch[1] == b}.items())
        for L, value in pts:
            if L == T:
                return value
        if len(pts) < 2:
            return self._in_b(key, k, b) * self._in_T(key, k, T, b)
        return _piecewise(pts, T)

    def weigh(self, model, shapes, device="vgpu:0") -> "CostCurve":
        """Weigh `model`'s layers (a dry forward counting what autograd saves, no timing) at each (T, b) of
        `shapes` not known exactly yet, so that `at` gives their bytes as measured. Returns self."""
        for T, b in shapes:
            if (T, b) in self.weighed or any(c.micro_batch == (T, b) for c in self.widths + self.lengths):
                continue
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(3, model.vocab_size, (T + 1, b), generator=g)
            batch = Batch(tokens[:-1], tokens[1:], torch.ones(T, b, dtype=torch.bool), T, False)
            self.weighed[T, b] = profile(model, batch, device, warmup=0, repeats=0)
        return self

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


def _piecewise(pts: list[tuple[float, float]], x: float) -> float:
    """The value at x of the broken line through `pts` (sorted by x, two or more), extended straight past its
    ends, never below 0."""
    i = next((j for j in range(1, len(pts) - 1) if x <= pts[j][0]), len(pts) - 1)
    (x0, v0), (x1, v1) = pts[i - 1], pts[i]
    return max(v0 + (v1 - v0) * (x - x0) / (x1 - x0), 0.0)


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
        short = batch.steps(0, L)
        for b in sorted(set(length_widths or widths[:1])):
            if b not in widths:
                raise ValueError(f"length_widths has {b}, which is not among the widths {widths}")
            by_length.append(profile(model, short, device, micro_batches=B // b, **profile_args))
    return CostCurve(by_width, by_length)

