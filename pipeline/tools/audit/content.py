"""Content checks that need no line-by-line state: slot values against the types the slots
declare (:mod:`fsmtrain.core.slots`), and the ``result`` figures against the recomputed ones."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from fsmtrain.core import slots as _slots_module
from fsmtrain.core.context import Slot

__all__ = ["number", "result_mismatches", "slot_checks"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# The result figures recomputed from the log, in the order the audit reports them.
_RESULT_FIELDS = ("stop_reason", "stop_source", "stop_message", "epochs_completed", "last_val_loss",
                  "best_val_loss", "best_epoch", "objective", "global_step")

Check = Callable[[Any], bool]
_SCALARS: dict[Any, tuple[Check, str]] = {
    float: (lambda v: number(v) is not None, "a number"),
    int: (lambda v: type(v) is int, "an integer"),
    bool: (lambda v: type(v) is bool, "true or false"),
    str: (lambda v: type(v) is str, "a string"),
}


def number(value: Any) -> float | None:
    """A JSON number as the event log writes it (non-finite ones as strings), else None."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)
    return _NONFINITE.get(value) if kind is str else None


def _same_number(a: Any, b: Any) -> bool:
    x, y = number(a), number(b)
    return x is not None and y is not None and (x == y or (math.isnan(x) and math.isnan(y)))


def result_mismatches(found: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, found, expected) for each ``result`` figure that differs from the recomputed one;
    a field the result does not carry is not compared."""
    out = []
    for key in _RESULT_FIELDS:
        if key not in found or key not in expected:
            continue
        want, got = expected[key], found[key]
        exact = got == want and type(got) is type(want)
        if not (_same_number(got, want) if isinstance(want, float) else exact):
            out.append((key, got, want))
    return out


def _check_for(tp: Any) -> tuple[Check, str] | None:
    """A check of a JSON value of declared type ``tp`` and what it expects (None: not checkable)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        parts = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _check_for(parts[0]) if len(parts) == 1 else None
        return None if inner is None else ((lambda v: v is None or inner[0](v)), inner[1])
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _check_for(hints[f.name]) for f in dataclasses.fields(tp)}

        def check(v: Any) -> bool:
            return (type(v) is dict and v.keys() == fields.keys()
                    and all(c is None or c[0](v[k]) for k, c in fields.items()))
        said = ", ".join(f"{k} ({c[1] if c else getattr(hints[k], '__name__', hints[k])})" for k, c in fields.items())
        return check, f"an object with {said}"
    return None


def slot_checks(module: Any = _slots_module) -> dict[str, tuple[Check, str]]:
    """For each slot ``module`` declares as ``NAME: Slot[T] = Slot("name")``: a check of a logged
    value against ``T`` and how to say what was expected."""
    out: dict[str, tuple[Check, str]] = {}
    for attr, hint in typing.get_type_hints(module).items():
        slot = getattr(module, attr, None)
        if isinstance(slot, Slot) and typing.get_origin(hint) is Slot:
            check = _check_for(typing.get_args(hint)[0])
            if check is not None:
                out[slot.name] = check
    return out
