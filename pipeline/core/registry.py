"""The global-callback registry: the one documented piece of process-wide state.

Callbacks registered here join every run whose runner is built while they are registered, in the
GLOBAL tier. Three rules keep that safe:

* **Locked.** One lock guards register, remove and listing, so threads may register and remove
  callbacks while others build runners (listing takes a snapshot under the lock).
* **No re-entry.** A callback instance is registered at most once at a time: registering it again,
  or a nested ``with cb:`` of the same instance, raises :class:`GlobalRegistrationError`.
* **No state carried between runs: stateful callbacks are registered as factories.** A registered
  *instance* is shared by every run started while it is registered, so only stateless instances are
  accepted. An instance whose class overrides ``state_dict`` (or whose ``state_dict()`` is not
  empty) is refused with a message that says to register a factory instead: a callback class with
  its arguments, ``register_global_callback(EarlyStoppingCallback, patience=3)``, or any zero-argument
  callable returning a callback, ``register_global_callback(lambda: EarlyStoppingCallback(patience=3))``.
  A factory is called once per run, when that run's runner is built, so every run starts fresh.
  (Copying a registered instance instead was rejected: a deep copy would silently duplicate whatever
  the callback holds, such as a model it averages or an open file.)

Only the callbacks' duck type is used here (``stateful``, ``state_dict``, ``overridden_hooks``):
``pipeline.core.hooks`` imports this module, not the other way round.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GlobalHandle", "GlobalRegistrationError", "global_callbacks", "register_global_callback"]

# The registry holds callbacks without importing their class (``hooks`` imports this module).
TrainingCallback = Any


class GlobalRegistrationError(ValueError):
    """A registration that would share state between runs or register one callback twice."""


@dataclass(frozen=True)
class _Registration:
    instance: TrainingCallback | None  # a stateless instance shared by all runs, or
    factory: Callable[..., TrainingCallback] | None  # a factory called once per run
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self) -> TrainingCallback:
        if self.instance is not None:
            return self.instance
        assert self.factory is not None
        made = self.factory(*self.args, **self.kwargs)
        if not _is_callback(made):
            raise GlobalRegistrationError(
                f"global callback factory {_label(self.factory)} returned {type(made).__name__}, "
                "not a TrainingCallback")
        return made


_lock = threading.Lock()
_registry: dict[int, _Registration] = {}
_by_instance: dict[int, int] = {}  # id(instance) -> key, for the re-entry check
_ids = itertools.count()


@dataclass(frozen=True)
class GlobalHandle:
    """Returned by :func:`register_global_callback`; ``remove()`` takes the callback out again.
    Also a context manager: ``with register_global_callback(Factory, ...): trainer.fit()``."""

    key: int
    callback: TrainingCallback | None = field(default=None, repr=False)  # None for a factory
    factory: Callable[..., TrainingCallback] | None = field(default=None, repr=False)

    def remove(self) -> None:
        with _lock:
            reg = _registry.pop(self.key, None)
            if reg is not None and reg.instance is not None:
                _by_instance.pop(id(reg.instance), None)

    @property
    def active(self) -> bool:
        with _lock:
            return self.key in _registry

    def __enter__(self) -> GlobalHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_global_callback(
    callback: TrainingCallback | Callable[..., TrainingCallback], *args: Any, **kwargs: Any
) -> GlobalHandle:
    """Add a callback to every run built from now until the handle's ``remove()``.

    ``callback`` is a stateless callback instance, or a factory (a callback class or a zero-argument
    callable) with the arguments to call it with once per run. A stateful instance, or an instance
    already registered, is refused with :class:`GlobalRegistrationError`.
    """
    if _is_callback(callback):
        if args or kwargs:
            raise TypeError(f"{_name(callback)} is already an instance; arguments go with a factory: "
                            f"register_global_callback({type(callback).__name__}, ...)")
        _refuse_stateful(callback)
        with _lock:
            key = _by_instance.get(id(callback))
            if key is not None:
                raise GlobalRegistrationError(
                    f"{_name(callback)} is already registered as a global callback (handle {key}); a callback "
                    "instance joins the registry once at a time, so a nested `with cb:` or a second "
                    "register_global_callback(cb) is refused: remove it first or register another instance")
            key = next(_ids)
            _registry[key] = _Registration(callback, None)
            _by_instance[id(callback)] = key
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
        _registry[key] = _Registration(None, callback, args, dict(kwargs))
    return GlobalHandle(key, factory=callback)


def global_callbacks() -> list[TrainingCallback]:
    """The registered callbacks in registration order, factories called once each (a fresh
    instance per call: call this once per run)."""
    with _lock:
        snapshot = [_registry[k] for k in sorted(_registry)]
    # Factories run outside the lock: user code may itself register or list.
    return [reg.make() for reg in snapshot]


def _is_callback(obj: object) -> bool:
    return not isinstance(obj, type) and callable(getattr(obj, "overridden_hooks", None))


def _refuse_stateful(callback: TrainingCallback) -> None:
    if getattr(callback, "stateful", False) or callback.state_dict():
        cls = type(callback).__name__
        raise GlobalRegistrationError(
            f"{_name(callback)} keeps state (state_dict) that a registered instance would carry from one run "
            f"into the next; register a factory instead, called once per run: "
            f"register_global_callback({cls}, <its arguments>) or "
            f"register_global_callback(lambda: {cls}(...))")


def _name(callback: TrainingCallback) -> str:
    return str(getattr(callback, "name", type(callback).__name__))


def _label(factory: Callable[..., Any]) -> str:
    return str(getattr(factory, "__qualname__", None) or repr(factory))
