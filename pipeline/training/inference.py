"""A model over data in dataset order (``predict``, ``evaluate``): the run's validation step on every batch,
or the forward alone on inputs without targets (predict only); outputs kept row by row, gathered across ranks."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from fsmtrain.core.context import EpochContext, RunContext, ValStepContext
from fsmtrain.training.distributed import TorchCollective, shard_val_loader
from fsmtrain.training.driver import TorchDriver
from fsmtrain.training.step import to_device

__all__ = ["Inference", "InferenceError", "inputs_only", "run_over"]


class InferenceError(ValueError):
    """Data or outputs that cannot be run over or kept row by row (one line, exit 2)."""


class Inference(NamedTuple):
    outputs: Any  # a tensor (or a tuple, list or mapping of them) with one row per example; None if not kept
    metrics: dict[str, float]  # val_loss and the metrics, over every example on every rank


def _tree(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return {k: _tree(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_tree(fn, v) for v in x] if isinstance(x, list) else tuple(_tree(fn, v) for v in x)
    raise InferenceError(f"a prediction is a tensor or a tuple, list or mapping of tensors; the step's output holds a "
                    f"{type(x).__name__}")


def _rows(x: Any) -> int:
    counts: set[int] = set()
    _tree(lambda t: counts.add(t.shape[0] if t.ndim else -1), x)
    if len(counts) != 1 or -1 in counts:
        raise InferenceError(f"the step's output has no one row per example (first dimensions {sorted(counts)}): "
                         "predictions are kept row by row")
    return counts.pop()


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {k: _cat([p[k] for p in parts]) for k in first}
    joined = [_cat(list(column)) for column in zip(*parts, strict=True)]
    return joined if isinstance(first, list) else tuple(joined)


def inputs_only(batch: Any) -> Any:
    """A batch's inputs when it holds no targets (a tensor, a one-item tuple or list, a mapping without
    ``targets``); else None."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        return batch[0]
    if isinstance(batch, Mapping) and "inputs" in batch and "targets" not in batch:
        return batch["inputs"]
    return None


def run_over(driver: TorchDriver, run: RunContext, collective: TorchCollective | None,
             data: Iterable[Any] | None = None, *, keep: bool = True) -> Inference:
    """``data`` (default: the val loader) through the validation step; a DataLoader in dataset order (rank
    ``r`` of ``w`` takes examples ``r, r+w, ...``), any other iterable as it iterates, on one rank."""
    rank, world = (0, 1) if collective is None else (collective.rank, collective.world_size)
    ours = copy.copy(driver)  # its forward, loss, metrics, device and precision; the loader is ours
    if driver.val_loader is None and data is None:
        raise InferenceError("there is no data to run over: the data builder gave no val loader; name a builder "
                         "whose val loader has the examples")
    if data is not None or collective is None:  # the driver's own loader is this rank's share already
        loader = driver.val_loader if data is None else data
        if world > 1 or (isinstance(loader, DataLoader) and loader.batch_size is not None):
            loader = shard_val_loader(loader, rank, world)
        ours.val_loader = loader
    epoch = EpochContext(run, run.epoch)
    step, parts, rows = ValStepContext(run, epoch), [], 0
    for index, batch in enumerate(ours.val_batches(epoch)):
        step.reset(index, batch)
        inputs = None if ours._user_val else inputs_only(batch)
        if inputs is not None:  # no targets: the model's forward alone, which predict keeps
            if not keep:
                raise InferenceError(f"val batch {index} of the data holds inputs alone ({type(batch).__name__}): "
                                     "evaluate compares outputs with targets, so its batches must be (inputs, "
                                     "targets) or a mapping with 'inputs' and 'targets'; predict takes inputs alone")
            with ours.precision.autocast() if ours.precision is not None else contextlib.nullcontext():
                step.output = ours.model(to_device(inputs, ours.device))
        else:
            try:
                ours.val_batch(step)
            except TypeError as exc:  # a batch the step cannot take (README: the batch contract)
                raise InferenceError(f"val batch {index} of the data: {exc}") from exc
        if keep:
            parts.append(_tree(lambda t: t.detach().cpu(), step.output))
            rows += _rows(parts[-1])
    metrics = ours.end_validation(epoch)
    mine = (_cat(parts) if parts else None, rows)
    if collective is None or not keep:
        return Inference(mine[0], metrics)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    counts = [n for _, n in every]
    total = sum(counts)
    if counts != [len(range(r, total, world)) for r in range(world)]:
        raise InferenceError(f"the ranks' predictions ({counts} rows) are not one row per example")
    if not total:
        return Inference(None, metrics)
    where = torch.argsort(torch.cat([torch.arange(r, total, world) for r in range(world)]))  # rows to data order
    return Inference(_tree(lambda t: t[where], _cat([p for p, n in every if n])), metrics)
