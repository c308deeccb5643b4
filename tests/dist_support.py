"""Callbacks the multi-process tests put into real ``torchrun`` workers (through ``callbacks.extra``).

Each acts on one rank only, to show that a decision taken on one rank moves every rank.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.stop import StopReason
from fsmtrain.training.data import Loaders


def _rank(run: RunContext) -> int:
    return int(run.extras.get("rank", 0))


class StopOnRank(TrainingCallback):
    """At the end of epoch index ``epoch`` on ``rank``: request ``reason`` (only there)."""

    priority = 60

    def __init__(self, rank: int, epoch: int, reason: str = "nan") -> None:
        self.rank, self.epoch, self.reason = rank, epoch, StopReason(reason)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if _rank(epoch.run) == self.rank and epoch.index == self.epoch:
            epoch.request_stop(self.reason, self.name, f"injected on rank {self.rank}")


class NaNLossOnRank(TrainingCallback):
    """From epoch index ``epoch`` on: rank ``rank``'s reported training loss is NaN (its own
    metric only, before the NaN detector looks), so only that rank's NaN detector fires."""

    priority = 4

    def __init__(self, rank: int, epoch: int) -> None:
        self.rank, self.epoch = rank, epoch

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if _rank(epoch.run) == self.rank and epoch.index >= self.epoch:
            epoch.metrics["train_loss"] = math.nan


class ImmediateStopOnRank(TrainingCallback):
    """An immediate stop requested inside batch ``batch`` of epoch index ``epoch`` on ``rank``."""

    priority = 60
    may_stop_immediately = True

    def __init__(self, rank: int, epoch: int, batch: int) -> None:
        self.rank, self.epoch, self.batch = rank, epoch, batch

    def on_train_step_end(self, step: StepContext) -> None:
        if _rank(step.run) == self.rank and step.epoch.index == self.epoch and step.batch_index == self.batch:
            step.run.request_stop(StopReason.EARLY_STOP, self.name, "immediate, on one rank", immediate=True)


class SaveFinalWeights(TrainingCallback):
    """At ``on_train_end`` every rank saves its model's weights to ``<folder>/weights-rank<r>.pt``
    (outside the run directory, for the test to compare the ranks)."""

    priority = 99

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, run: RunContext) -> None:
        assert run.model is not None
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        torch.save(run.model.state_dict(), Path(self.folder) / f"weights-rank{_rank(run)}.pt")


class SlowEpochs(TrainingCallback):
    """Each epoch end sleeps ``seconds`` and writes ``<epoch index> <pid>`` to ``<marker>-rank<r>``,
    so a test can send a signal or a kill to a chosen rank at a chosen epoch."""

    priority = 97

    def __init__(self, seconds: float, marker: str = "") -> None:
        self.seconds, self.marker = seconds, marker

    def on_epoch_end(self, epoch: EpochContext) -> None:
        time.sleep(self.seconds)
        if self.marker:
            mark = f"{self.marker}-rank{_rank(epoch.run)}"
            with open(f"{mark}.tmp", "w") as fh:
                fh.write(f"{epoch.index} {os.getpid()}")
            os.replace(f"{mark}.tmp", mark)


class NaNWeightsOnRank(TrainingCallback):
    """At the start of epoch index ``epoch``, rank ``rank``'s weights become NaN (only there): its
    loss is NaN, and through DDP's gradient average and the summed metrics, every rank's is."""

    priority = 60

    def __init__(self, rank: int, epoch: int) -> None:
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        model = epoch.run.model
        if _rank(epoch.run) == self.rank and epoch.index == self.epoch and model is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(math.nan)


