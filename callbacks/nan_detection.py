"""Stop a run whose train or validation loss is not finite."""

from __future__ import annotations

import math

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.slots import NONFINITE_ORIGIN
from fsmtrain.core.stop import StopReason

__all__ = ["NaNDetectionCallback"]


class NaNDetectionCallback(TrainingCallback):
    """On ``on_epoch_end`` (first, priority 5): a non-finite ``train_loss`` or ``val_loss`` requests stop
    NAN, so the epoch's logging and checkpoint still run. On several ranks only the rank whose own loss
    went non-finite first asks, so the stop names where it began."""

    priority = 5
    tier = Tier.CORE

    def on_epoch_end(self, epoch: EpochContext) -> None:
        for key in ("train_loss", "val_loss"):
            value = epoch.metrics.get(key)
            if value is not None and not math.isfinite(value):
                message, origin = f"{key} is {value} in epoch {epoch.number}", epoch.run.get(NONFINITE_ORIGIN)
                if key == "train_loss" and origin is not None:
                    if origin[0] != int(epoch.run.extras.get("rank", 0)):
                        return  # that rank asks
                    message += f", first on rank {origin[0]} (its own loss at batch {origin[1] + 1})"
                epoch.request_stop(StopReason.NAN, self.name, message)
                return
