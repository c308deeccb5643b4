"""Accumulate gradients over several micro-batches per optimizer step."""

from __future__ import annotations

import torch

from fsmtrain.core.context import RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback, int_at_least

__all__ = ["GradientAccumulationCallback"]


class GradientAccumulationCallback(TrainingCallback):
    """One optimizer step per ``steps`` micro-batches, each loss divided by ``steps``. A partial window
    at an epoch's end (``m`` micro-batches) is flushed rescaled by ``steps / m``, unless ``drop_last``.
    Priority 8: the gradient monitor and clipping then see the accumulated gradient."""

    priority = 8
    tier = Tier.CORE
    replay = ReplaySupport.DRY

    def __init__(self, steps: int, drop_last: bool = False) -> None:
        self.steps = int_at_least("steps", steps, 1)
        self.drop_last = drop_last
        self._params: list[torch.Tensor] = []

    def on_train_begin(self, run: RunContext) -> None:
        self._params = [p for p in run.model.parameters() if p.requires_grad] if run.model is not None else []

    def on_batch_begin(self, step: StepContext) -> None:
        if (step.batch_index + 1) % self.steps == 0 or (step.last_batch and not self.drop_last):
            return  # a full window, or the partial one flushed
        step.skip_optimizer_step = True
        # A dropped partial window is discarded by the zero_grad that still runs on the last batch.
        step.skip_zero_grad = not step.last_batch

    def on_after_forward(self, step: StepContext) -> None:
        if step.loss is not None and self.steps > 1:
            step.loss = step.loss / self.steps

    def on_after_backward(self, step: StepContext) -> None:
        if step.skip_optimizer_step:
            return
        seen = step.batch_index % self.steps + 1  # micro-batches in the window ending here
        if seen != self.steps:  # a partial window, once an epoch at most
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(self.steps / seen)
