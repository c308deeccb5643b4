"""The numbers of one epoch, flat and named (every metric and numeric slot value), as loggers show them."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from fsmtrain.core.context import EpochContext

__all__ = ["epoch_scalars", "slot_scalars"]


def _number(value: Any) -> float | None:
    kind = type(value)
    if kind is float or kind is int:  # the common case, before the slower check against the ABC
        return float(value)
    if kind is bool or not isinstance(value, numbers.Real):
        return None
    return float(value)


def slot_scalars(name: str, value: Any) -> dict[str, float]:
    """The named scalars of one slot value: a number, its ``scalars()``, ``<name>/<field>`` for a dataclass's
    or mapping's numeric fields, or ``float(value)`` when that converts."""
    if value is None or isinstance(value, bool):
        return {}
    number = _number(value)
    if number is not None:
        return {name: number}
    scalars = getattr(value, "scalars", None)
    if callable(scalars):
        return {str(k): v for k, v in ((k, _number(v)) for k, v in scalars().items()) if v is not None}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items: Mapping[str, Any] = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, Mapping):
        items = value
    else:
        try:
            return {name: float(value)}
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: torch, a tensor of many elements
            return {}
    return {f"{name}/{k}": v for k, v in ((k, _number(v)) for k, v in items.items()) if v is not None}


def epoch_scalars(epoch: EpochContext) -> dict[str, float]:
    """Every epoch metric, then every numeric slot value present now (a metric keeps its name)."""
    data = {k: float(v) for k, v in epoch.metrics.items()}
    for name, value in epoch.run.slot_values().items():
        for key, number in slot_scalars(name, value).items():
            data.setdefault(key, number)
    return data
