"""SingleDevice: the reference runner, the whole model on one torch device; every pipeline must match it."""
from __future__ import annotations

import torch

from ..lm import dropout
from ..lm.model import LSTMLM, detach_state, nll_sum
from .runner import BaseRunner, StepResult, check_batch, check_carried


class SingleDevice(BaseRunner):
    """The reference runner: the whole model on one torch device.

    `train_step` accumulates gradients into `.grad` (the trainer zeroes and steps).
    Hidden state starts at zero for every batch, unless `batch.carry_state` (stream
    mode): then it is carried, detached, from the previous batch of the same width.
    Dropout masks are those of Position(dropout_seed, dropout_step) (mpedu.lm.dropout), the
    same a Pipeline draws; each train_step counts dropout_step up.
    """

    carries_state = True

    def __init__(self, model: LSTMLM, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.dropout_seed, self.dropout_step = 0, 0
        self.reset_state()

    def reset_state(self) -> None:
        self._state, self._width = None, None

    def close(self) -> None:
        pass

    def carried_state(self) -> dict | None:
        """The recurrent state carried into the next stream-mode batch, {layer: (h, c)} on the CPU, or None."""
        if self._state is None:
            return None
        return {name: tuple(t.detach().cpu() for t in s) for name, s in self._state.items() if s is not None} or None

    def load_carried_state(self, state: dict | None) -> None:
        """Carry `state` (any runner's carried_state) into the next stream-mode batch of its width."""
        self.reset_state()
        if state:
            self._width = check_carried(state, self.model)
            self._state = {name: tuple(t.to(self.device) for t in s) for name, s in state.items()}

    def _nll(self, batch) -> torch.Tensor:
        check_batch(batch, self.model.vocab_size)
        inputs, targets = batch.inputs.to(self.device), batch.targets.to(self.device)  # (T, B)
        width = inputs.shape[1]
        carried = self._state if batch.carry_state and width == self._width else None
        logits, state = self.model(inputs, carried)                                     # (T, B, V)
        if batch.carry_state:
            self._state, self._width = detach_state(state), width
        else:
            self.reset_state()
        return nll_sum(logits, targets)

    def train_step(self, batch) -> StepResult:
        self.model.train()
        with dropout.at(dropout.Position(self.dropout_seed, self.dropout_step)):   # the whole batch: (b0, t0) = (0, 0)
            nll = self._nll(batch)
        (nll / batch.tokens).backward()
        self.dropout_step += 1
        return StepResult(nll.item() / batch.tokens, nll.item(), batch.tokens)

    @torch.no_grad()
    def eval_step(self, batch) -> StepResult:
        self.model.eval()
        nll = self._nll(batch).item()
        return StepResult(nll / batch.tokens, nll, batch.tokens)
