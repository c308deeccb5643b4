"""Stop when the monitored metric has not improved by a relative margin for ``patience`` validations."""

from __future__ import annotations

import math
from typing import Any

from fsmtrain.core.context import EpochContext, RunContext, validation_label
from fsmtrain.core.hooks import Tier, TrainingCallback, int_at_least
from fsmtrain.core.slots import EARLY_STOPPING_WAIT
from fsmtrain.core.stop import StopReason

__all__ = ["EarlyStoppingCallback", "improves"]


def improves(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """``min_delta`` is relative to ``|best|``: in min mode ``value < best - |best|·min_delta``
    (max mode mirrored). Works for negative and zero values; a non-finite value never improves."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    margin = abs(best) * min_delta
    return value < best - margin if mode == "min" else value > best + margin


class EarlyStoppingCallback(TrainingCallback):
    """On ``on_val_end``: after ``patience`` validations in a row without improvement, request stop
    EARLY_STOP. The count goes to slot ``early_stopping_wait``, the settings into the log."""

    priority = 90
    tier = Tier.CORE
    writes = (EARLY_STOPPING_WAIT,)

    def __init__(self, patience: int = 20, mode: str = "min", min_delta: float = 1e-4,
                 monitor: str = "val_loss") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"min_delta must be a number >= 0 (relative to the best value), got {min_delta!r}")
        self.patience = int_at_least("patience", patience, 1)
        self.mode, self.min_delta, self.monitor = mode, float(min_delta), monitor
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_at: dict[str, int] | None = None  # the best's validation, epoch and step (from 1)
        self.wait = 0

    def on_train_begin(self, run: RunContext) -> None:
        run.emit("callback_settings", source=self.name, settings={
            "patience": self.patience, "monitor": self.monitor, "mode": self.mode, "min_delta": self.min_delta})

    def on_val_end(self, epoch: EpochContext) -> None:
        value = self.monitored(epoch, self.monitor, "early stopping is inactive")
        if value is None:
            return
        if improves(value, self.best, self.mode, self.min_delta):
            self.best, self.best_epoch, self.wait = float(value), epoch.index, 0
            self.best_at = {"validation": epoch.run.validations, "epoch": epoch.number, "step": epoch.run.global_step}
            epoch.set(EARLY_STOPPING_WAIT, 0)
            return
        self.wait += 1
        epoch.set(EARLY_STOPPING_WAIT, self.wait)
        if self.wait >= self.patience:
            best_at = "?" if self.best_at is None else validation_label(self.best_at)
            epoch.request_stop(
                StopReason.EARLY_STOP, self.name,
                f"{self.monitor} did not improve on {self.best} ({best_at}) by more than "
                f"{self.min_delta:g} relative for {self.wait} validations",
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_at": self.best_at, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.best_at = state.get("best"), state.get("best_epoch"), state.get("best_at")
        self.wait = int(state.get("wait", 0))
