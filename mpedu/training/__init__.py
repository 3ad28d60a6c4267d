"""Training runs: the loop (train, evaluate), resuming, history, recipes, checkpoints, numeric
faults. Imports the layers below (runtime ... predict)."""
from .checkpoint import CheckpointError, atomic_save, checksums, load_checkpoint, load_model, save_checkpoint
from .faults import NumericFault
from .history import History, perplexity
from .loop import evaluate, next_lr, scheduled_lr, step, stream_columns, train
from .recipes import BATCH_SIZE, CLIP, CONFIG, EPOCHS, LR, RECIPES, recipe_for

__all__ = [
    "BATCH_SIZE", "CheckpointError", "CLIP", "CONFIG", "EPOCHS", "History", "LR", "NumericFault",
    "RECIPES", "atomic_save", "checksums", "evaluate", "load_checkpoint", "load_model", "next_lr",
    "perplexity", "recipe_for", "save_checkpoint", "scheduled_lr", "step", "stream_columns", "train",
]
