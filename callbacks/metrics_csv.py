"""``metrics.csv``: one row per epoch, for pandas, spreadsheets and plotting scripts."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.scalars import epoch_scalars
from fsmtrain.core.slots import EARLY_STOPPING_WAIT, LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO

__all__ = ["MetricsCsvCallback"]

FIRST_COLUMNS = ("epoch", "global_step", "train_loss", "val_loss", "lr")


class MetricsCsvCallback(TrainingCallback):
    """On ``on_epoch_end``: append the epoch's row to ``path`` and flush it. Priority 85: after the
    slot writers, before the checkpoint (95), so every epoch a checkpoint holds has its row; a resume
    keeps the rows up to its epoch. A new column rewrites the file atomically with the wider header.
    A float cell is its repr (what reads back the same, ``nan`` and ``inf`` included); an absent one is empty."""

    priority = 85
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    replay = ReplaySupport.DRY  # writes a file: a replay only records intent
    reads = (MAX_GRAD_NORM, OVERFIT_GAP_RATIO, LOSS_PREDICTION, EARLY_STOPPING_WAIT)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.columns: list[str] = []
        self.rows: list[dict[str, float | int]] = []
        self._fh: TextIO | None = None

    def on_train_begin(self, run: RunContext) -> None:
        self.columns, self.rows = [], []
        if run.dry_run:
            return
        if run.epoch > 0 and self.path.exists():
            with open(self.path, encoding="utf-8", newline="") as fh:
                for raw in csv.DictReader(fh):
                    row = {k: v for k, t in raw.items() if k is not None and t and (v := _number(t)) is not None}
                    if 0 < row.get("epoch", 0) <= run.epoch:
                        self._add_columns(row)
                        self.rows.append(row)
        self._rewrite()

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.run.dry_run:
            return
        # every metric and numeric slot (an int slot stays an int, a bool is 0 or 1), a structured one as its scalars
        ints = {k: int(v) for k, v in epoch.run.slot_values().items() if isinstance(v, int) and k not in epoch.metrics}
        row: dict[str, float | int] = {"epoch": epoch.number, "global_step": epoch.run.global_step,
                                       **epoch_scalars(epoch), **ints}
        self.rows.append(row)
        if self._add_columns(row) or self._fh is None:
            self._rewrite()
        else:
            csv.DictWriter(self._fh, self.columns, lineterminator="\n").writerow(row)
            self._fh.flush()

    def on_train_end(self, run: RunContext) -> None:
        self.close()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _add_columns(self, row: Mapping[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        if not new:
            return False
        known = set(self.columns) | set(new)
        first = [c for c in FIRST_COLUMNS if c in known]
        self.columns = first + [c for c in [*self.columns, *new] if c not in first]
        return True

    def _rewrite(self) -> None:
        """The whole file anew (header and every row kept so far), replacing the old one atomically."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            if self.columns:
                writer = csv.DictWriter(fh, self.columns, lineterminator="\n")
                writer.writeheader()
                writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - kept open for the run


def _number(text: str) -> float | int | None:
    """A cell as written: a whole number (epoch, a count slot) stays an int; no number is None."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None
