"""A compact console line per epoch (or every N epochs), for runs without W&B or a terminal bar."""

from __future__ import annotations

import math
import sys
from typing import TextIO

from pipeline.core.context import EpochContext
from pipeline.core.hooks import Tier, TrainingCallback
from pipeline.core.slots import LOSS_PREDICTION, MAX_GRAD_NORM

__all__ = ["EpochSummaryCallback", "summary_line"]


def _num(value: float | None, fmt: str = ".4g") -> str:
    if value is None:
        return "-"
    return format(value, fmt) if math.isfinite(value) else str(value)


def summary_line(epoch: EpochContext) -> str:
    m = epoch.metrics
    prediction = epoch.get(LOSS_PREDICTION)
    parts = [
        f"epoch {epoch.index + 1}/{epoch.run.max_epochs}",
        f"train {_num(m.get('train_loss'))}",
        f"val {_num(m.get('val_loss'))}",
        f"lr {_num(m.get('lr'), '.2e')}",
        f"grad {_num(epoch.get(MAX_GRAD_NORM), '.3g')}",
    ]
    if prediction is not None:
        parts.append(f"pred {_num(prediction.predicted_loss)}")
    return "  ".join(parts)


class EpochSummaryCallback(TrainingCallback):
    """On ``on_epoch_end`` every ``every_n_epochs`` epochs (and on the run's last epoch): one line
    with epoch, losses, lr, max grad norm and the predicted final loss, to ``stream``
    (default ``sys.stdout``, looked up when writing)."""

    priority = 88
    tier = Tier.CORE
    reads = (MAX_GRAD_NORM, LOSS_PREDICTION)

    def __init__(self, every_n_epochs: int = 1, stream: TextIO | None = None) -> None:
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be an integer >= 1, got {every_n_epochs!r}")
        self.every_n_epochs = every_n_epochs
        self.stream = stream

    def on_epoch_end(self, epoch: EpochContext) -> None:
        run = epoch.run
        last = run.stop is not None or epoch.index + 1 >= run.max_epochs
        if (epoch.index + 1) % self.every_n_epochs and not last:
            return
        stream = self.stream if self.stream is not None else sys.stdout
        print(summary_line(epoch), file=stream, flush=True)