class RaiseOnRank(TrainingCallback):
    """Raises ``ValueError`` after batch ``batch`` of epoch index ``epoch`` on rank ``rank`` only,
    while the other ranks go on into the next batch's gradient all-reduce."""

    priority = 60

    def __init__(self, rank: int, epoch: int, batch: int = 1) -> None:
        self.rank, self.epoch, self.batch = rank, epoch, batch

    def on_train_step_end(self, step: StepContext) -> None:
        if _rank(step.run) == self.rank and step.epoch.index == self.epoch and step.batch_index == self.batch:
            raise ValueError(f"injected on rank {self.rank} at epoch {self.epoch}, batch {self.batch}")


class ExitOnceOnRank(TrainingCallback):
    """At the start of epoch index ``epoch`` on rank ``rank``: the process exits at once
    (``os._exit(1)``: no teardown, as a crash), the first time only (``marker`` remembers it)."""

    priority = 60

    def __init__(self, rank: int, epoch: int, marker: str) -> None:
        self.rank, self.epoch, self.marker = rank, epoch, Path(marker)

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if _rank(epoch.run) == self.rank and epoch.index == self.epoch and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)


class RecordBatches(TrainingCallback):
    """Appends ``<epoch index> <sha256 of the batch's inputs>`` for every training batch to
    ``<folder>/batches-rank<r>.txt``: the data order each rank saw."""

    priority = 61

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_batch_begin(self, step: StepContext) -> None:
        inputs = step.batch[0]
        digest = hashlib.sha256(inputs.numpy().tobytes()).hexdigest()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"batches-rank{_rank(step.run)}.txt", "a") as fh:
            fh.write(f"{step.epoch.index} {digest}\n")


class PrintEachEpoch(TrainingCallback):
    """A user callback that prints, as users' callbacks do, at every epoch end."""

    priority = 62

    def on_epoch_end(self, epoch: EpochContext) -> None:
        print(f"epoch {epoch.index} ended, said a callback")


class KillAfterCommit(TrainingCallback):
    """At the end of epoch index ``epoch``, on every rank: wait until rank 0's log has committed
    that epoch's checkpoint (the writer may be a background thread), then ``SIGKILL`` this process,
    before its ``epoch`` line: the window between a commit and the epoch event."""

    priority = 99  # after CheckpointCallback (95), before the engine's epoch event

    def __init__(self, epoch: int, limit: float = 60.0) -> None:
        self.epoch, self.limit = epoch, limit

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.index != self.epoch:
            return
        log = Path(epoch.run.run_dir) / "events.jsonl"
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            records = [json.loads(ln) for ln in log.read_text(encoding="utf-8").splitlines() if ln.endswith("}")]
            if any(r["event"] == "checkpoint" and r["payload"]["epoch"] == self.epoch for r in records):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
        raise AssertionError(f"rank 0 never committed the checkpoint of epoch index {self.epoch}")


def weighted_regression(*, batch_size: int, seed: int, n_samples: int = 256, **_: object) -> Loaders:
    """A loader with a user's ``WeightedRandomSampler`` that never draws the odd rows, whose
    targets are NaN: a rank that trains on any row its sampler would not draw reports a NaN loss.
    Each row's first feature is its index, for a test that reads which rows a rank saw."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, 8, generator=g)
    x[:, 0] = torch.arange(n_samples, dtype=torch.float32)
    y = x[:, 1:2].clone()
    y[1::2] = math.nan
    weights = [1.0 if i % 2 == 0 else 0.0 for i in range(n_samples)]
    sampler = WeightedRandomSampler(weights, num_samples=n_samples // 2, replacement=True)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, sampler=sampler)
    val = DataLoader(TensorDataset(x[::2], y[::2]), batch_size=batch_size)
    return Loaders(train, val)


class RecordRows(TrainingCallback):
    """Appends ``<epoch index> <row>`` for every training row (its first feature, as
    :func:`weighted_regression` builds it) to ``<folder>/rows-rank<r>.txt``."""

    priority = 61

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_batch_begin(self, step: StepContext) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rows-rank{_rank(step.run)}.txt", "a") as fh:
            fh.writelines(f"{step.epoch.index} {int(row)}\n" for row in step.batch[0][:, 0].tolist())
