"""The global-callback registry: the one documented piece of process-wide state.

Callbacks registered here join every run whose runner is built while they are registered, in the
GLOBAL tier. Three rules keep that safe:

* **Locked.** One lock guards register, remove and listing, so threads may register and remove
  callbacks while others build runners (listing takes a snapshot under the lock).
* **No re-entry.** A callback instance is registered at most once at a time: registering it again,
  or a nested ``with cb:`` of the same instance, raises :class:`GlobalRegistrationError`.
* **No state carried between runs.** Every run gets its own fresh callback, whatever the
  callback keeps its state in (``state_dict``, plain attributes, a device tensor): a registered
  *instance* is a prototype, deep-copied once at registration into the registry's own copy, and
  each run's runner gets a ``copy.deepcopy`` of that copy, so no run ever mutates the registered
  instance, and nothing done to the instance after registration (running it as a run's local
  callback, changing its attributes) reaches another run; a *factory* (a callback class with its
  arguments, ``register_global_callback(EarlyStoppingCallback, patience=3)``, or any zero-argument
  callable returning a callback) is called once per run. An instance that cannot be deep-copied
  (it holds an open file, a lock) is refused at registration with a message to register a factory
  instead.

Only the callbacks' duck type is used here (``overridden_hooks``, ``name``):
``fsmtrain.core.hooks`` imports this module, not the other way round.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GlobalHandle", "GlobalRegistrationError", "callbacks_for_run", "global_callbacks", "register_global_callback",
]

# The registry holds callbacks without importing their class (``hooks`` imports this module).
TrainingCallback = Any


class GlobalRegistrationError(ValueError):
    """A registration that would share state between runs or register one callback twice."""


@dataclass(frozen=True)
class _Registration:
    instance: TrainingCallback | None  # the registered instance (for listing and the identity checks), or
    factory: Callable[..., TrainingCallback] | None  # a factory called once per run
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The registry's own deep copy of ``instance``, taken at registration before anyone could list it:
    # every run copies this, which nothing else holds, never ``instance``, which its owner may change
    # in another thread while a run is being built (``with cb:`` sets its handle on it just after
    # registering; a Trainer given it as a local callback binds and runs it). Copying ``instance``
    # raised "dictionary changed size during iteration" (reported as "cannot be copied"), and handed
    # a local run's state (EarlyStopping's ``wait``) to the next run's copy.
    prototype: TrainingCallback | None = None

    def make(self) -> TrainingCallback:
        if self.instance is not None:
            return _copy_of(self.prototype)
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

    ``callback`` is a callback instance (each run gets a deep copy of it as it is now, at
    registration; the registration never runs the instance itself), or a factory (a callback class
    or a zero-argument callable) with the arguments to call it with once per run. An instance
    already registered, or one that cannot be copied, is refused with :class:`GlobalRegistrationError`.
    """
    if _is_callback(callback):
        if args or kwargs:
            raise TypeError(f"{_name(callback)} is already an instance; arguments go with a factory: "
                            f"register_global_callback({type(callback).__name__}, ...)")
        prototype = _copy_of(callback)  # one that cannot be copied is refused now, not when a run starts
        with _lock:
            key = _by_instance.get(id(callback))
            if key is not None:
                raise GlobalRegistrationError(
                    f"{_name(callback)} is already registered as a global callback (handle {key}); a callback "
                    "instance joins the registry once at a time, so a nested `with cb:` or a second "
                    "register_global_callback(cb) is refused: remove it first or register another instance")
            key = next(_ids)
            _registry[key] = _Registration(callback, None, prototype=prototype)
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
    """The registered callbacks in registration order: the registered instances themselves, and
    for each factory a fresh product (what is registered, for listing; a run gets
    :func:`callbacks_for_run`)."""
    with _lock:
        snapshot = [_registry[k] for k in sorted(_registry)]
    # Factories run outside the lock: user code may itself register or list.
    return [reg.instance if reg.instance is not None else reg.make() for reg in snapshot]


def callbacks_for_run(local: frozenset[int] = frozenset()) -> list[TrainingCallback]:
    """What one run gets of the registry, in registration order: a deep copy of every registered
    instance, a fresh product of every factory. A registered instance that the run also got as a
    local callback (``local``: their ids) runs once, as the local one."""
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
