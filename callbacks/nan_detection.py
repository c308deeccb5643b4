"""Stop a run whose train or validation loss is not finite."""

from __future__ import annotations

import math

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.stop import StopReason

__all__ = ["NaNDetectionCallback"]


class NaNDetectionCallback(TrainingCallback):
    """On ``on_epoch_end`` (first, priority 5): a NaN or ±inf ``train_loss`` or ``val_loss``
    requests stop NAN, not immediate, so the epoch's logging and checkpoint still run."""

    priority = 5
    tier = Tier.CORE

    def on_epoch_end(self, epoch: EpochContext) -> None:
        for key in ("train_loss", "val_loss"):
            value = epoch.metrics.get(key)
            if value is not None and not math.isfinite(value):
                epoch.request_stop(StopReason.NAN, self.name, f"{key} is {value} in epoch {epoch.number}")
                return
