"""Accumulate gradients over several micro-batches per optimizer step."""

from __future__ import annotations

import torch

from fsmtrain.core.context import RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback

__all__ = ["GradientAccumulationCallback"]


class GradientAccumulationCallback(TrainingCallback):
    """One optimizer step per ``steps`` micro-batches, through the step context's skip flags.

    Each micro-batch loss is divided by ``steps``, so with a mean-reduced loss and equal
    micro-batches, ``steps`` accumulated micro-batches give the gradient of one batch ``steps``
    times larger. A partial window at the end of an epoch (``m < steps`` micro-batches) is flushed
    with its gradient rescaled by ``steps / m`` (the mean over the batches it saw), unless
    ``drop_last``, which discards it. Priority 8: before the gradient monitor and clipping, which
    then see the whole accumulated gradient once per optimizer step.
    """

    priority = 8
    tier = Tier.CORE
    replay = ReplaySupport.DRY

    def __init__(self, steps: int, drop_last: bool = False) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self.steps = steps
        self.drop_last = drop_last
        self._params: list[torch.Tensor] = []

    def on_train_begin(self, run: RunContext) -> None:
        model = run.model
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []

    def _window(self, step: StepContext) -> int:
        """Micro-batches in the window ending at this batch (``steps`` unless it is a partial one)."""
        return step.batch_index % self.steps + 1

    def on_batch_begin(self, step: StepContext) -> None:
        full = (step.batch_index + 1) % self.steps == 0
        if full:
            return
        if step.last_batch and not self.drop_last:
            return  # flush the partial window
        step.skip_optimizer_step = True
        # A dropped partial window is discarded by the zero_grad that still runs on the last batch.
        step.skip_zero_grad = not step.last_batch

    def on_after_forward(self, step: StepContext) -> None:
        if step.loss is not None and self.steps > 1:
            step.loss = step.loss / self.steps

    def on_after_backward(self, step: StepContext) -> None:
        if step.skip_optimizer_step:
            return
        seen = self._window(step)
        if seen != self.steps:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.steps / seen)
