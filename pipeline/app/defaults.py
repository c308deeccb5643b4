"""The callbacks a run gets without asking: the same for ``fsmtrain train`` and a Python ``Trainer``.

- :func:`console_callbacks`: a progress bar on a terminal, else one aligned line per epoch.
- :func:`default_callbacks`: what a ``Trainer`` built without ``default_callbacks=False`` adds to
  the callbacks it was given: the console, the built-ins that only watch (NaN detection, the
  optimizer's train/eval mode, the gradient monitor, loss prediction, overfit detection) and,
  with a run directory, ``metrics.csv`` and checkpoints, with the config's defaults. A callback of
  the same class the caller gave is not added twice (the caller's wins). Early stopping is not a
  default in Python: it changes how long a run trains, so it is asked for by adding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fsmtrain.core.hooks import TrainingCallback

__all__ = ["console_callbacks", "default_callbacks"]


def console_callbacks() -> list[TrainingCallback]:
    from fsmtrain.callbacks import EpochSummaryCallback, ProgressBarCallback
    from fsmtrain.callbacks.progress_bar import auto_enabled

    return [ProgressBarCallback(enabled=True)] if auto_enabled() else [EpochSummaryCallback()]


def default_callbacks(
    given: Sequence[TrainingCallback], *, run_dir: Path | None, max_epochs: int
) -> list[TrainingCallback]:
    """``given``, plus the defaults of the classes it lacks."""
    import fsmtrain.callbacks as cb
    from fsmtrain.app.config.schema import CheckpointConfig, GradientMonitorOptions, OverfitOptions

    monitor, overfit, ck = GradientMonitorOptions(), OverfitOptions(), CheckpointConfig()
    defaults: list[TrainingCallback] = [
        cb.NaNDetectionCallback(),
        cb.OptimizerModeCallback(),
        cb.GradientMonitorCallback(warn_threshold=monitor.warn_threshold),
        cb.LossPredictionCallback(max_epochs=max_epochs),
        cb.OverfitDetectionCallback(warmup_epochs=overfit.warmup_epochs, window_size=overfit.window_size),
    ]
    if not any(isinstance(c, (cb.EpochSummaryCallback, cb.ProgressBarCallback)) for c in given):
        defaults += console_callbacks()
    if run_dir is not None:
        defaults += [
            cb.MetricsCsvCallback(run_dir / "metrics.csv"),
            cb.CheckpointCallback(run_dir / "checkpoints", save_every_n_epochs=ck.save_every_n_epochs,
                                  keep_last_k=ck.keep_last_k, save_best=ck.save_best, monitor=ck.monitor,
                                  mode=ck.mode, save_latest=ck.save_latest, background=ck.background),
        ]
    kinds = {type(c) for c in given}
    return [*given, *(d for d in defaults if type(d) not in kinds)]
