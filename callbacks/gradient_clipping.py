"""Clip gradients by global norm and/or by value before the optimizer step."""

from __future__ import annotations

import torch

from fsmtrain.core.context import RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback

__all__ = ["GradientClippingCallback"]


class GradientClippingCallback(TrainingCallback):
    """On ``on_after_backward`` of every batch whose optimizer step will run (an accumulated gradient is
    clipped once). Priority 20: after the gradient monitor (12), which reports the norm before clipping."""

    priority = 20
    tier = Tier.CORE
    replay = ReplaySupport.DRY

    def __init__(self, max_norm: float | None = None, max_value: float | None = None, norm_type: float = 2.0) -> None:
        if max_norm is None and max_value is None:
            raise ValueError("GradientClippingCallback needs max_norm or max_value (or both)")
        for field, v in (("max_norm", max_norm), ("max_value", max_value)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{field} must be a number > 0, got {v!r}")
        self.max_norm, self.max_value, self.norm_type = max_norm, max_value, float(norm_type)
        self._params: list[torch.Tensor] = []

    def on_train_begin(self, run: RunContext) -> None:
        self._params = [p for p in run.model.parameters() if p.requires_grad] if run.model is not None else []

    def on_after_backward(self, step: StepContext) -> None:
        if step.skip_optimizer_step or not self._params:
            return
        if self.max_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, self.max_value, foreach=True)
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.max_norm, self.norm_type, foreach=True)
