"""An aligned console table, one line per epoch, for runs without a terminal bar: a column per metric and
numeric slot, the header (and a legend) again when a new column appears, ``-`` for an absent value."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TextIO

from fsmtrain.core.context import UNBOUNDED_EPOCHS, EpochContext, RunContext
from fsmtrain.core.hooks import Tier, TrainingCallback, int_at_least
from fsmtrain.core.scalars import epoch_scalars
from fsmtrain.core.slots import LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO

__all__ = ["ABBREVIATIONS", "EpochSummaryCallback", "SummaryTable"]

# Short labels for the built-in columns (in this order, before any other)
ABBREVIATIONS: Mapping[str, tuple[str, str]] = {
    "train_loss": ("train", "train loss"),
    "val_loss": ("val", "validation loss"),
    "lr": ("lr", "learning rate"),
    "max_grad_norm": ("grad", "max gradient norm"),
    "predicted_final_loss": ("pred", "predicted final val loss"),
    "overfit_gap_ratio": ("gap", "val/train loss ratio while overfitting"),
}
_RANK = {name: i for i, name in enumerate(ABBREVIATIONS)}
_WIDTH = 10  # fits any ".4g" number ("-1.235e-05") and ".2e" learning rate


def _num(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return format(value, ".2e" if name == "lr" else ".4g")


class SummaryTable:
    """The growing set of columns and the lines that print them (header lines only when needed)."""

    def __init__(self, max_epochs: int) -> None:
        self.max_epochs = max_epochs
        self.columns: list[str] = []
        self._seen: dict[str, int] = {}  # name -> first-seen order, for columns without a rank
        self._explained: set[str] = set()
        self._of = "" if max_epochs >= UNBOUNDED_EPOCHS else f"/{max_epochs}"  # only max_steps bounds the run
        self._epoch_width = max(len("epoch"), len(str(max_epochs)) + len(self._of))

    def label(self, name: str) -> str:
        return ABBREVIATIONS[name][0] if name in ABBREVIATIONS else name

    def _width(self, name: str) -> int:
        return max(_WIDTH, len(self.label(name)))

    def lines(self, index: int, values: Mapping[str, float]) -> list[str]:
        """For epoch ``index`` (0-based): legend and header if the columns changed, then the row."""
        out: list[str] = []
        new = [n for n in values if n not in self._seen]
        if new or not self.columns:
            self._seen.update((name, len(self._seen) + i) for i, name in enumerate(new))
            self.columns = sorted(self._seen, key=lambda n: (_RANK.get(n, len(_RANK)), self._seen[n]))
            legend = [n for n in self.columns if n in ABBREVIATIONS and n not in self._explained]
            if legend:
                self._explained.update(legend)
                out.append("columns: " + ", ".join(f"{ABBREVIATIONS[n][0]} = {ABBREVIATIONS[n][1]}" for n in legend))
            out.append("  ".join(["epoch".ljust(self._epoch_width),
                                  *(self.label(n).rjust(self._width(n)) for n in self.columns)]))
        row = [f"{index + 1}{self._of}".ljust(self._epoch_width),
               *(_num(n, values.get(n)).rjust(self._width(n)) for n in self.columns)]
        out.append("  ".join(row))
        return out


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
        self._table: SummaryTable | None = None

    def on_train_begin(self, run: RunContext) -> None:
        self._table = SummaryTable(run.max_epochs)  # each run prints its own header

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if (epoch.index + 1) % self.every_n_epochs and not epoch.run.ends_after(epoch.index):
            return
        if self._table is None:
            self._table = SummaryTable(epoch.run.max_epochs)
        stream = self.stream if self.stream is not None else sys.stdout
        print("\n".join(self._table.lines(epoch.index, epoch_scalars(epoch))), file=stream, flush=True)
