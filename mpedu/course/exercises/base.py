"""What every check shares: its verdict (`Check`), the tiny model cut in two with one device's answer
(`Setup`), and a thread that never waits forever (`on_thread`)."""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch

from ...core import SingleDevice, check_batch
from ...lm import LSTMLM, BucketIterator, load_corpus

PLACEMENTS = {1: "embed,lstm0,lstm1,decode:vgpu0", 2: "embed,lstm0:vgpu0 | lstm1,decode:vgpu1",
              3: "embed,lstm0:vgpu0 | lstm1:vgpu1 | decode:vgpu2",
              4: "embed:vgpu0 | lstm0:vgpu1 | lstm1:vgpu2 | decode:vgpu3"}
EXACT = 1e-5           # gradients further from one device's than this are wrong, not rounding
WAIT_S = 5.0           # a check's hand-off that takes longer is a deadlock (the engine's steps take milliseconds)


@dataclass
class Check:
    """A check's verdict: `ok`, and the lines that say why (shown as the cell's output)."""

    ok: bool
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__


class Stage(torch.nn.Module):
    """A run of the model's layers, as a learner calls it: `stage(x)` is the last layer's output. It notes the
    threads its gradients were computed on (`backward_threads`), so a check can tell whose backward ran where."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.backward_threads: set[str] = set()
        for p in self.parameters():
            p.register_hook(self._seen)

    def _seen(self, grad):
        self.backward_threads.add(threading.current_thread().name)
        return grad

    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x)
        return x


class Setup:
    """The tiny model cut in two (embed, lstm0 | lstm1, decode), `steps` batches of `width` sentences, and one
    device's loss and gradients for each (from the same weights: a check never updates them)."""

    def __init__(self, width: int = 8, steps: int = 1):
        corpus = load_corpus()
        batches = iter(BucketIterator(corpus.train, width, buckets=[12], seed=0))
        self.batches = [next(batches) for _ in range(steps)]
        self.batch = self.batches[0]
        torch.manual_seed(0)
        self.model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab), dropout=0.0)
        self.answers = [self._one_device(batch) for batch in self.batches]     # [(loss, {name: grad})]
        self.loss, self.grads = self.answers[0]
        self.tokens = check_batch(self.batch, self.model.vocab_size)
        self.stages = [Stage([self.model.layers[n] for n in names]) for names in (("embed", "lstm0"),
                                                                                    ("lstm1", "decode"))]

    def _one_device(self, batch):
        single = copy.deepcopy(self.model)
        loss = SingleDevice(single).train_step(batch).loss
        return loss, {n: p.grad.clone() for n, p in single.named_parameters()}

    def tokens_of(self, step: int) -> int:
        return check_batch(self.batches[step], self.model.vocab_size)

    def run(self, s: int, x):
        return self.stages[s](x)

    def params(self, s: int) -> list:
        return list(self.stages[s].parameters())

    def verdict(self, loss: float, what: str, step: int = 0) -> Check:
        """Correct if the loss and every gradient equal one device's for batch `step`; else what differs."""
        want_loss, want = self.answers[step]
        worst = {}
        for name, p in self.model.named_parameters():
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            worst[name] = (got - want[name]).abs().max().item()
        tokens = self.tokens_of(step)
        if abs(loss - want_loss) > EXACT * abs(want_loss):
            return Check(False, [f"the loss is {loss / want_loss:.3g}x one device's ({loss:.4f} vs {want_loss:.4f}): "
                                 f"divide each micro-batch's summed loss by the whole batch's tokens ({tokens}), so "
                                 "that the micro-batches' losses add up to the batch's mean"])
        bad = [n for n, w in worst.items() if w > EXACT]
        if bad:
            return Check(False, [f"wrong: {what}; the gradients of {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
                                 f" differ from one device's by up to {max(worst[n] for n in bad):.2e}"])
        return Check(True, [f"correct: {what}; the loss and every gradient equal one device's (max difference "
                            f"{max(worst.values()):.0e})"])


def on_thread(name: str, fn, wait_s: float | None = None):
    """fn() on a thread called `name` (a device's), with its exception handed back; never waits forever."""
    wait_s = WAIT_S if wait_s is None else wait_s
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        raise TimeoutError(f"{name} ran for over {wait_s:g} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")
