"""``metrics.csv``: one row per epoch, for pandas, spreadsheets and plotting scripts."""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.scalars import slot_scalars
from fsmtrain.core.slots import EARLY_STOPPING_WAIT, LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO

__all__ = ["FIRST_COLUMNS", "MetricsCsvCallback", "epoch_row"]

FIRST_COLUMNS = ("epoch", "train_loss", "val_loss", "lr")


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def _flat_slots(slots: Mapping[str, Any]) -> dict[str, float | int]:
    """Numeric slot values under the slot's name (an int stays an int); a structured value gives the
    columns W&B, TensorBoard and the console show for it, by the same names (``fsmtrain.core.scalars``:
    the loss prediction is ``predicted_final_loss``, a dataclass ``<slot>/<field>``). Anything else
    (strings, lists, ``None``) is left out."""
    out: dict[str, float | int] = {}
    for name, value in slots.items():
        number = _number(value)
        if number is not None:
            out[name] = number
        else:
            out.update(slot_scalars(name, value))
    return out


def epoch_row(epoch: EpochContext) -> dict[str, float | int]:
    """The row of one epoch: ``epoch`` (1-based, as the console counts), every epoch metric, and
    every numeric slot value present."""
    row: dict[str, float | int] = {"epoch": epoch.index + 1}
    row.update({k: float(v) for k, v in epoch.metrics.items()})
    for key, value in _flat_slots(epoch.run.slot_values()).items():
        row.setdefault(key, value)
    return row


def _cell(value: float | int | None) -> str:
    if value is None:
        return ""  # pandas reads an empty cell as NaN
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back to the same float
    return str(value)


class MetricsCsvCallback(TrainingCallback):
    """On ``on_epoch_end``: append the epoch's row to ``path`` and flush it, so the file is current
    while the run goes on and complete up to the last finished epoch if the process dies.

    Priority 85: after every built-in writer of an ``on_epoch_end`` slot (the gradient monitor at 12,
    the overfit detector at 75; the loss prediction and the early-stopping counter are written at
    ``on_val_end``, earlier still), so a row holds the epoch's final values; and before the checkpoint
    (95), so every epoch a checkpoint holds already has its row. A resume keeps the rows up to the
    epoch it starts from and drops the later ones (epochs that ran after the last checkpoint and
    will run again).

    Columns: ``epoch``, ``train_loss``, ``val_loss``, ``lr``, then other metrics and slot values in
    the order they first appear. When a later epoch brings a new column (a slot such as
    ``overfit_gap_ratio`` that is set only in some epochs), the file is rewritten once with the wider
    header (atomically: temp file, rename); earlier rows get empty cells there. So the file always
    has one header and rows of the same width, which ``pandas.read_csv`` and spreadsheets read as is.
    """

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

    # --- run --------------------------------------------------------------------------------
    def on_train_begin(self, run: RunContext) -> None:
        self.columns, self.rows = [], []
        if run.dry_run:
            return
        if run.epoch > 0 and self.path.exists():
            # A resume: keep the rows of the epochs before the one it starts from.
            for row in self._read(self.path):
                if 0 < row.get("epoch", 0) <= run.epoch:
                    self._add_columns(row)
                    self.rows.append(row)
        self._rewrite()

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.run.dry_run:
            return
        row = epoch_row(epoch)
        self.rows.append(row)
        if self._add_columns(row) or self._fh is None:
            self._rewrite()
            return
        self._write_rows([row])

    def on_train_end(self, run: RunContext) -> None:
        self.close()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # --- file -------------------------------------------------------------------------------
    def _add_columns(self, row: Mapping[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        if not new:
            return False
        known = set(self.columns) | set(new)
        first = [c for c in FIRST_COLUMNS if c in known]
        self.columns = first + [c for c in [*self.columns, *new] if c not in first]
        return True

    def _text(self, rows: list[dict[str, float | int]], *, header: bool = False) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if header:
            writer.writerow(self.columns)
        for row in rows:
            writer.writerow([_cell(row.get(c)) for c in self.columns])
        return buf.getvalue()

    def _write_rows(self, rows: list[dict[str, float | int]]) -> None:
        assert self._fh is not None
        self._fh.write(self._text(rows))
        self._fh.flush()

    def _rewrite(self) -> None:
        """The whole file anew (header and every row kept so far), replacing the old one atomically."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(self._text(self.rows, header=bool(self.columns)))
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - kept open for the run

    @staticmethod
    def _read(path: Path) -> list[dict[str, float | int]]:
        rows: list[dict[str, float | int]] = []
        with open(path, encoding="utf-8", newline="") as fh:
            for raw in csv.DictReader(fh):
                row: dict[str, float | int] = {}
                for key, text in raw.items():
                    if key is None or text in (None, ""):
                        continue
                    try:  # a whole-number cell (epoch, a count slot) stays an int, as _cell wrote it
                        row[key] = int(text)
                    except ValueError:
                        try:
                            row[key] = float(text)
                        except ValueError:
                            continue
                rows.append(row)
        return rows
