"""Report each epoch to an Optuna trial and stop the run when the trial's pruner says so."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline.core.context import EpochContext
from pipeline.core.hooks import Tier, TrainingCallback
from pipeline.core.lifecycle import StopReason

if TYPE_CHECKING:
    import optuna

__all__ = ["PrunerCallback"]


class PrunerCallback(TrainingCallback):
    """On ``on_val_end``: ``trial.report(value, epoch)``, a ``trial_report`` event
    ``{epoch, value, should_prune}``, and a stop request PRUNED when ``trial.should_prune()``.

    The run still ends through ``train_end`` (``on_train_end`` runs, the checkpoint of the epoch
    is written); the HPO layer raises ``optuna.TrialPruned`` after ``fit()`` returns."""

    priority = 85
    tier = Tier.CORE

    def __init__(self, trial: optuna.trial.Trial, monitor: str = "val_loss") -> None:
        if not hasattr(trial, "report") or not hasattr(trial, "should_prune"):
            raise TypeError(f"trial must be an optuna.trial.Trial, got {type(trial).__name__}")
        self.trial = trial
        self.monitor = monitor

    def on_val_end(self, epoch: EpochContext) -> None:
        value = self.monitored(epoch, self.monitor, "the trial gets no reports")
        if value is None:
            return
        self.trial.report(float(value), epoch.index)
        should_prune = bool(self.trial.should_prune())
        number = getattr(self.trial, "number", None)  # replay passes a recorded stand-in
        epoch.emit("trial_report", epoch=epoch.index, value=float(value), should_prune=should_prune, trial=number)
        if should_prune:
            shown = f"{value:.6g}" if math.isfinite(value) else str(value)
            epoch.request_stop(StopReason.PRUNED, self.name,
                               f"trial {number} pruned in epoch {epoch.number} ({self.monitor}={shown})")
