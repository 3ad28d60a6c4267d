"""A training run's files: checkpoint.pt written at its positions (never over a good one with broken
weights), model.pt at the end, the --out folder locked for the whole run, and words for what is kept."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..core.runner import Runner
from ..runtime.files import OutLock, WriteFailed, prepare_out, why
from .checkpoint import CheckpointError, load_model, remove_stale_temp, save_checkpoint, save_model
from .faults import NumericFault, all_finite, find_fault


def at(epoch: int, batch: int) -> str:
    """Where a checkpoint stands, as a person counts: position (2, 0) is the end of epoch 2, not epoch 3."""
    return f"after epoch {epoch}" if batch == 0 and epoch > 0 else f"at epoch {epoch + 1}, batch {batch}"


class Checkpointer:
    """Writes a run's checkpoints to `out`/checkpoint.pt (nothing when out is None) and says what is kept."""

    def __init__(self, out, model, runner, optimizer, vocab, settings, options: dict, placement, log):
        self.out = Path(out) if out is not None else None
        self.path = self.out / "checkpoint.pt" if self.out else None
        self.model, self.runner, self.optimizer, self.vocab = model, runner, optimizer, vocab
        self.settings, self.options, self.placement = settings, options, placement
        self.last_saved = None      # (epoch, batch) of the newest checkpoint this run wrote
        if self.path is not None:
            for stale in remove_stale_temp(self.path) + remove_stale_temp(self.out / "model.pt"):
                log(f"removed {stale}, a file an interrupted run was writing (never read)")

    def save(self, epoch: int, batch: int, totals: dict, history) -> None:
        if self.path is None:
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not all_finite([p.detach() for p in params]):   # never replace a good checkpoint by a broken model
            found = find_fault(self.model, self.runner)
            raise NumericFault(f"the weights became non-finite before the checkpoint {at(epoch, batch)}: {found}; "
                               f"{self.path} keeps the last good state. Lower the learning rate (now "
                               f"{self.optimizer.param_groups[0]['lr']:g}) and resume", layer=found.layer,
                               stage=found.stage, device=found.device)
        # mid-epoch in stream mode, the state the next batch starts from (any runner loads it): its first
        # batch_size columns, the stream's; a pipeline's batch was widened by empty columns (fitted) when its
        # micro-batches do not divide batch_size, and another runner's is not
        s = self.settings
        state = self.runner.carried_state() if s.bptt and batch > 0 else None
        if state is not None:
            state = {name: tuple(t[:, :s.batch_size] for t in ts) for name, ts in state.items()}
        try:
            save_checkpoint(self.path, model=self.model, optimizer=self.optimizer, vocab=self.vocab, history=history,
                            epoch=epoch, batch=batch, totals=totals, placement=self.placement, settings=s.kept,
                            options=self.options, carried=state)
        except OSError as e:      # disk full, a file-size limit, ...: the old checkpoint is untouched
            raise WriteFailed(f"cannot write the checkpoint {at(epoch, batch)} to {self.path}: "
                              f"{why(e)}; {self.kept()}. Free some space (or pick another --out) and resume") from e
        self.last_saved = (epoch, batch)

    def kept(self) -> str:
        if self.path is None:
            return "nothing was saved (no out folder)"
        if self.last_saved is None:
            return (f"{self.path} is as it was before this run" if self.path.exists()
                    else "no checkpoint was written yet")
        return (f"the last good checkpoint, {self.path} (epoch {self.last_saved[0] + 1}, batch "
                f"{self.last_saved[1]}), is kept")

    def save_model(self) -> None:
        path = self.out / "model.pt"
        try:
            save_model(path, self.model, self.vocab, placement=self.placement)
        except OSError as e:
            raise WriteFailed(f"cannot write {path}: {why(e)}; the checkpoint beside it holds the same weights "
                              "(resume to write model.pt again)") from e

    def model_file_holds_the_model(self) -> bool:
        """Whether out/model.pt holds exactly the model's weights."""
        try:
            saved, _ = load_model(self.out / "model.pt")
        except CheckpointError:
            return False
        mine = self.model.state_dict()
        return saved.state_dict().keys() == mine.keys() and all(
            torch.equal(t, mine[k].detach().cpu()) for k, t in saved.state_dict().items())


def holding_out(train_fn):
    """train() with its `out` folder created if need be and locked for the whole run (mpedu.runtime.files.OutLock):
    another run writing the same checkpoint.pt, in this process or another, is refused, naming the first."""
    @functools.wraps(train_fn)
    def locked(model, corpus, **kwargs):
        if kwargs.get("out") is None:
            return train_fn(model, corpus, **kwargs)
        runner = kwargs.get("runner")
        owned = runner.owned if isinstance(runner, Runner) else None    # a torchrun rank's layers
        if owned is not None and set(owned) != set(model.layer_names):
            raise ValueError(f"out= saves checkpoints of the whole model, but this runner (one torchrun rank) trains "
                             f"only {', '.join(owned)}: the other layers' weights here are their first ones. Leave "
                             "out=None under torchrun and gather the trained weights at the end with "
                             "runner.gather_state_dict(), as python -m mpedu.distributed train does for model.pt")
        if isinstance(runner, Runner) and runner.world > 1:     # data parallel: every rank holds every layer
            raise ValueError(f"out= would have each of the {runner.world} torchrun ranks write the same checkpoint; "
                             "leave out=None under torchrun and save the weights from rank 0 at the end")
        with OutLock(prepare_out(kwargs["out"]), log=kwargs.get("log", print)):
            return train_fn(model, corpus, **kwargs)
    return locked
