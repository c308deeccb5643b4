"""Log every epoch to Weights & Biases (offline by default; no network needed)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.scalars import epoch_scalars
from fsmtrain.core.slots import LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO, STEP_VALUES, StepValues

__all__ = ["WandbLoggingCallback"]

_MODES = ("offline", "online", "disabled", "shared")


def wandb_run_id(run: RunContext) -> str:
    """A W&B run id that is the same for every process of one run (its name and folder)."""
    where = os.path.abspath(run.run_dir) if run.run_dir is not None else run.run_id
    name = re.sub(r"[^A-Za-z0-9_-]", "-", run.run_id)[:48]
    return f"{name}-{hashlib.sha256(str(where).encode()).hexdigest()[:10]}"


class WandbLoggingCallback(TrainingCallback):
    """``wandb.init`` at train begin, one ``run.log(..., step=global_step)`` per epoch and per
    ``step_values``, ``finish`` at train end. The run lands under ``<directory>/wandb/`` (default: the
    run directory), silent on the console. In replay nothing is sent; ``self.logged`` keeps the dicts."""

    priority = 80
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    replay = ReplaySupport.DRY
    reads = (MAX_GRAD_NORM, OVERFIT_GAP_RATIO, LOSS_PREDICTION, STEP_VALUES)
    reads_every_slot = True

    def __init__(self, project: str = "fsmtrain", mode: str = "offline", tags: Sequence[str] = (),
                 config: Mapping[str, Any] | None = None, directory: str | Path | None = None,
                 name: str | None = None) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if isinstance(tags, str):
            raise TypeError(f"tags must be a sequence of strings, got the string {tags!r}")
        self.project, self.mode, self.tags, self.run_name = project, mode, tuple(tags), name
        self.config = dict(config or {})
        self.directory = None if directory is None else Path(directory)
        self.wandb_run: Any = None
        self.logged: list[dict[str, float]] = []
        self.log_errors: list[str] = []  # W&B's own log could not be written (a full disk): what it said
        self._step_sent: StepValues | None = None

    def on_train_begin(self, run: RunContext) -> None:
        if run.dry_run:
            return
        import wandb
        directory = self.directory if self.directory is not None else run.run_dir
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(
            project=self.project, mode=self.mode, tags=list(self.tags),  # type: ignore[arg-type]
            config=self.config or run.extras.get("config") or {}, name=self.run_name or run.run_id,
            id=wandb_run_id(run), resume="allow" if run.extras.get("resumed_from") else None, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"), dir=None if directory is None else str(directory))

        # A failed write of W&B's own log (a full disk) is said once at train end, not printed with its
        # traceback in the middle of the console.
        def kept(record: logging.LogRecord) -> None:
            if len(self.log_errors) < 100:
                self.log_errors.append(record.getMessage()[:200])
        for handler in logging.getLogger("wandb").handlers:
            handler.handleError = kept  # type: ignore[method-assign]
        run.emit("wandb_init", mode=self.mode, project=self.project,
                 dir=None if self.wandb_run is None else str(getattr(self.wandb_run, "dir", "")))

    def on_train_step_end(self, step: StepContext) -> None:
        values = step.get(STEP_VALUES)
        if values is not self._step_sent and values is not None and self.wandb_run is not None:
            self._step_sent = values
            self.wandb_run.log(values.scalars(), step=values.step)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        data = {"epoch": epoch.number, **epoch_scalars(epoch)}
        self.logged.append(data)
        if self.wandb_run is not None:
            self.wandb_run.log(data, step=epoch.run.global_step)

    def on_train_end(self, run: RunContext) -> None:
        wb, self.wandb_run, reason = self.wandb_run, None, run.stop_reason
        if wb is None:
            return
        try:
            wb.summary["stop_reason"] = reason.value
            best = run.best()
            if math.isfinite(best):
                wb.summary["best_val_loss"] = best
        finally:
            try:
                wb.finish(exit_code=1 if reason.failed else 0)
            finally:
                if self.log_errors:
                    run.warn(self.name, f"W&B could not write its own log {len(self.log_errors)} time(s) (first: "
                             f"{self.log_errors[0]!r}); those messages are lost")
