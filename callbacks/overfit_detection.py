"""Flag a run whose train loss keeps falling while its val loss keeps rising."""

from __future__ import annotations

import math
from typing import Any

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import Tier, TrainingCallback, int_at_least
from fsmtrain.core.slots import OVERFIT_GAP_RATIO

__all__ = ["OverfitDetectionCallback", "diverging"]


def diverging(train: list[float], val: list[float], window_size: int) -> bool:
    """Over the last ``window_size`` epoch-to-epoch changes, train strictly fell and val strictly
    rose (a flat step, or any NaN, breaks the streak)."""
    if len(train) < window_size + 1 or len(val) < window_size + 1:
        return False
    tw, vw = train[-window_size - 1 :], val[-window_size - 1 :]
    return all(tw[i + 1] < tw[i] and vw[i + 1] > vw[i] for i in range(window_size))


class OverfitDetectionCallback(TrainingCallback):
    """On ``on_epoch_end`` after ``warmup_epochs``: if the last ``window_size`` changes diverge, flag
    overfitting (sticky), write ``val_loss / train_loss`` to slot ``overfit_gap_ratio`` and warn once.
    Never stops training."""

    priority = 75
    tier = Tier.CORE
    writes = (OVERFIT_GAP_RATIO,)

    def __init__(self, warmup_epochs: int = 5, window_size: int = 5) -> None:
        self.warmup_epochs = int_at_least("warmup_epochs", warmup_epochs, 0)
        self.window_size = int_at_least("window_size", window_size, 1)
        self.train: list[float] = []
        self.val: list[float] = []
        self.overfitting = False
        self.first_detected: int | None = None

    def on_epoch_end(self, epoch: EpochContext) -> None:
        train, val = epoch.metrics.get("train_loss"), epoch.metrics.get("val_loss")
        if train is None or val is None:
            return
        self.train.append(float(train))
        self.val.append(float(val))
        keep = self.window_size + 1  # only the window is ever compared
        del self.train[:-keep], self.val[:-keep]
        if epoch.index < self.warmup_epochs or not diverging(self.train, self.val, self.window_size):
            return
        ratio = val / train if train != 0 else math.inf
        epoch.set(OVERFIT_GAP_RATIO, ratio)
        if not self.overfitting:
            self.overfitting = True
            self.first_detected = epoch.index
            epoch.warn(
                self.name,
                f"overfitting from epoch {epoch.number}: over the last {self.window_size} epochs train loss fell "
                f"and val loss rose (val/train = {ratio:.4g})",
                epoch=epoch.index, overfit_gap_ratio=ratio,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"train": list(self.train), "val": list(self.val), "overfitting": self.overfitting,
                "first_detected": self.first_detected}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train = [float(v) for v in state.get("train", [])]
        self.val = [float(v) for v in state.get("val", [])]
        self.overfitting = bool(state.get("overfitting", False))
        self.first_detected = state.get("first_detected")
