"""The torch driver: the lifecycle program's driver actions (``forward``, ``backward``, …, ``val_batch``).
Losses are summed on the device and read once per epoch: outside fp16's overflow check, nothing in the
batch path syncs the host. Exact metrics (torchmetrics') are updated per batch and computed once per
validation; across unpadded rank shards the value is the whole val set's."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from fsmtrain.core.context import BUILTIN_METRICS, EpochContext, RunContext, StepContext, ValStepContext
from fsmtrain.core.slots import NONFINITE_ORIGIN
from fsmtrain.training.data_position import batches_from
from fsmtrain.training.optimizers import NamedSchedulers, check_manual_driver, is_manual, optimizers_of
from fsmtrain.training.precision import PrecisionPolicy
from fsmtrain.training.sharding import is_sharded, no_gradient_sync
from fsmtrain.training.step import StepFn, to_device, user_step

__all__ = ["LossFn", "MetricFn", "TorchDriver", "epoch_seed", "loader_generator", "split_batch"]


@runtime_checkable
class StatefulMetric(Protocol):
    def update(self, output: Any, target: Any) -> None: ...
    def compute(self) -> Any: ...
    def reset(self) -> None: ...


class ExactMetrics:
    """The run's stateful metrics, by name, on the run's device."""

    def __init__(self, metrics: Mapping[str, StatefulMetric], device: torch.device) -> None:
        self.metrics = {name: m.to(device) if isinstance(m, nn.Module) else m for name, m in metrics.items()}
        self.device = device

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def update(self, output: Any, target: Any) -> None:
        for metric in self.metrics.values():
            metric.update(output, target)

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"metric {name!r} ({type(metric).__name__}) computed {shown}, not one number; "
                                 "give it the settings that reduce it to one (average='micro' or 'macro')")
            out[name] = float(value.item())
        return out

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each metric's accumulated state (torchmetrics' ``metric_state``), for a checkpoint."""
        return {name: {k: v.detach().clone() if isinstance(v, torch.Tensor) else list(v)
                       for k, v in getattr(m, "metric_state", {}).items()} for name, m in self.metrics.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, values in state.items():
            for key, value in values.items():
                moved = [v.to(self.device) for v in value] if isinstance(value, list) else value.to(self.device)
                setattr(self.metrics[name], key, moved)


LossFn = Callable[[Any, Any], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | StatefulMetric
"""A validation metric: ``fn(output, target)`` gives the batch mean as a 0-d tensor, or an exact one
(a :class:`StatefulMetric`, e.g. torchmetrics')."""


def split_batch(batch: Any) -> tuple[Any, Any]:
    if type(batch) is tuple and len(batch) == 2:
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch:
        return batch["inputs"], batch["targets"]
    length = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise TypeError(f"a batch must be (inputs, targets) or a mapping with 'inputs' and 'targets'; "
                    f"got {type(batch).__name__}{length}")


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a hash of the run's data seed and the epoch index."""
    digest = hashlib.sha256(f"fsmtrain-data-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def loader_generator(loader: Any) -> torch.Generator | None:
    """A loader's own shuffle generator, if it has one (the driver reseeds it per epoch)."""
    for owner in (loader, getattr(loader, "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator):
            return gen
    return None


class TorchDriver:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None,
                 train_loader: Iterable[Any], val_loader: Iterable[Any] | None, *, scheduler: Any = None,
                 device: torch.device, metrics: Mapping[str, MetricFn] | None = None,
                 scheduler_monitor: str = "val_loss", train_model: nn.Module | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None, precision: PrecisionPolicy | None = None,
                 rank: int = 0, world_size: int = 1, step: StepFn | None = None,
                 val_step: StepFn | None = None) -> None:
        """``train_model``: ``model`` as the training forward runs it (e.g. in DDP); ``all_reduce``: sums a
        tensor over the ranks in place (once per epoch for train and validation); ``step``, ``val_step``: the
        user's own (:mod:`fsmtrain.training.step`), ``val_step`` defaulting to ``step``."""
        self.model = model
        self.precision = precision if precision is not None and precision.enabled else None
        fp16 = self.precision is not None and self.precision.scaler is not None
        self.sets_step_flags = fp16  # fp16 overflow skips a batch's optimizer step through the step context's flags
        self.train_model = model if train_model is None else train_model
        self.all_reduce = all_reduce
        self.rank, self.world_size = rank, world_size
        self._first_bad: torch.Tensor | None = None  # the first batch with a non-finite loss, on the device
        no_sync = getattr(self.train_model, "no_sync", None)
        self._no_sync: Callable[[], Any] | None = no_sync if callable(no_sync) else None
        if is_sharded(self.train_model):  # FSDP2: set_requires_gradient_sync in place of DDP's no_sync
            self._no_sync = partial(no_gradient_sync, self.train_model)
        self.optimizer = optimizer
        self.loss_fn = cast(LossFn, loss_fn)  # None only with a user step, which never calls _run
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.scheduler = scheduler
        self.device = device
        self.metrics = {k: cast(Callable[[Any, Any], torch.Tensor], m) for k, m in (metrics or {}).items()
                        if not isinstance(m, StatefulMetric)}
        self.exact = ExactMetrics({k: m for k, m in (metrics or {}).items() if isinstance(m, StatefulMetric)}, device)
        taken = sorted(BUILTIN_METRICS & set(metrics or {}))
        if taken:
            raise ValueError(f"metrics named {', '.join(taken)} would replace the values fsmtrain computes under those "
                             f"names; name them otherwise (reserved: {', '.join(sorted(BUILTIN_METRICS))})")
        self.scheduler_monitor = scheduler_monitor
        self._move = device.type != "cpu"
        self._loss_sum = torch.zeros((), device=device)
        self._seen = 0
        self._epoch_rng: torch.Tensor | None = None  # the global RNG as the epoch began (a loader without a generator)
        self._val_names = ["val_loss", *self.metrics]
        self._metered = bool(self.metrics or self.exact)  # metrics to feed: the step's output and target are needed
        self._val_sums = torch.zeros(0, device=device)
        self._val_seen = 0
        if step is None and loss_fn is None:
            raise ValueError("give a loss_fn, or a step that computes the loss itself")
        manual = is_manual(step)
        if manual:  # it steps its optimizers itself: the engine's backward, step and zero_grad are left out
            check_manual_driver(step, fp16, val_step is None and val_loader is not None)
            self.sets_step_flags, self.forward = True, self._manual_forward  # type: ignore[method-assign]
        if step is not None:  # on the instance, in place of the built-in step: its calls stay as they were
            self._train_run = user_step(step, device, self.precision, False,  # type: ignore[method-assign,assignment]
                                        optimizers_of(optimizer) if manual else None)
        val_step = step if val_step is None else val_step
        if val_step is not None:
            self._val_run = user_step(val_step, device, self.precision, bool(metrics))  # type: ignore[method-assign,assignment]
        self._user_val = val_step is not None
        if self._no_sync is None:  # nothing to wrap backward in: the action is the plain one
            self.backward = self._backward  # type: ignore[method-assign]

    def current_lr(self) -> float | None:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        self.train_model.train()
        set_epoch = getattr(getattr(self.train_loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch.index)
        gen, seed = loader_generator(self.train_loader), epoch.run.extras.get("data_seed")
        self._epoch_rng = torch.get_rng_state() if gen is None else None
        if gen is not None and seed is not None:
            # An epoch's order depends on the data seed and the epoch alone: a resumed run draws the same batches.
            gen.manual_seed(epoch_seed(int(seed), epoch.index))
        self._loss_sum = torch.zeros((), device=self.device)
        self._seen = 0
        if self.world_size > 1:
            self._first_bad = torch.full((), math.inf, device=self.device)
        resumed = epoch.resumed
        if resumed is None:
            return iter(self.train_loader)
        done = resumed.get("epoch_state") or {}  # a resume inside the epoch: its sums so far, its batches skipped
        if "loss_sum" in done:
            self._loss_sum, self._seen = done["loss_sum"].to(self.device), int(done["seen"])
        if self._first_bad is not None and "first_bad" in done:
            self._first_bad = done["first_bad"].to(self.device)
        self._epoch_rng = done.get("epoch_rng", self._epoch_rng)  # the epoch's, for the next checkpoint in it
        return batches_from(self.train_loader, int(resumed["batch"]), epoch, self._epoch_rng)

    def epoch_state(self) -> dict[str, Any]:
        """The epoch in progress, for a checkpoint at a step: its sums so far and its starting RNG."""
        state: dict[str, Any] = {"loss_sum": self._loss_sum.detach().clone(), "seen": self._seen}
        if self._first_bad is not None:
            state["first_bad"] = self._first_bad.detach().clone()
        if self._epoch_rng is not None:
            state["epoch_rng"] = self._epoch_rng
        return state

    def _run(self, model: nn.Module, batch: Any) -> tuple[Any, torch.Tensor, Any, int]:
        """``model`` on one batch: its output, loss, targets and row count."""
        inputs, targets = batch if type(batch) is tuple and len(batch) == 2 else split_batch(batch)
        if self._move:
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        if self.precision is None:
            output = model(inputs)
            loss = self.loss_fn(output, targets)
        else:
            with self.precision.autocast():
                output = model(inputs)
                loss = self.loss_fn(output, targets)
        n = targets.shape[0] if isinstance(targets, torch.Tensor) and targets.ndim else 1
        return output, loss, targets, n

    _train_run = _val_run = _run  # the built-in step; a user's step takes their place on the instance

    def forward(self, step: StepContext) -> None:
        step.output, step.loss, _, n = self._train_run(self.train_model, step.batch)
        self._loss_sum += step.loss.detach() * n
        self._seen += n
        if self._first_bad is not None:  # kept on the device: no synchronisation per batch
            here = torch.where(torch.isfinite(step.loss.detach()), math.inf, float(step.batch_index))
            self._first_bad = torch.minimum(self._first_bad, here)

    def _manual_forward(self, step: StepContext) -> None:
        step.skip_backward = step.skip_optimizer_step = step.skip_zero_grad = True
        TorchDriver.forward(self, step)

    def backward(self, step: StepContext) -> None:
        if self._no_sync is not None and step.skip_optimizer_step:
            with self._no_sync():  # accumulating: DDP averages the gradients once, on the stepping batch
                self._backward(step)
        else:
            self._backward(step)

    def _backward(self, step: StepContext) -> None:
        assert step.loss is not None
        if self.precision is None:
            step.loss.backward()  # type: ignore[no-untyped-call]
        elif not self.precision.backward(step.loss, self.optimizer, stepping=not step.skip_optimizer_step):
            step.skip_optimizer_step = True  # fp16 overflow: this batch's step (and its hooks) is left out

    def optimizer_step(self, step: StepContext) -> None:
        if self.precision is not None:
            self.precision.step(self.optimizer)
        else:
            self.optimizer.step()

    def zero_grad(self, step: StepContext) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _global(self, sums: torch.Tensor, count: int) -> tuple[torch.Tensor, float]:
        """Sums and count over every rank (this rank's alone in a one-process run)."""
        if self.all_reduce is None:
            return sums, float(count)
        both = torch.cat([sums.reshape(-1).double(), torch.tensor([float(count)], dtype=torch.float64,
                                                                   device=sums.device)])
        self.all_reduce(both)
        return both[:-1], float(both[-1].item())

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        if self._first_bad is None and self.all_reduce is None:  # one process: the sum as it is, one read
            seen = float(self._seen)
            return {"train_loss": float((self._loss_sum / seen).item())} if seen else {}
        sums = self._loss_sum.reshape(1)
        if self._first_bad is not None:  # each rank's first non-finite batch, in its own slot
            slots = torch.zeros(self.world_size, device=self.device)
            slots[self.rank] = self._first_bad
            sums = torch.cat([sums.float(), slots])
        both, seen = self._global(sums, self._seen)
        total, firsts = both[0], both[1:].tolist()
        if firsts and min(firsts) < math.inf:
            batch, rank = min((int(b), r) for r, b in enumerate(firsts) if b < math.inf)
            epoch.run.set(NONFINITE_ORIGIN, [rank, batch])
        return {"train_loss": float((total / seen).item())} if seen else {}

    def resume_train(self, epoch: EpochContext) -> None:
        self.train_model.train()

    def val_batches(self, epoch: EpochContext) -> Iterator[Any]:
        if self.val_loader is None:
            return iter(())
        self.model.eval()
        self.exact.reset()
        self._val_sums = torch.zeros(len(self._val_names), device=self.device)
        self._val_seen = 0
        return self._inference(self.val_loader, is_sharded(self.train_model))

    @staticmethod
    def _inference(loader: Iterable[Any], sharded: bool) -> Iterator[Any]:
        # Thread-local: it holds over each batch's hooks between the yields, and ends when the loop does. FSDP2:
        # no_grad, since a first forward in inference mode (a resume at an epoch's last batch) makes its buffers
        # inference tensors, which the next training step cannot update.
        with torch.no_grad() if sharded else torch.inference_mode():
            yield from loader

    def val_batch(self, step: ValStepContext) -> None:
        output, loss, targets, n = self._val_run(self.model, step.batch)
        step.output, step.loss = output, loss
        if self._metered:  # one fused add for all values; without metrics, the loss alone
            output = output["output"] if self._user_val else output
            values = [loss, *(fn(output, targets) for fn in self.metrics.values())]
            self._val_sums += torch.stack([v.reshape(()).float() for v in values]) * n
            self.exact.update(output, targets)
        else:
            self._val_sums += loss * n
        self._val_seen += n

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        total, seen = self._global(self._val_sums, self._val_seen)
        if seen == 0:
            return {}
        return {**dict(zip(self._val_names, (total / seen).tolist(), strict=True)), **self.exact.compute()}

    def step_scheduler(self, epoch: EpochContext) -> None:
        value = epoch.metrics.get(self.scheduler_monitor)
        if isinstance(self.scheduler, NamedSchedulers):
            self.scheduler.step(value)
        elif isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if value is not None:
                self.scheduler.step(value)
        elif self.scheduler is not None:
            self.scheduler.step()

    def end_run(self, run: RunContext) -> None:
        return None
