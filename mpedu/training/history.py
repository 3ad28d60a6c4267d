"""History: what a training run records per epoch, its summary, and perplexity."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


def perplexity(nll: float, tokens: int) -> float:
    """exp(mean NLL per token); inf once that overflows (a diverged model)."""
    try:
        return math.exp(nll / tokens)
    except OverflowError:
        return math.inf


def diverged(summary: dict, recipe_lr: float) -> str | None:
    """The message for a run whose perplexities are not finite (None when they all are)."""
    bad = [f"{k.removesuffix('_ppl')} {summary[k]}" for k in ("train_ppl", "valid_ppl", "test_ppl")
           if isinstance(summary.get(k), float) and not math.isfinite(summary[k])]
    if not bad:
        return None
    lr = summary.get("lr") or recipe_lr
    return (f"training diverged: perplexity is not finite ({', '.join(bad)}), so the model predicts nothing; "
            f"start afresh (another --out, or no --resume) with a lower --lr: the last epoch used {lr:g}"
            + (f", the recipe's is {recipe_lr:g}" if recipe_lr < lr else ""))


@dataclass
class History:
    """Per-epoch records (epoch, lr, train_ppl, valid_ppl, tokens_per_s, seconds, ...) and test_ppl."""

    epochs: list[dict] = field(default_factory=list)
    test_ppl: float | None = None

    @property
    def valid_ppls(self) -> list[float]:
        return [e["valid_ppl"] for e in self.epochs]

    def to_dict(self) -> dict:
        return {"epochs": [dict(e) for e in self.epochs], "test_ppl": self.test_ppl}

    @classmethod
    def from_dict(cls, d: dict) -> "History":
        return cls([dict(e) for e in d["epochs"]], d.get("test_ppl"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> dict:
        """Last epoch's perplexities, test perplexity, and whole-run throughput and bubble."""
        if not self.epochs:
            return {"epochs": 0, "test_ppl": self.test_ppl}
        last, steps = self.epochs[-1], sum(e["steps"] for e in self.epochs)
        seconds = sum(e["train_seconds"] for e in self.epochs)
        bubbles = [(e["bubble_fraction"], e["steps"]) for e in self.epochs if e.get("bubble_fraction") is not None]
        return {
            "epochs": len(self.epochs), "train_ppl": last["train_ppl"], "valid_ppl": last["valid_ppl"],
            "test_ppl": self.test_ppl, "lr": last["lr"],
            "tokens_per_s": sum(e["tokens"] for e in self.epochs) / seconds if seconds else None,
            "seconds": sum(e["seconds"] for e in self.epochs),
            # mean over all training steps of the run (each step weighs the same)
            "bubble_fraction": sum(b * n for b, n in bubbles) / sum(n for _, n in bubbles) if bubbles else None,
            "steps": steps, "skipped_batches": sum(e.get("skipped_batches", 0) for e in self.epochs),
        }
