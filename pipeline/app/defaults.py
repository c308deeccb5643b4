"""The callbacks a run gets without asking (``fsmtrain train`` and a ``Trainer`` alike): the console, the
watching built-ins and, with a run directory, ``metrics.csv`` and checkpoints; never early stopping."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fsmtrain.core.hooks import TrainingCallback

__all__ = ["console_callbacks", "default_callbacks"]


def console_callbacks() -> list[TrainingCallback]:
    from fsmtrain.callbacks import EpochSummaryCallback, ProgressBarCallback
    from fsmtrain.callbacks.progress_bar import auto_enabled
    # On a terminal the bar redirects stdout, so each epoch's line prints above it and stays.
    return [EpochSummaryCallback(), *([ProgressBarCallback(enabled=True)] if auto_enabled() else [])]


def default_callbacks(given: Sequence[TrainingCallback], *, run_dir: Path | None,
                      max_epochs: int) -> list[TrainingCallback]:
    """``given``, plus the defaults of the classes it lacks (the caller's instance wins)."""
    import fsmtrain.callbacks as cb
    from fsmtrain.app.config.builders import checkpoint_callback, watching_callbacks
    from fsmtrain.app.config.schema import CallbacksConfig, CheckpointConfig
    defaults = watching_callbacks(CallbacksConfig(), max_epochs)
    if not any(isinstance(c, (cb.EpochSummaryCallback, cb.ProgressBarCallback)) for c in given):
        defaults += console_callbacks()
    if run_dir is not None:
        defaults += [cb.MetricsCsvCallback(run_dir / "metrics.csv"), checkpoint_callback(CheckpointConfig(), run_dir)]
    kinds = {type(c) for c in given}
    return [*given, *(d for d in defaults if type(d) not in kinds)]
