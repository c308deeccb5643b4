"""A live progress display (epochs, batches, loss) on a terminal; silent elsewhere."""

from __future__ import annotations

import io
import math
import os
import sys
import time
from typing import Any, TextIO, cast

from fsmtrain.core.context import UNBOUNDED_EPOCHS, EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import Tier, TrainingCallback

__all__ = ["ProgressBarCallback", "auto_enabled", "current_stderr"]


def auto_enabled() -> bool:
    """On only when stdout is a terminal and the ``CI`` variable is unset."""
    return "CI" not in os.environ and bool(getattr(sys.stdout, "isatty", lambda: False)())


class _CurrentStderr(io.TextIOBase):
    """``sys.stderr`` as it is at each write. A live bar swaps ``sys.stderr`` for a proxy that prints
    above the bar; a run's console that kept the stream it started with would draw over the bar."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def current_stderr() -> TextIO:
    """A console stream for a run: lines written while a bar is live print above it."""
    return cast(TextIO, _CurrentStderr())


class ProgressBarCallback(TrainingCallback):
    """A ``rich`` display: a bar for the epochs (with the last epoch's metrics) and one for the
    current epoch's batches with the live loss, read from the device at most ten times a second.
    ``enabled=None`` decides with :func:`auto_enabled`."""

    priority = 98
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    refresh_seconds = 0.1

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self.active = False
        self._progress: Any = None
        self._epochs: Any = None
        self._batches: Any = None
        self._batches_per_epoch: int | None = None
        self._last_read = 0.0

    def on_train_begin(self, run: RunContext) -> None:
        self.active = auto_enabled() if self.enabled is None else bool(self.enabled)
        if not self.active:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=Console(file=sys.stdout), transient=False,
        )
        self._progress.start()
        total = run.max_epochs if run.max_epochs < UNBOUNDED_EPOCHS else None
        self._epochs = self._progress.add_task("epochs", total=total, completed=run.epoch, info="")
        self._batches = self._progress.add_task("batches", total=None, info="")

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if self.active:
            self._progress.reset(self._batches, total=self._batches_per_epoch,
                                 description=f"epoch {epoch.number}/{epoch.run.max_epochs}", info="")

    def on_train_step_end(self, step: StepContext) -> None:
        if not self.active:
            return
        self._progress.advance(self._batches)
        now = time.monotonic()
        if step.loss is not None and now - self._last_read >= self.refresh_seconds:
            self._last_read = now
            self._progress.update(self._batches, info=f"loss {float(step.loss.detach()):.4g}")

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if not self.active:
            return
        self._batches_per_epoch = epoch.batches or None
        # Every metric of the epoch (validation metrics included); the learning rate is not a result.
        parts = [f"{k} {v:.4g}" for k, v in epoch.metrics.items() if k != "lr" and not math.isnan(v)]
        self._progress.update(self._epochs, advance=1, info="  ".join(parts))

    def on_train_end(self, run: RunContext) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.active = False
