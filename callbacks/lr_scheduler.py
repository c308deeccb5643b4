"""Step any torch or pytorch-optimizer LR scheduler per epoch or per optimizer step."""

from __future__ import annotations

from typing import Any

import torch

from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.training.optimizers import NamedSchedulers

__all__ = ["LRSchedulerCallback"]


class LRSchedulerCallback(TrainingCallback):
    """``interval="epoch"``: ``scheduler.step()`` in ``on_before_scheduler_step`` (``ReduceLROnPlateau``
    gets the epoch's ``monitor`` value); ``interval="step"``: after every optimizer step that ran. Do
    not also pass the scheduler to ``Trainer(scheduler=...)``: it would step twice."""

    priority = 30
    tier = Tier.CORE
    replay = ReplaySupport.DRY

    def __init__(self, scheduler: Any, interval: str = "epoch", monitor: str = "val_loss") -> None:
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
        if interval not in ("epoch", "step"):
            raise ValueError(f"interval must be 'epoch' or 'step', got {interval!r}")
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor
        each = scheduler.schedulers.values() if isinstance(scheduler, NamedSchedulers) else [scheduler]
        self.plateau = any(isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) for s in each)
        if self.plateau and interval == "step":
            raise ValueError("ReduceLROnPlateau needs a monitored value per epoch; use interval='epoch'")

    def overridden_hooks(self) -> tuple[str, ...]:
        """Per epoch, it needs no optimizer step hook (so a manual step, which leaves those out, takes it)."""
        hooks = super().overridden_hooks()
        return hooks if self.interval == "step" else tuple(h for h in hooks if h != "on_after_optimizer_step")

    def on_after_optimizer_step(self, step: StepContext) -> None:
        if self.interval == "step" and not step.run.dry_run:
            self.scheduler.step()

    def on_before_scheduler_step(self, epoch: EpochContext) -> None:
        if self.interval != "epoch" or epoch.run.dry_run:
            return
        if not self.plateau:
            self.scheduler.step()
            return
        value = self.monitored(epoch, self.monitor, "ReduceLROnPlateau is not stepped")
        if value is not None or isinstance(self.scheduler, NamedSchedulers):  # its others step regardless
            self.scheduler.step(value)

    def state_dict(self) -> dict[str, Any]:
        sd = getattr(self.scheduler, "state_dict", None)
        return {"scheduler": sd() if callable(sd) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = state.get("scheduler")
        if inner is not None and callable(getattr(self.scheduler, "load_state_dict", None)):
            self.scheduler.load_state_dict(inner)
