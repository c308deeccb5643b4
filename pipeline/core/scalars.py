"""The numbers of one epoch, flat and named: every metric and every numeric slot value, as the W&B
logger and the console line show them, so a new metric or slot needs no change to either.

A slot value gives: nothing for ``None`` or a ``bool``; ``{name: value}`` for a real number; the
mapping its ``scalars()`` method returns; ``{"<name>/<field>": value}`` for each numeric field of a
dataclass or value of a mapping; else ``{name: float(value)}`` when that converts (a one-element
tensor), or nothing.
"""

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
    """The named scalars one slot value contributes (see the module docstring)."""
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
    """Every epoch metric (``train_loss``, ``val_loss``, ``lr``, validation metrics), then every
    numeric slot value present now, in the order they were written. A metric keeps its name if a
    slot scalar would take it."""
    data = {k: float(v) for k, v in epoch.metrics.items()}
    for name, value in epoch.run.slot_values().items():
        for key, number in slot_scalars(name, value).items():
            data.setdefault(key, number)
    return data
