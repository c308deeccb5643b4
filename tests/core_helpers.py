"""Small real training set-ups shared by the core tests (imported, not a fixture file, so other
test modules and conftest.py stay free to grow)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.context import EpochContext, FaultContext, RunContext, StepContext
from fsmtrain.core.events import read_events


class DiskKeepsUp(TrainingCallback):
    """Setup: each epoch ends (before its checkpoint, priority 94) once the previous write is done, as
    on a disk that keeps up with the epochs. These epochs take milliseconds, less than an fsync: without
    this the writer leaves waiting states out, by design (tests/callbacks/test_cb_checkpoint_writer.py)."""

    priority = 94

    def __init__(self, checkpoint: CheckpointCallback) -> None:
        self.checkpoint = checkpoint

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self.checkpoint.manager.writer.wait_idle()


def tiny_task(seed: int = 0, n: int = 96, batch: int = 16) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :2].sum(dim=1, keepdim=True) + 0.05 * torch.randn(n, 1, generator=g)
    train = DataLoader(TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), batch_size=batch, shuffle=True,
                       generator=torch.Generator().manual_seed(seed))
    val = DataLoader(TensorDataset(x[n * 3 // 4 :], y[n * 3 // 4 :]), batch_size=batch)
    return train, val


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_trainer(
    tmp: Path | None,
    callbacks: Sequence[TrainingCallback] = (),
    *,
    epochs: int = 3,
    seed: int = 0,
    model: nn.Module | None = None,
    **kw: Any,
) -> Trainer:
    torch.set_num_threads(1)
    model = model if model is not None else tiny_model(seed)
    train, val = tiny_task(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=callbacks,
                   run_dir=tmp, console_level="error", **kw, default_callbacks=False)


def events_of(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir / "events.jsonl")


def phases_visited(events: list[dict[str, Any]]) -> list[str]:
    moves = [e for e in events if e["event"] == "transition"]
    return [moves[0]["from"]] + [m["to"] for m in moves if m["from"] != m["to"]]


class Recorder(TrainingCallback):
    """Records every hook call in order (the hooks a callback sees, as it sees them)."""

    def __init__(self, priority: int = 50) -> None:
        self.priority = priority
        self.calls: list[str] = []

    def _rec(self, name: str) -> None:
        self.calls.append(name)

    def on_train_begin(self, run: RunContext) -> None: self._rec("on_train_begin")
    def on_train_epoch_begin(self, epoch: EpochContext) -> None: self._rec("on_train_epoch_begin")
    def on_batch_begin(self, step: StepContext) -> None: self._rec("on_batch_begin")
    def on_train_step_end(self, step: StepContext) -> None: self._rec("on_train_step_end")
    def on_val_begin(self, epoch: EpochContext) -> None: self._rec("on_val_begin")
    def on_val_end(self, epoch: EpochContext) -> None: self._rec("on_val_end")
    def on_epoch_end(self, epoch: EpochContext) -> None: self._rec("on_epoch_end")
    def on_exception(self, fault: FaultContext) -> None: self._rec("on_exception")
    def on_train_end(self, run: RunContext) -> None: self._rec("on_train_end")
