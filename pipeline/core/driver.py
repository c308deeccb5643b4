"""The driver contract: where the numbers come from (training and replay are drivers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from fsmtrain.core.context import EpochContext, RunContext, StepContext, ValStepContext

__all__ = ["BaseDriver", "Driver"]


class Driver(Protocol):
    """Where the numbers come from: each method is an :class:`~fsmtrain.core.lifecycle.Action`."""

    def current_lr(self) -> float | None: ...

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        """Prepare an epoch (e.g. ``model.train()``) and return its training batches."""

    def forward(self, step: StepContext) -> None: ...

    def backward(self, step: StepContext) -> None: ...

    def optimizer_step(self, step: StepContext) -> None: ...

    def zero_grad(self, step: StepContext) -> None: ...

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        """Metrics of the epoch's training part (at least ``train_loss``), read once per epoch."""

    def resume_train(self, epoch: EpochContext) -> None:
        """Back to training after a validation inside the epoch (e.g. ``model.train()``)."""

    def val_batches(self, epoch: EpochContext) -> Iterator[Any]:
        """The validation batches (none when there is no validation)."""

    def val_batch(self, step: ValStepContext) -> None:
        """Evaluate one validation batch: set ``step.output`` and ``step.loss``, accumulate."""

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        """Validation metrics (``val_loss`` and any others); empty when there is no validation."""

    def step_scheduler(self, epoch: EpochContext) -> None: ...

    def end_run(self, run: RunContext) -> None: ...


class BaseDriver:
    """No-op defaults for the driver actions a driver has nothing to do in (replay, tests)."""

    def current_lr(self) -> float | None: return None
    def forward(self, step: StepContext) -> None: ...
    def backward(self, step: StepContext) -> None: ...
    def optimizer_step(self, step: StepContext) -> None: ...
    def zero_grad(self, step: StepContext) -> None: ...
    def resume_train(self, epoch: EpochContext) -> None: ...
    def val_batches(self, epoch: EpochContext) -> Iterator[Any]: return iter(())
    def val_batch(self, step: ValStepContext) -> None: ...
    def end_validation(self, epoch: EpochContext) -> dict[str, float]: return {}
    def step_scheduler(self, epoch: EpochContext) -> None: ...
    def end_run(self, run: RunContext) -> None: ...
