"""Shared helpers for the callback tests: a scripted driver (exact loss values through the real
engine and machine) and a tiny real torch training setup."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.core.driver import BaseDriver
from fsmtrain.core.engine import Engine
from fsmtrain.core.events import EventLog
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.result import TrainResult
from fsmtrain.core.runner import CallbackRunner


class ScriptedDriver(BaseDriver):
    """Feeds given per-epoch losses (and extra metrics) to the engine; one no-op batch per epoch."""

    def __init__(self, train: Sequence[float], val: Sequence[float] | None,
                 extra: Sequence[dict[str, float]] | None = None, lr: float = 0.1) -> None:
        self.train, self.val, self.extra, self.lr = list(train), val, extra, lr

    def current_lr(self) -> float | None:
        return self.lr

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        return iter([None])

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        return {"train_loss": self.train[epoch.index]}

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.val is not None:
            out["val_loss"] = self.val[epoch.index]
        if self.extra is not None:
            out.update(self.extra[epoch.index])
        return out



@dataclass
class Scripted:
    result: TrainResult
    run: RunContext
    events: list[dict[str, Any]]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def run_scripted(callbacks: Sequence[TrainingCallback], train: Sequence[float], val: Sequence[float] | None = None,
                 *, extra: Sequence[dict[str, float]] | None = None, max_epochs: int | None = None,
                 dry_run: bool = False) -> Scripted:
    epochs = len(train) if max_epochs is None else max_epochs
    log = EventLog(None, "scripted", keep=True, console=None)
    run = RunContext("scripted", epochs, log, dry_run=dry_run)
    runner = CallbackRunner(callbacks, include_global=False)
    result = Engine(ScriptedDriver(train, val, extra), runner, run).execute()
    assert log.records is not None
    return Scripted(result, run, log.records)


@pytest.fixture
def scripted() -> Callable[..., Scripted]:
    return run_scripted


def make_loaders(n: int = 64, batch: int = 16, features: int = 4, seed: int = 0,
                 shuffle: bool = False) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=batch, shuffle=shuffle), DataLoader(ds, batch_size=n)


def make_model(features: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@dataclass(frozen=True)
class Tiny:
    """Factories for small real torch setups (a fixture, so test modules import nothing from here)."""

    loaders: Callable[..., tuple[DataLoader[Any], DataLoader[Any]]] = make_loaders
    model: Callable[..., nn.Module] = make_model


@pytest.fixture
def tiny() -> Tiny:
    return Tiny()
