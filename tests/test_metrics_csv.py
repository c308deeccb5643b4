"""``metrics.csv``: one row per epoch of a real run, flushed as it goes, read back by pandas with the
same numbers as the event log; new columns widen the file; a resume drops the rows it will redo."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from core_helpers import events_of, make_trainer

from fsmtrain import TrainingCallback
from fsmtrain.app.config import build_callbacks, load_config
from fsmtrain.callbacks import (
    EarlyStoppingCallback,
    GradientMonitorCallback,
    MetricsCsvCallback,
    OverfitDetectionCallback,
)
from fsmtrain.core.context import EpochContext, RunContext, Slot
from fsmtrain.core.events import EventLog

LATE: Slot[float] = Slot("late_user_value")


class LateSlot(TrainingCallback):
    """A user slot that first appears in epoch index 2: the CSV must grow a column then."""

    priority = 40
    writes = (LATE,)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.index >= 2:
            epoch.set(LATE, 10.0 + epoch.index)


class ReadsTheFile(TrainingCallback):
    """Runs after the CSV callback and reads the real file: the epoch's row is already on disk."""

    priority = 86

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[int] = []

    def on_epoch_end(self, epoch: EpochContext) -> None:
        with open(self.path, encoding="utf-8", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert rows[-1]["epoch"] == str(epoch.index + 1)
        self.seen.append(len(rows))


def _mae(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().mean()


def test_one_row_per_epoch_as_pandas_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    reader = ReadsTheFile(path)
    callbacks = [MetricsCsvCallback(path), GradientMonitorCallback(), EarlyStoppingCallback(patience=50),
                 OverfitDetectionCallback(warmup_epochs=0, window_size=1), LateSlot(), reader]
    make_trainer(tmp_path, callbacks, epochs=5, metrics={"val_mae": _mae}).fit()
    assert reader.seen == [1, 2, 3, 4, 5]  # written and flushed at each epoch end

    df = pd.read_csv(path)
    epochs = [e for e in events_of(tmp_path) if e["event"] == "epoch"]
    assert list(df["epoch"]) == [1, 2, 3, 4, 5]
    assert list(df.columns[:5]) == ["epoch", "global_step", "train_loss", "val_loss", "lr"]
    assert list(df["global_step"]) == [e["global_step"] for e in epochs]  # W&B's and TensorBoard's step
    assert {"val_mae", "max_grad_norm", "early_stopping_wait", "late_user_value"} <= set(df.columns)
    for (_, row), event in zip(df.iterrows(), epochs, strict=True):
        for key, value in event["payload"]["metrics"].items():
            assert row[key] == value, key  # the exact floats of the log, not rounded
        assert row["max_grad_norm"] == event["payload"]["slots"]["max_grad_norm"]
        assert row["early_stopping_wait"] == event["payload"]["slots"]["early_stopping_wait"]
    # The column that appeared in epoch 3: empty (NaN) before, filled after; one header, same widths.
    assert df["late_user_value"].isna().tolist() == [True, True, False, False, False]
    assert df["late_user_value"].iloc[2] == 12.0
    assert df["max_grad_norm"].dtype == float and df["epoch"].dtype.kind == "i"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 6 and {line.count(",") for line in lines} == {len(df.columns) - 1}
    assert not (tmp_path / "metrics.csv.tmp").exists()


def _run_context(epoch: int) -> RunContext:
    run = RunContext("r", 10, EventLog(None, "r", console=None, keep=True))
    run.epoch = epoch
    return run


def _epoch(run: RunContext, index: int, **metrics: float) -> EpochContext:
    ctx = EpochContext(run, index)
    ctx.metrics.update(metrics)
    return ctx


def test_non_finite_values_read_back(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    cb = MetricsCsvCallback(path)
    run = _run_context(0)
    cb.on_train_begin(run)
    cb.on_epoch_end(_epoch(run, 0, train_loss=math.nan, val_loss=math.inf, lr=-math.inf))
    cb.on_train_end(run)
    row = pd.read_csv(path).iloc[0]
    assert math.isnan(row["train_loss"]) and row["val_loss"] == math.inf and row["lr"] == -math.inf


def test_resume_keeps_the_rows_before_its_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    first = MetricsCsvCallback(path)
    run = _run_context(0)
    first.on_train_begin(run)
    for i in range(4):  # four epochs ran; the last checkpoint held two of them
        first.on_epoch_end(_epoch(run, i, train_loss=1.0 / (i + 1), val_loss=2.0 / (i + 1)))
    first.close()

    resumed = MetricsCsvCallback(path)
    run = _run_context(2)
    resumed.on_train_begin(run)
    assert list(pd.read_csv(path)["epoch"]) == [1, 2]
    resumed.on_epoch_end(_epoch(run, 2, train_loss=0.3, val_loss=0.6, val_acc=0.9))
    resumed.on_train_end(run)
    df = pd.read_csv(path)
    assert list(df["epoch"]) == [1, 2, 3]
    assert df["val_loss"].tolist() == [2.0, 1.0, 0.6]
    assert df["val_acc"].isna().tolist() == [True, True, False]

    fresh = MetricsCsvCallback(path)  # a run from epoch 0 starts the file anew
    fresh.on_train_begin(_run_context(0))
    fresh.close()
    assert path.read_text(encoding="utf-8") == ""


def test_replay_writes_nothing(tmp_path: Path) -> None:
    cb = MetricsCsvCallback(tmp_path / "m.csv")
    run = _run_context(0)
    run.dry_run = True
    cb.on_train_begin(run)
    cb.on_epoch_end(_epoch(run, 0, train_loss=1.0))
    assert not (tmp_path / "m.csv").exists()


@pytest.mark.parametrize("run_dir", [True, False])
def test_default_callbacks_write_it_with_a_run_dir(tmp_path: Path, run_dir: bool) -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    found: list[Any] = [cb for cb in build_callbacks(cfg, run_dir=tmp_path if run_dir else None)
                        if isinstance(cb, MetricsCsvCallback)]
    assert [cb.path for cb in found] == ([tmp_path / "metrics.csv"] if run_dir else [])


def test_a_resumed_file_reads_as_the_uninterrupted_one_cell_for_cell(tmp_path: Path) -> None:
    """After a resume, the rows kept from before are written as new rows are: whole-number slots as
    integers (early_stopping_wait 0, not 0.0)."""
    from fsmtrain.core.slots import EARLY_STOPPING_WAIT

    def run_epochs(path: Path, start: int, stop: int) -> None:
        cb = MetricsCsvCallback(path)
        run = _run_context(start)
        cb.on_train_begin(run)
        for i in range(start, stop):
            epoch = _epoch(run, i, train_loss=1.0 / (i + 1), val_loss=2.0)
            epoch.set(EARLY_STOPPING_WAIT, i)
            cb.on_epoch_end(epoch)
        cb.on_train_end(run)

    whole, cut = tmp_path / "whole.csv", tmp_path / "cut.csv"
    run_epochs(whole, 0, 4)
    run_epochs(cut, 0, 3)  # killed after epoch 3; its checkpoint held two epochs
    run_epochs(cut, 2, 4)
    assert cut.read_text(encoding="utf-8") == whole.read_text(encoding="utf-8")
    assert whole.read_text(encoding="utf-8").splitlines()[1].endswith(",0")
