"""The global-callback registry, the one process-wide state: callbacks registered here join every run built
meanwhile, each run getting a deep copy of an instance or a factory's product."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GlobalHandle", "GlobalRegistrationError", "callbacks_for_run", "global_callbacks",
           "register_global_callback"]

# The registry holds callbacks without importing their class (``hooks`` imports this module).
TrainingCallback = Any


class GlobalRegistrationError(ValueError):
    """A registration that would share state between runs or register one callback twice."""


@dataclass(frozen=True)
class _Registration:
    instance: TrainingCallback | None  # the registered instance (None: a factory)
    make: Callable[[], TrainingCallback]  # one run's callback: a copy of the instance's copy, or the factory's


def _made_by(factory: Callable[..., TrainingCallback], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    made = factory(*args, **kwargs)
    if not _is_callback(made):
        raise GlobalRegistrationError(
            f"global callback factory {_label(factory)} returned {type(made).__name__}, not a TrainingCallback")
    return made


_lock = threading.Lock()
_registry: dict[int, _Registration] = {}
_ids = itertools.count()


@dataclass(frozen=True)
class GlobalHandle:
    """``remove()`` takes the registered callback out again; also a context manager."""

    key: int
    callback: TrainingCallback | None = field(default=None, repr=False)  # None for a factory
    factory: Callable[..., TrainingCallback] | None = field(default=None, repr=False)

    def remove(self) -> None:
        with _lock:
            _registry.pop(self.key, None)

    @property
    def active(self) -> bool:
        with _lock:
            return self.key in _registry

    def __enter__(self) -> GlobalHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_global_callback(callback: TrainingCallback | Callable[..., TrainingCallback], *args: Any,
                             **kwargs: Any) -> GlobalHandle:
    """Add a callback instance (copied now and per run), or a factory with its arguments, to every run built
    until the handle's ``remove()``."""
    if _is_callback(callback):
        if args or kwargs:
            raise TypeError(f"{_name(callback)} is already an instance; arguments go with a factory: "
                            f"register_global_callback({type(callback).__name__}, ...)")
        prototype = _copy_of(callback)  # one that cannot be copied is refused now, not when a run starts
        with _lock:
            key = next((k for k, reg in _registry.items() if reg.instance is callback), None)
            if key is not None:
                raise GlobalRegistrationError(
                    f"{_name(callback)} is already registered as a global callback (handle {key}); a callback "
                    "instance joins the registry once at a time, so a nested `with cb:` or a second "
                    "register_global_callback(cb) is refused: remove it first or register another instance")
            key = next(_ids)
            _registry[key] = _Registration(callback, functools.partial(_copy_of, prototype))
        return GlobalHandle(key, callback=callback)
    if not callable(callback):
        raise TypeError(f"register_global_callback takes a TrainingCallback instance or a factory of one; "
                        f"got {type(callback).__name__}")
    if isinstance(callback, type) and not callable(getattr(callback, "overridden_hooks", None)):
        raise TypeError(f"register_global_callback: {callback.__name__} is not a TrainingCallback class")
    try:
        inspect.signature(callback).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"register_global_callback({_label(callback)}, ...): {exc}") from None
    except ValueError:
        pass  # no signature to check (a builtin); the call at runner build will tell
    with _lock:
        key = next(_ids)
        _registry[key] = _Registration(None, functools.partial(_made_by, callback, args, dict(kwargs)))
    return GlobalHandle(key, factory=callback)


def global_callbacks() -> list[TrainingCallback]:
    """For listing: the registered instances themselves and a fresh product of each factory."""
    with _lock:
        snapshot = [_registry[k] for k in sorted(_registry)]
    # Factories run outside the lock: user code may itself register or list.
    return [reg.instance if reg.instance is not None else reg.make() for reg in snapshot]


def callbacks_for_run(local: frozenset[int] = frozenset()) -> list[TrainingCallback]:
    """What one run gets: copies and factory products, but instances it has as local callbacks (``local``: ids)."""
    with _lock:
        snapshot = [_registry[k] for k in sorted(_registry)]
    return [reg.make() for reg in snapshot if reg.instance is None or id(reg.instance) not in local]


def _is_callback(obj: object) -> bool:
    return not isinstance(obj, type) and callable(getattr(obj, "overridden_hooks", None))


def _copy_of(callback: TrainingCallback) -> TrainingCallback:
    try:
        return copy.deepcopy(callback)
    except Exception as exc:
        cls = type(callback).__name__
        raise GlobalRegistrationError(
            f"{_name(callback)} cannot be copied for each run ({type(exc).__name__}: {exc}); register a factory "
            f"instead, called once per run: register_global_callback({cls}, <its arguments>) or "
            f"register_global_callback(lambda: {cls}(...))") from None


def _name(callback: TrainingCallback) -> str:
    return str(getattr(callback, "name", type(callback).__name__))


def _label(factory: Callable[..., Any]) -> str:
    return str(getattr(factory, "__qualname__", None) or repr(factory))
