"""Callbacks the FSDP tests put into real ``torchrun`` workers (through ``callbacks.extra``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.hooks import TrainingCallback


class KillOnRank(TrainingCallback):
    """After batch ``batch`` of epoch index ``epoch`` on ``rank``: SIGKILL to its own process, the
    first time only (``marker`` remembers it)."""

    priority = 60

    def __init__(self, rank: int, epoch: int, batch: int, marker: str) -> None:
        self.rank, self.epoch, self.batch, self.marker = rank, epoch, batch, Path(marker)

    def on_train_step_end(self, step: StepContext) -> None:
        here = (int(step.run.extras.get("rank", 0)), step.epoch.index, step.batch_index)
        if here == (self.rank, self.epoch, self.batch) and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseInForwardOnRank(TrainingCallback):
    """Inside the model's forward of batch ``batch`` of epoch index ``epoch`` on ``rank`` only: a ValueError."""

    priority = 60

    def __init__(self, rank: int, epoch: int, batch: int) -> None:
        self.rank, self.epoch, self.batch = rank, epoch, batch
        self.calls = 0

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        model = epoch.run.model
        if int(epoch.run.extras.get("rank", 0)) == self.rank and epoch.index == self.epoch and model is not None:
            model.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any) -> None:
        self.calls += 1
        if self.calls == self.batch + 1 and torch.is_grad_enabled():
            raise ValueError(f"injected in forward on rank {self.rank}")
