"""Callback mistakes caught when the runner is built (an ``on_*`` method that is not a hook, a wrong
signature, a hook assigned on the instance), each with a suggestion."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from fsmtrain.core.lifecycle import HOOK_NAMES, HOOKS, HookScope

__all__ = ["CallbackDefinitionError", "SlotWriteError", "check_callback", "hook_hint", "suggest_hook"]


class CallbackDefinitionError(TypeError):
    """A callback class is written in a way the runner cannot dispatch correctly."""


class SlotWriteError(CallbackDefinitionError):
    """A callback wrote a slot it does not declare in ``writes``."""


_SCOPE: Mapping[str, HookScope] = {h.name: h.scope for h in HOOKS}
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# Words other trainers use for the same hook parts (Keras/Lightning ``start``, ``validation``).
_SYNONYMS = (("_start", "_begin"), ("validation", "val"), ("validate", "val"), ("_fit_", "_train_"))


def hook_hint(hook: str) -> str:
    """The typed signature a hook must have: ``on_val_end(self, epoch: EpochContext)``."""
    scope = _SCOPE[hook].value  # "epoch" -> EpochContext, "val_step" -> ValStepContext
    return f"{hook}(self, {scope}: {''.join(part.capitalize() for part in scope.split('_'))}Context)"


def suggest_hook(name: str) -> str | None:
    """The hook a misspelt ``on_*`` name most likely meant, or None."""
    normalised = name
    for other, ours in _SYNONYMS:
        normalised = normalised.replace(other, ours)
    for candidate in (normalised, name):
        close = difflib.get_close_matches(candidate, HOOK_NAMES, n=1, cutoff=0.6)
        if close:
            return close[0]
    return None


def check_callback(callback: Any, base: type) -> None:
    """Raise :class:`CallbackDefinitionError` for the first mistake in ``callback`` (``base``: the no-op class)."""
    name = callback.name
    for attr in _own_on_names(type(callback), base):
        if attr in HOOK_NAMES or not callable(getattr(callback, attr, None)):
            continue
        guess = suggest_hook(attr)
        hint = f"did you mean {guess}?" if guess else f"hooks are: {', '.join(HOOK_NAMES)}."
        raise CallbackDefinitionError(
            f"{name}.{attr} is not a hook and would never be called: {hint} "
            f"(rename a helper so it does not start with 'on_', e.g. _{attr})")
    # A copy, not a live walk: another thread may be adding to the instance's attributes meanwhile.
    for attr, value in dict(getattr(callback, "__dict__", {})).items():
        if attr in HOOK_NAMES and callable(value) and attr not in callback.overridden_hooks():
            raise CallbackDefinitionError(
                f"{name}.{attr} is assigned on the instance, so it is never dispatched: "
                f"define it in the class as {hook_hint(attr)}")
    for hook in callback.overridden_hooks():
        _check_signature(callback, hook)


def _own_on_names(cls: type, base: type) -> list[str]:
    """``on_*`` attributes the callback's own classes define (the base's hooks are not checked)."""
    # A copy of each class's attributes: a first deepcopy adds ``__slotnames__``, possibly in another thread.
    return list(dict.fromkeys(n for klass in cls.__mro__ if not issubclass(base, klass)
                              for n in vars(klass).copy() if n.startswith("on_")))


def _check_signature(callback: Any, hook: str) -> None:
    bound = getattr(callback, hook)
    try:
        params = list(inspect.signature(bound).parameters.values())
    except (TypeError, ValueError):
        return  # no introspectable signature (a builtin); the call itself will tell
    if len(params) == 1 and params[0].kind in _POSITIONAL:
        return
    raw = inspect.getattr_static(type(callback), hook, None)
    shown = _signature_text(raw, bound)
    raise CallbackDefinitionError(
        f"{callback.name}.{hook}{shown} must take exactly one context argument: {hook_hint(hook)}")


def _signature_text(raw: object, bound: Any) -> str:
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    try:
        sig = inspect.signature(fn if inspect.isfunction(fn) else bound)
    except (TypeError, ValueError):
        return "(...)"
    return str(sig.replace(return_annotation=inspect.Signature.empty))
