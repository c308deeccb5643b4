"""An aligned console table, one line per epoch, for runs without a terminal bar: a column per metric and
numeric slot, the header (and a legend) again when a new column appears, ``-`` for an absent value."""

from __future__ import annotations

import sys
from typing import TextIO

from fsmtrain.core.context import UNBOUNDED_EPOCHS, EpochContext, RunContext
from fsmtrain.core.hooks import Tier, TrainingCallback, int_at_least
from fsmtrain.core.scalars import epoch_scalars
from fsmtrain.core.slots import LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO

__all__ = ["EpochSummaryCallback"]

# Short labels for the built-in columns (in this order, before any other)
_ABBREVIATIONS = {
    "train_loss": ("train", "train loss"),
    "val_loss": ("val", "validation loss"),
    "lr": ("lr", "learning rate"),
    "max_grad_norm": ("grad", "max gradient norm"),
    "predicted_final_loss": ("pred", "predicted final val loss"),
    "overfit_gap_ratio": ("gap", "val/train loss ratio while overfitting"),
}
_RANK = {name: i for i, name in enumerate(_ABBREVIATIONS)}
_WIDTH = 10  # fits any ".4g" number ("-1.235e-05") and ".2e" learning rate


def _label(name: str) -> str:
    return _ABBREVIATIONS[name][0] if name in _ABBREVIATIONS else name


def _width(name: str) -> int:
    return max(_WIDTH, len(_label(name)))


def _cell(name: str, value: float | None) -> str:
    return "-" if value is None else format(value, ".2e" if name == "lr" else ".4g")


class EpochSummaryCallback(TrainingCallback):
    """On ``on_epoch_end`` every ``every_n_epochs`` epochs (and the last): one line of the table to
    ``stream`` (default ``sys.stdout``, looked up when writing)."""

    priority = 88
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    reads = (MAX_GRAD_NORM, OVERFIT_GAP_RATIO, LOSS_PREDICTION)
    reads_every_slot = True

    def __init__(self, every_n_epochs: int = 1, stream: TextIO | None = None) -> None:
        self.every_n_epochs = int_at_least("every_n_epochs", every_n_epochs, 1)
        self.stream = stream
        self._columns: list[str] = []  # by rank, then (the others) in the order they first appeared
        self._explained: set[str] = set()

    def on_train_begin(self, run: RunContext) -> None:
        self._columns, self._explained = [], set()  # each run prints its own header

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if (epoch.index + 1) % self.every_n_epochs and not epoch.run.ends_after(epoch.index):
            return
        values, max_epochs = epoch_scalars(epoch), epoch.run.max_epochs
        lines: list[str] = []
        of = "" if max_epochs >= UNBOUNDED_EPOCHS else f"/{max_epochs}"  # only max_steps bounds the run
        epoch_width = max(len("epoch"), len(str(max_epochs)) + len(of))
        new = [n for n in values if n not in self._columns]
        if new or not self._columns:
            self._columns = sorted([*self._columns, *new], key=lambda n: _RANK.get(n, len(_RANK)))  # stable
            legend = [n for n in self._columns if n in _ABBREVIATIONS and n not in self._explained]
            if legend:
                self._explained.update(legend)
                lines.append("columns: " + ", ".join("{} = {}".format(*_ABBREVIATIONS[n]) for n in legend))
            lines.append("  ".join(["epoch".ljust(epoch_width), *(_label(n).rjust(_width(n)) for n in self._columns)]))
        lines.append("  ".join([f"{epoch.number}{of}".ljust(epoch_width),
                                *(_cell(n, values.get(n)).rjust(_width(n)) for n in self._columns)]))
        print("\n".join(lines), file=self.stream if self.stream is not None else sys.stdout, flush=True)
