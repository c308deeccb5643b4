"""Content checks of the audit that need no line-by-line state: slot values against the types the
slots declare (:mod:`fsmtrain.core.slots`), and the ``result`` figures against what the epoch
events give."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from fsmtrain.core import slots as _slots_module
from fsmtrain.core.context import Slot

__all__ = ["NONFINITE", "RESULT_FIELDS", "number", "result_mismatches", "same_number", "slot_checks"]

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# The result figures recomputed from the log, in the order the audit reports them.
RESULT_FIELDS = ("stop_reason", "stop_source", "stop_message", "epochs_completed", "last_val_loss",
                 "best_val_loss", "best_epoch", "objective", "global_step")

Check = Callable[[Any], bool]


def number(value: Any) -> float | None:
    """A JSON number as the event log writes it (non-finite ones as strings), else None."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)
    if kind is str:
        return NONFINITE.get(value)
    return None


def same_number(a: Any, b: Any) -> bool:
    x, y = number(a), number(b)
    if x is None or y is None:
        return False
    return x == y or (math.isnan(x) and math.isnan(y))


def result_mismatches(found: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, found, expected) for each ``result`` figure that differs from the recomputed one;
    a field the result does not carry is not compared."""
    out = []
    for key in RESULT_FIELDS:
        if key not in found or key not in expected:
            continue
        want, got = expected[key], found[key]
        if isinstance(want, float):
            if not same_number(got, want):
                out.append((key, got, want))
        elif got != want or type(got) is not type(want):
            out.append((key, got, want))
    return out


# --- slot types ---------------------------------------------------------------------------------
def _describe(tp: Any) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        inner = ", ".join(f"{f.name} ({_describe(hints[f.name])})" for f in dataclasses.fields(tp))
        return f"an object with {inner}"
    return getattr(tp, "__name__", str(tp))


def _check_for(tp: Any) -> Check | None:
    """A predicate for a JSON value of declared type ``tp`` (None: a type the audit cannot check)."""
    if tp is float:
        return lambda v: number(v) is not None
    if tp is bool:
        return lambda v: type(v) is bool
    if tp is int:
        return lambda v: type(v) is int
    if tp is str:
        return lambda v: type(v) is str
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        parts = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _check_for(parts[0]) if len(parts) == 1 else None
        return None if inner is None else (lambda v: v is None or inner(v))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _check_for(hints[f.name]) for f in dataclasses.fields(tp)}

        def check(v: Any) -> bool:
            return (type(v) is dict and v.keys() == fields.keys()
                    and all(c is None or c(v[k]) for k, c in fields.items()))
        return check
    return None


def slot_checks(module: Any = _slots_module) -> dict[str, tuple[Check, str]]:
    """For each slot ``module`` declares as ``NAME: Slot[T] = Slot("name")``: a check of a logged
    value against ``T`` and how to say what was expected."""
    out: dict[str, tuple[Check, str]] = {}
    for attr, hint in typing.get_type_hints(module).items():
        slot = getattr(module, attr, None)
        if not isinstance(slot, Slot) or typing.get_origin(hint) is not Slot:
            continue
        (tp,) = typing.get_args(hint)
        check = _check_for(tp)
        if check is not None:
            out[slot.name] = (check, _describe(tp))
    return out
