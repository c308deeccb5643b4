"""Stop a run whose train or validation loss is not finite."""

from __future__ import annotations

import math

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.stop import StopReason

__all__ = ["NaNDetectionCallback"]


class NaNDetectionCallback(TrainingCallback):
    """On ``on_epoch_end``: a NaN or ±inf ``train_loss`` or ``val_loss`` requests stop NAN.

    The stop is not immediate, so this epoch's logging and checkpoint handlers still run; the
    run's result objective is then ``inf``. Priority 5: first at epoch end.
    """

    priority = 5
    tier = Tier.CORE

    def on_epoch_end(self, epoch: EpochContext) -> None:
        for key in ("train_loss", "val_loss"):
            value = epoch.metrics.get(key)
            if value is not None and not math.isfinite(value):
                epoch.request_stop(StopReason.NAN, self.name, f"{key} is {value} in epoch {epoch.number}")
                return
