"""Step-level training values every N global steps (``log_every_n_steps``), read from the device then only."""

from __future__ import annotations

from typing import Any

import torch

from fsmtrain.core.context import RunContext, StepContext, epoch_number
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback, int_at_least
from fsmtrain.core.slots import STEP_VALUES, StepValues

__all__ = ["StepLogCallback"]


class StepLogCallback(TrainingCallback):
    """Every ``every_n_steps``-th global step: a ``train_step`` event with ``loss`` (what backward ran
    on), ``lr`` and ``grad_norm`` (before clipping), also as slot ``step_values`` for W&B and TensorBoard."""

    priority = 13  # after gradient accumulation's rescale (8) and the monitor (12), before clipping
    tier = Tier.CORE
    replay = ReplaySupport.DRY  # needs live losses and gradients
    rank_zero_only = True
    writes = (STEP_VALUES,)
    works_sharded = False  # its gradient norm is rank 0's alone: sharded, that is a collective

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = int_at_least("every_n_steps", every_n_steps, 1)
        self._params: list[torch.Tensor] = []
        self._norm: torch.Tensor | None = None

    def on_train_begin(self, run: RunContext) -> None:
        self._params = [p for p in run.model.parameters() if p.requires_grad] if run.model is not None else []

    def _due(self, step: StepContext) -> bool:
        return (step.run.global_step + 1) % self.every_n_steps == 0

    def on_after_backward(self, step: StepContext) -> None:
        if not self._due(step) or step.run.dry_run:
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        self._norm = torch.nn.utils.get_total_norm(grads) if grads else None

    def on_train_step_end(self, step: StepContext) -> None:
        if not self._due(step) or step.run.dry_run:
            return
        run, values = step.run, dict[str, Any]()
        if step.loss is not None:
            values["loss"] = float(step.loss.detach().item())
        if run.optimizer is not None and run.optimizer.param_groups:
            values["lr"] = float(run.optimizer.param_groups[0]["lr"])
        if self._norm is not None:
            values["grad_norm"] = float(self._norm.item())
        self._norm = None
        step.emit("train_step", step=run.global_step + 1, batch=step.batch_index, **values)
        step.set(STEP_VALUES, StepValues(run.global_step + 1, epoch_number(run.epoch), values))
