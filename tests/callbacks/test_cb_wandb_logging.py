import io
import math
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from callbacks_wandb_history import wandb_history, wandb_summary
from torch import nn
from wandb.sdk.wandb_run import Run

from fsmtrain import Slot, StopReason, Trainer, TrainingCallback
from fsmtrain.callbacks import (
    EpochSummaryCallback,
    GradientMonitorCallback,
    LossPredictionCallback,
    NaNDetectionCallback,
    OverfitDetectionCallback,
    WandbLoggingCallback,
)
from fsmtrain.core.scalars import epoch_scalars


@pytest.fixture
def wandb_calls(monkeypatch):
    """Wrap the real ``Run.log`` / ``Run.finish``: record each call, then call through."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    calls: dict[str, list[Any]] = {"log": [], "finish": []}
    real_log, real_finish = Run.log, Run.finish

    def log(self, data, step=None, *args, **kwargs):
        calls["log"].append((dict(data), step))
        return real_log(self, data, step, *args, **kwargs)

    def finish(self, exit_code=None, *args, **kwargs):
        calls["finish"].append(exit_code)
        return real_finish(self, exit_code, *args, **kwargs)

    monkeypatch.setattr(Run, "log", log)
    monkeypatch.setattr(Run, "finish", finish)
    return calls


class Seen(TrainingCallback):
    """Test-only: what the trainer handed out each epoch, to compare with what W&B got."""

    priority = 79

    def __init__(self):
        self.epochs = []

    def on_epoch_end(self, epoch):
        self.epochs.append(epoch_scalars(epoch))


def test_one_log_per_epoch_with_the_values_the_trainer_saw(wandb_calls, tiny, tmp_path):
    train, val = tiny.loaders(n=32, batch=8)
    model = tiny.model()
    seen = Seen()
    callbacks = [GradientMonitorCallback(), LossPredictionCallback(max_epochs=12), OverfitDetectionCallback(),
                 WandbLoggingCallback(project="fsmtrain-test", tags=("t",)), seen]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val,
                      max_epochs=12, callbacks=callbacks, run_dir=tmp_path / "run", console_level="error",
                      default_callbacks=False)
    result = trainer.fit()
    logs = wandb_calls["log"]
    assert [step for _, step in logs] == [4 * e for e in range(1, 13)]  # the global step: 4 batches an epoch
    for epoch, (data, _) in enumerate(logs):
        assert {"train_loss", "val_loss", "lr", "max_grad_norm"} <= set(data)
        assert ("predicted_final_loss" in data) == (epoch >= 10)
        assert data == {"epoch": epoch + 1, **seen.epochs[epoch]}  # epochs counted from 1
        assert data["train_loss"] == result.history[epoch].metrics["train_loss"]
        assert data["val_loss"] == result.history[epoch].metrics["val_loss"]
        assert data["max_grad_norm"] == result.history[epoch].slots["max_grad_norm"]
    assert wandb_calls["finish"] == [0]
    offline = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert list(offline[0].glob("*.wandb"))  # the file `wandb sync` uploads


def test_a_run_ended_by_max_steps_says_steps_in_its_summary(wandb_calls, tiny, tmp_path):
    train, val = tiny.loaders(n=32, batch=8)
    model = tiny.model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val, max_steps=6,
                      callbacks=[WandbLoggingCallback(directory=tmp_path)], console_level="error",
                      default_callbacks=False)
    assert trainer.fit().stop_reason is StopReason.STEPS
    assert wandb_summary(tmp_path)["stop_reason"] == "steps"  # not "completed": W&B's own reader
    assert wandb_calls["finish"] == [0]


def test_nan_run_is_finished_as_failed(wandb_calls, tiny, tmp_path):
    train, _ = tiny.loaders(n=16, batch=8)
    bad = [(torch.full((2, 4), math.nan), torch.zeros(2, 1))]
    model = tiny.model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, bad,
                      max_epochs=5, callbacks=[NaNDetectionCallback(), WandbLoggingCallback(directory=tmp_path)],
                      console_level="error", default_callbacks=False)
    result = trainer.fit()
    assert result.stop_reason is StopReason.NAN
    assert len(wandb_calls["log"]) == 1
    assert wandb_calls["finish"] == [1]
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_error_run_is_finished_as_failed(wandb_calls, tiny, tmp_path):
    class Explode(TrainingCallback):
        def on_val_end(self, epoch):
            if epoch.index == 1:
                raise RuntimeError("boom")

    train, val = tiny.loaders(n=16, batch=8)
    model = tiny.model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val,
                      max_epochs=5, callbacks=[WandbLoggingCallback(directory=tmp_path), Explode()],
                      console_level="error", default_callbacks=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert len(wandb_calls["log"]) == 1
    assert wandb_calls["finish"] == [1]


def test_dry_run_sends_nothing(scripted, wandb_calls):
    cb = WandbLoggingCallback()
    scripted([cb], [1.0, 0.5], [1.0, 0.5], dry_run=True)
    assert wandb_calls["log"] == [] and wandb_calls["finish"] == []
    assert cb.logged == [{"epoch": 1, "lr": 0.1, "train_loss": 1.0, "val_loss": 1.0},
                         {"epoch": 2, "lr": 0.1, "train_loss": 0.5, "val_loss": 0.5}]


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode"):
        WandbLoggingCallback(mode="offlne")


# --- every metric and every numeric slot, read back from the offline run's own file ----------------

MY_METRIC = Slot[float]("my_metric")


class MyMetric(TrainingCallback):
    """A user's own slot: declared in ``writes``, written every epoch."""

    writes = (MY_METRIC,)

    def on_val_end(self, epoch):
        epoch.set(MY_METRIC, 100.0 + epoch.index)


