"""A user's own step: ``fn(model, batch)`` returns the loss, or a mapping with ``loss`` and named outputs
(``output`` and ``target`` for the metrics); it runs as the table's forward action."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fsmtrain.training.precision import PrecisionPolicy

__all__ = ["StepFn", "StepRun", "rows", "step_name", "step_result", "to_device", "user_step"]

StepFn = Callable[[nn.Module, Any], Any]
StepRun = Callable[[nn.Module, Any], tuple[Any, torch.Tensor, Any, int]]  # output, loss, target, rows


def step_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _parts(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        yield from value.values()
    elif isinstance(value, (tuple, list)):
        yield from value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from (getattr(value, f.name) for f in dataclasses.fields(value))


def rows(value: Any) -> int:
    """The examples in a batch or an output: the first dimension of its first tensor (1 for none)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.ndim else 1
    for part in _parts(value):
        if isinstance(part, torch.Tensor) or any(True for _ in _parts(part)):
            return rows(part)
    return 1


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors in tuples, lists, mappings and dataclasses, moved to ``device``; the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def step_result(result: Any, name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """A step's loss and named outputs; what else it returned is refused, naming the step."""
    if isinstance(result, torch.Tensor):
        return result, {}
    if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
        return result["loss"], {k: v for k, v in result.items() if k != "loss"}
    keys = f" with keys {sorted(map(str, result))}" if isinstance(result, Mapping) else ""
    raise TypeError(f"the step {name} must return the loss (a tensor) or a mapping with a tensor 'loss'; "
                    f"it returned {type(result).__name__}{keys}")


def user_step(fn: StepFn, device: torch.device, precision: PrecisionPolicy | None, metrics: bool,
              optimizers: Any = None) -> StepRun:
    """``fn`` as the driver runs a step: the batch on the device, under autocast, its result checked
    (``metrics``: it must name ``output`` and ``target``); ``optimizers``: a manual step's third argument."""
    name, move = step_name(fn), device.type != "cpu"
    if optimizers is not None:
        manual: Callable[..., Any] = fn
        fn = lambda model, batch: manual(model, batch, optimizers)  # noqa: E731

    def run(model: nn.Module, batch: Any) -> tuple[Any, torch.Tensor, Any, int]:
        if move:
            batch = to_device(batch, device)
        if precision is None:
            result = fn(model, batch)
        else:
            with precision.autocast():
                result = fn(model, batch)
        loss, outputs = step_result(result, name)
        if metrics and not {"output", "target"} <= outputs.keys():
            got = f"keys {sorted(map(str, result))}" if isinstance(result, Mapping) else "the loss alone"
            raise TypeError(f"the run has metrics, which get fn(output, target): the step {name} must return them "
                            f"as 'output' and 'target' next to 'loss'; it returned {got}")
        target = outputs.get("target")
        return outputs, loss, target, rows(batch if target is None else target)

    return run
