"""Per-epoch (and ``log_every_n_steps``) scalars to TensorBoard (optional: ``pip install 'fsmtrain[tensorboard]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.scalars import epoch_scalars
from fsmtrain.core.slots import STEP_VALUES, StepValues

__all__ = ["TensorBoardLoggingCallback"]


class TensorBoardLoggingCallback(TrainingCallback):
    """On ``on_epoch_end``: ``epoch``, every metric and numeric slot as scalars at the global step, flushed
    at once; each ``step_values`` at its step. Priority 86: after the slot writers."""

    priority = 86
    tier = Tier.CORE
    rank_zero_only = True
    reads_every_slot = True
    reads = (STEP_VALUES,)
    replay = ReplaySupport.DRY  # writes files: a replay only records intent

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._step_sent: StepValues | None = None

    def on_train_begin(self, run: RunContext) -> None:
        if run.dry_run:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional extra
            raise RuntimeError("TensorBoardLoggingCallback needs the tensorboard package: "
                               "pip install 'fsmtrain[tensorboard]'") from exc
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def on_train_step_end(self, step: StepContext) -> None:
        values = step.get(STEP_VALUES)
        if values is not self._step_sent and values is not None and self._writer is not None:
            self._step_sent = values
            self._write(values.scalars(), values.step)  # flushed at the epoch's end (or after flush_secs)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if self._writer is not None:
            self._write({"epoch": epoch.number, **epoch_scalars(epoch)}, epoch.run.global_step)
            self._writer.flush()

    def _write(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)

    def on_train_end(self, run: RunContext) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