def _accuracy(output, target):
    return ((output - target).abs() < 0.5).float().mean()


def test_a_user_slot_and_metric_reach_wandb_history_and_the_console_every_epoch(tiny, tmp_path, capsys):
    train, val = tiny.loaders(n=32, batch=8)
    model = tiny.model()
    console = io.StringIO()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val,
                      max_epochs=3, metrics={"val_accuracy": _accuracy},
                      callbacks=[GradientMonitorCallback(), MyMetric(), WandbLoggingCallback(),
                                 EpochSummaryCallback(stream=console)],
                      run_dir=tmp_path / "run", console_level="error", default_callbacks=False)
    result = trainer.fit()
    rows = wandb_history(tmp_path / "run")
    assert [(row["_step"], row["epoch"]) for row in rows] == [(4, 1), (8, 2), (12, 3)]  # global step, epoch
    for epoch, row in enumerate(rows):
        record = result.history[epoch]
        assert row["my_metric"] == 100.0 + epoch == record.slots["my_metric"]
        assert row["val_accuracy"] == pytest.approx(record.metrics["val_accuracy"])
        assert row["max_grad_norm"] == pytest.approx(record.slots["max_grad_norm"])
        assert row["train_loss"] == pytest.approx(record.metrics["train_loss"])
    lines = console.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("epoch "))
    assert header.split() == ["epoch", "train", "val", "lr", "grad", "val_accuracy", "my_metric"]
    body = [line.split() for line in lines if line[0].isdigit()]
    assert [cells[0] for cells in body] == ["1/3", "2/3", "3/3"]
    for epoch, cells in enumerate(body):
        assert cells[-2] == f"{result.history[epoch].metrics['val_accuracy']:.4g}"
        assert cells[-1] == f"{100 + epoch}"
    captured = capsys.readouterr()
    assert "wandb" not in (captured.out + captured.err).lower()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wandb_prints_nothing_to_the_console_of_a_real_run(tmp_path):
    # A fresh process without the suite's WANDB_SILENT: only the callback's settings keep W&B quiet.
    script = textwrap.dedent(f"""
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from fsmtrain.callbacks import WandbLoggingCallback
        from fsmtrain import Trainer
        torch.manual_seed(0)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        model = nn.Linear(4, 1)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), loader, loader,
                max_epochs=2, callbacks=[WandbLoggingCallback(directory={str(tmp_path)!r})],
                console_level="error", default_callbacks=False).fit()
        print("trained")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_MODE"] = "offline"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "trained\n"
    assert "wandb" not in proc.stderr.lower(), proc.stderr
    assert len(wandb_history(tmp_path)) == 2
