"""The torch driver the engine calls for training batches and validation.

Per batch it runs ``pipeline.training.batch.BatchBody`` (the hook order around forward, backward, the
optimizer step and zero_grad) with torch actions, or a lean body when no callback has step hooks.
Losses are summed on the device and read once per epoch; nothing in the batch path syncs the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pipeline.core.context import EpochContext, RunContext, StepContext
from pipeline.core.runner import CallbackRunner
from pipeline.training.batch import BatchBody, StepActions

__all__ = ["LossFn", "MetricFn", "TorchDriver", "split_batch"]

LossFn = Callable[[Any, Any], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A validation metric: ``fn(output, target)`` gives the batch mean as a 0-d tensor."""

def split_batch(batch: Any) -> tuple[Any, Any]:
    if type(batch) is tuple and len(batch) == 2:
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch:
        return batch["inputs"], batch["targets"]
    raise TypeError(
        "a batch must be (inputs, targets) or a mapping with 'inputs' and 'targets'; "
        f"got {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _count(targets: Any) -> int:
    return targets.shape[0] if isinstance(targets, torch.Tensor) and targets.ndim else 1


class TorchDriver:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None,
        *,
        scheduler: Any = None,
        device: torch.device,
        metrics: Mapping[str, MetricFn] | None = None,
        scheduler_monitor: str = "val_loss",
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.scheduler = scheduler
        self.device = device
        self.metrics = dict(metrics or {})
        self.scheduler_monitor = scheduler_monitor
        self._move = device.type != "cpu"
        self._loss_sum = torch.zeros((), device=device)
        self._seen = 0

    def attach(self, runner: CallbackRunner) -> None:
        body = BatchBody(runner, StepActions(self._forward, self._backward, self._optimizer_step, self._zero_grad))
        # With no step hooks nothing can set a skip flag: the lean body skips the dispatch checks.
        self.train_batch = body if body.hooked else self._lean_batch  # type: ignore[method-assign]

    def current_lr(self) -> float | None:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None

    def _to_device(self, value: Any) -> Any:
        if not self._move:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        if isinstance(value, Mapping):
            return {k: self._to_device(v) for k, v in value.items()}
        return value

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        self.model.train()
        set_epoch = getattr(getattr(self.train_loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch.index)
        self._loss_sum = torch.zeros((), device=self.device)
        self._seen = 0
        return iter(self.train_loader)

    def train_batch(self, step: StepContext) -> None:
        raise RuntimeError("TorchDriver.attach(runner) must be called before training")

    def _forward(self, step: StepContext) -> None:
        inputs, targets = split_batch(step.batch)
        if self._move:
            inputs, targets = self._to_device(inputs), self._to_device(targets)
        output = self.model(inputs)
        loss = self.loss_fn(output, targets)
        step.output = output
        step.loss = loss
        n = _count(targets)
        self._loss_sum += loss.detach() * n
        self._seen += n

    def _backward(self, step: StepContext) -> None:
        assert step.loss is not None
        step.loss.backward()  # type: ignore[no-untyped-call]

    def _optimizer_step(self, step: StepContext) -> None:
        self.optimizer.step()

    def _zero_grad(self, step: StepContext) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _lean_batch(self, step: StepContext) -> None:
        self._forward(step)
        assert step.loss is not None
        step.loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        if self._seen == 0:
            return {}
        return {"train_loss": float((self._loss_sum / self._seen).item())}

    def validate(self, epoch: EpochContext) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        self.model.eval()
        names = ["val_loss", *self.metrics]
        sums = torch.zeros(len(names), device=self.device)
        seen = 0
        metric_fns = list(self.metrics.values())
        with torch.inference_mode():
            for batch in self.val_loader:
                inputs, targets = split_batch(batch)
                if self._move:
                    inputs, targets = self._to_device(inputs), self._to_device(targets)
                output = self.model(inputs)
                n = _count(targets)
                loss = self.loss_fn(output, targets)
                if metric_fns:  # one fused add for all values; without metrics, the loss alone
                    values = [loss, *(fn(output, targets) for fn in metric_fns)]
                    sums += torch.stack([v.reshape(()).float() for v in values]) * n
                else:
                    sums += loss * n
                seen += n
        if seen == 0:
            return {}
        return dict(zip(names, (sums / seen).tolist(), strict=True))

    def step_scheduler(self, epoch: EpochContext) -> None:
        if self.scheduler is None:
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            value = epoch.metrics.get(self.scheduler_monitor)
            if value is not None:
                self.scheduler.step(value)
        else:
            self.scheduler.step()

    def end_run(self, run: RunContext) -> None:
        return None
