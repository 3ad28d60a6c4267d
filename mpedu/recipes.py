"""Training recipes: each named config's paper settings (lr, epochs, batch, stream mode, decay), in mpedu's convention.

Learning-rate convention. mpedu's loss is the mean NLL per token. Zaremba et al. (2014)
sum the NLL over the T time steps of a window (and average over the batch), so their
gradients are T times mpedu's: their lr 1 is about lr T here, and their gradient-norm
clip 5 is about 5 / T. With T = 20 (small) that is lr 20 and clip 0.25, PyTorch's
word_language_model settings, which use the same mean loss.

    small   Zaremba et al., non-regularized: 2 x 200, T 20, batch 20, lr 1 -> 20,
            13 epochs, lr / 2 after each epoch from epoch 4 on, clip 5 -> 0.25
    medium  2 x 650, dropout 0.5 (in model.CONFIGS), T 35, lr 1 -> 35, 39 epochs,
            lr / 1.2 from epoch 6 on, clip 5 -> 0.143
    large   2 x 1500, dropout 0.65, T 35, lr 1 -> 35, 55 epochs, lr / 1.15 from
            epoch 14 on, clip 10 -> 0.286
    tiny, mxnet8  mpedu's own defaults: bucketed sentences (state reset per sentence),
            lr 10, clip 0.25, halved when validation perplexity gains < 1 (MXNet's rule)

Dropout and the initial weight range are part of the model config (model.CONFIGS).
"""
from __future__ import annotations

from dataclasses import dataclass

# mpedu's defaults (the tiny recipe): `python -m mpedu train` on the embedded corpus takes
# about a minute on 2 cores with validation perplexity falling every epoch (measured: 182.6,
# 146.5, 126.5, 96.6, 89.2, 85.5 against a unigram 382). lr 20 learns as fast but overshoots in epoch 3
# (valid 124.4 -> 128.7) before the halving rule catches it; lr 10 falls smoothly. Batches of 32
# give a 4-micro-batch pipeline 8 columns per micro-batch.
CONFIG = "tiny"    # the config (and recipe) `python -m mpedu train` uses unless told
LR = 10.0
EPOCHS = 6
BATCH_SIZE = 32
CLIP = 0.25


@dataclass(frozen=True)
class Recipe:
    """How to train one config. `decay` (first epoch, factor): divide lr by factor after every epoch
    from that one on; None: halve it when validation perplexity gains < 1. `bptt`: stream mode
    with windows of T steps (None: bucketed sentences)."""

    source: str
    lr: float
    epochs: int
    batch_size: int
    clip: float
    bptt: int | None = None
    decay: tuple[int, float] | None = None

    def describe(self) -> str:
        mode = f"stream mode, bptt {self.bptt}" if self.bptt else "bucketed sentences"
        rule = (f"lr / {self.decay[1]:g} after each epoch from epoch {self.decay[0]} on" if self.decay
                else "lr halved when validation perplexity gains < 1")
        return (f"lr {self.lr:g}, {self.epochs} epochs, batch {self.batch_size}, clip {self.clip:.3g}, {mode}, "
                f"{rule} ({self.source})")


_MPEDU = Recipe("mpedu's defaults", LR, EPOCHS, BATCH_SIZE, CLIP)

RECIPES: dict[str, Recipe] = {
    "tiny": _MPEDU,
    "small": Recipe("Zaremba et al. 2014, small", lr=20.0, epochs=13, batch_size=20, clip=5 / 20, bptt=20,
                    decay=(4, 2.0)),
    "medium": Recipe("Zaremba et al. 2014, medium", lr=35.0, epochs=39, batch_size=20, clip=5 / 35, bptt=35,
                     decay=(6, 1.2)),
    "large": Recipe("Zaremba et al. 2014, large", lr=35.0, epochs=55, batch_size=20, clip=10 / 35, bptt=35,
                    decay=(14, 1.15)),
    "mxnet8": _MPEDU,
}


def recipe_for(config: str) -> Recipe:
    """The recipe of a CONFIGS name (mpedu's defaults for a config without one)."""
    return RECIPES.get(config, _MPEDU)
