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
    laptop  the command line's main job (small's sizes): the same rule, lr 20, batch 96,
            8 micro-batches, the embedding and LSTM layers on vgpu:0, the decoder on vgpu:1

Dropout and the initial weight range are part of the model config (model.CONFIGS).
"""
from __future__ import annotations

from dataclasses import dataclass

# mpedu's defaults (the tiny recipe): on the embedded corpus validation perplexity falls every epoch
# (182.6, 146.5, 126.5, 96.6, 89.2, 85.5 on one CPU, against a unigram 382). lr 20 learns as fast but
# overshoots in epoch 3 (valid 124.4 -> 128.7) before the halving rule catches it; lr 10 falls smoothly.
LR = 10.0
EPOCHS = 6
BATCH_SIZE = 32
CLIP = 0.25

# `python -m mpedu train` with no options trains `laptop` (small's 2 x 200 sizes) on 2 virtual devices.
# Chosen by measurement on 2-core VMs: the tiny model's decoder (64 x 3,289 words) is most of its work and
# its stages are too small, so a tiny pipeline ran at 0.88-1.06x one virtual device whatever its split.
# With 200-wide layers the embedding and both LSTM layers weigh about what the decoder does on a CPU core
# (multiply-adds: 2 x 4 x 200 x 400 against 200 x 3,289 per token), so that split is balanced; 8 micro-
# batches of 12 sentences keep the bubble at 1/9 of the step while each micro-batch stays wide enough to
# compute efficiently: 1.36-1.48x one virtual device (64 sentences: 1.22-1.24x). Validation perplexity
# 271, 171, 148, 149, 101, 91 (test 91) in about two minutes there; lr 20 for the larger batch.
CONFIG = "laptop"  # the config (and recipe) `python -m mpedu train` uses unless told
LAPTOP_PLACEMENT = "embed,lstm0,lstm1:vgpu0 | decode:vgpu1"
# torchrun's default: a job's ranks are processes (each imports torch and joins a group), and its runs in the
# course are about the same schedule crossing processes, not about speed: the tiny model keeps them quick.
TORCHRUN_CONFIG = "tiny"


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
    micro_batches: int = 4              # a pipeline's, unless --micro-batches is given
    placement: str | None = None        # where the layers go when neither --devices nor --placement is given

    def describe(self) -> str:
        mode = f"stream mode, bptt {self.bptt}" if self.bptt else "bucketed sentences"
        rule = (f"lr / {self.decay[1]:g} after each epoch from epoch {self.decay[0]} on" if self.decay
                else "lr halved when validation perplexity gains < 1")
        where = f"; {self.micro_batches} micro-batches" + (f", {self.placement}" if self.placement else "")
        return (f"lr {self.lr:g}, {self.epochs} epochs, batch {self.batch_size}, clip {self.clip:.3g}, {mode}, "
                f"{rule}{where} ({self.source})")


_MPEDU = Recipe("mpedu's defaults", LR, EPOCHS, BATCH_SIZE, CLIP)

RECIPES: dict[str, Recipe] = {
    "tiny": _MPEDU,
    "laptop": Recipe("mpedu's main job", lr=20.0, epochs=6, batch_size=96, clip=CLIP, micro_batches=8,
                     placement=LAPTOP_PLACEMENT),
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
