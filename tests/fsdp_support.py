"""Callbacks the FSDP tests put into real ``torchrun`` workers (through ``callbacks.extra``)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


SEEN: dict[str, Any] = {"poison": False, "dtypes": set()}


def probe_step(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """A user's own step: records the forward's dtype; its loss is NaN while ``SEEN["poison"]`` is set."""
    x, y = batch
    pred = model(x)
    SEEN["dtypes"].add(str(pred.dtype))
    loss = nn.functional.mse_loss(pred.float(), y)
    return {"loss": loss * math.nan if SEEN["poison"] else loss, "output": pred.float(), "target": y}


class ModesAdam(torch.optim.Adam):
    """An optimizer with train/eval modes (as ScheduleFree's): records each switch and its parameters' kinds."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.modes: list[str] = []
        self.kinds: set[str] = set()

    def _mode(self, mode: str) -> None:
        self.modes.append(mode)
        self.kinds |= {type(p).__name__ for g in self.param_groups for p in g["params"]}

    def train(self) -> None:
        self._mode("train")

    def eval(self) -> None:
        self._mode("eval")


def _full_norm(model: nn.Module) -> float:
    """The gradients' L2 norm from the whole gradients (each DTensor gathered: a collective)."""
    grads = [g.full_tensor() if isinstance(g := p.grad, DTensor) else g for p in model.parameters()
             if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


class ShardedProbe(TrainingCallback):
    """Each step's whole-gradient norm before clipping (priority 15: after the monitor, before clipping) and
    after it, the forward's dtypes, the optimizer's modes and its parameters' kinds, into ``probe-rank<r>.json``;
    on ``rank`` from epoch index ``poison_epoch`` on, the user's step makes the loss NaN."""

    priority = 15

    def __init__(self, rank: int, poison_epoch: int) -> None:
        self.rank, self.poison_epoch = rank, poison_epoch
        self.norms: list[list[float]] = []

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        SEEN["poison"] = int(epoch.run.extras.get("rank", 0)) == self.rank and epoch.index >= self.poison_epoch

    def on_after_backward(self, step: StepContext) -> None:
        assert step.run.model is not None
        if not step.skip_optimizer_step:  # a window's last batch: its accumulated gradients, reduced
            self.norms.append([step.epoch.index, _full_norm(step.run.model)])

    def on_before_optimizer_step(self, step: StepContext) -> None:
        assert step.run.model is not None
        self.norms[-1].append(_full_norm(step.run.model))

    def on_epoch_end(self, epoch: EpochContext) -> None:
        run, opt = epoch.run, epoch.run.optimizer
        out = {"norms": self.norms, "dtypes": sorted(SEEN["dtypes"]), "modes": getattr(opt, "modes", None),
               "kinds": sorted(getattr(opt, "kinds", ()))}
        Path(str(run.run_dir), f"probe-rank{run.extras.get('rank', 0)}.json").write_text(json.dumps(out))
