"""Switch optimizers that keep separate train/eval weights (SPlus, ScheduleFree) between modes."""

from __future__ import annotations

from typing import Any

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.training.optimizers import optimizers_of

__all__ = ["OptimizerModeCallback", "has_modes"]


def has_modes(optimizer: Any, model: Any) -> bool:
    """True for an optimizer with callable ``train``/``eval`` that is not the model itself."""
    if optimizer is None or optimizer is model:
        return False
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


class OptimizerModeCallback(TrainingCallback):
    """``optimizer.train()`` at epoch begin, ``optimizer.eval()`` at validation begin (each optimizer
    that has modes), so validation and the epoch's checkpoint see the evaluation weights."""

    priority = 10
    tier = Tier.CORE
    replay = ReplaySupport.DRY

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self._switch(epoch, "train")

    def on_val_begin(self, epoch: EpochContext) -> None:
        self._switch(epoch, "eval")

    @staticmethod
    def _switch(epoch: EpochContext, mode: str) -> None:
        run = epoch.run
        if not run.dry_run:
            for optimizer in optimizers_of(run.optimizer).values():
                if has_modes(optimizer, run.model):
                    getattr(optimizer, mode)()
