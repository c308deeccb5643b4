"""The resolution tier of a run config: every dotted path imports (for real) and is the right kind of
object, its kwargs match its signature, and a requested accelerator exists."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import sys
import types
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from pydantic import ValidationError

from fsmtrain.app.config.problems import ConfigError, ConfigProblem, closest, schema_problems
from fsmtrain.app.config.schema import NamedOptimizerConfig, RunConfig
from fsmtrain.core.hooks import TrainingCallback


class Kind(str, Enum):
    MODEL = "a torch.nn.Module subclass"
    OPTIMIZER = "a torch.optim.Optimizer subclass"
    SCHEDULER = "an LR scheduler class (torch.optim.lr_scheduler.LRScheduler or ReduceLROnPlateau)"
    LOSS = "a loss: an nn.Module subclass or a function (output, target) -> tensor"
    DATA = "a data builder function (batch_size=, seed=, **data_config) -> (train, val)"
    METRIC = "a metric function (output, target) -> 0-d tensor"
    EXACT_METRIC = "a metric class with update(output, target), compute() and reset(), e.g. a torchmetrics.Metric"
    STEP = "a step function (model, batch) -> the loss, or a mapping with 'loss' and named outputs"
    CALLBACK = "a TrainingCallback subclass"


class ResolveError(Exception):
    def __init__(self, found: str, suggestion: str | None = None) -> None:
        super().__init__(found)
        self.found, self.suggestion = found, suggestion


def _names_in(obj: Any) -> list[str]:
    names = [n for n in dir(obj) if not n.startswith("_")]
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(obj.__path__)]
    return names


# fsmtrain's folder names, which are not import names: a path under them is refused with its fsmtrain.… name.
_OLD_NAMES = {"pipeline": "fsmtrain", "callbacks": "fsmtrain.callbacks"}


def _renamed(path: str) -> str | None:
    """The ``fsmtrain.…`` path an old ``pipeline.…``/``callbacks.…`` path means, when that exists."""
    top, _, rest = path.partition(".")
    if top not in _OLD_NAMES or not rest:
        return None
    new = f"{_OLD_NAMES[top]}.{rest}"
    with contextlib.suppress(ResolveError):
        import_dotted(new)
        return new
    return None


def import_dotted(path: str) -> Any:
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ResolveError(f"{path!r}, which is not a dotted import path like torch.optim.Adam")
    new = _renamed(path)
    if new is not None:
        raise ResolveError(f"{path!r}, an old name of fsmtrain's own {new!r}", new)
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            raise ResolveError(f"importing {modname} failed: {exc}") from None
        except Exception as exc:  # a broken user module is reported, not raised
            raise ResolveError(f"importing {modname} failed: {type(exc).__name__}: {exc}") from None
        for j in range(i, len(parts)):
            attr = parts[j]
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            if isinstance(obj, types.ModuleType):
                try:
                    obj = importlib.import_module(".".join(parts[: j + 1]))
                    continue
                except ImportError:
                    pass
            prefix = ".".join(parts[:j])
            close = closest(attr, _names_in(obj))
            fixed = ".".join([prefix, close, *parts[j + 1 :]]) if close else None
            raise ResolveError(f"{prefix} has no attribute {attr!r}", fixed)
        return obj
    # What the user could have meant: their own modules and installed packages, not the stdlib's.
    top = sorted({m.name for m in pkgutil.iter_modules()
                  if m.name not in sys.stdlib_module_names and not m.name.startswith("_")})
    close = closest(parts[0], top)
    raise ResolveError(f"no module named {parts[0]!r}", ".".join([close, *parts[1:]]) if close else None)


def resolve_dotted(path: str) -> Any:
    """Import ``package.module.Name``; raises ``ConfigError`` (with a close match) when it does not exist."""
    try:
        return import_dotted(path)
    except ResolveError as exc:
        raise ConfigError([ConfigProblem(path, "an importable dotted path", exc.found, exc.suggestion)]) from None


def _is_kind(obj: Any, kind: Kind) -> bool:
    import torch
    sched = torch.optim.lr_scheduler
    bases: dict[Kind, Any] = {Kind.MODEL: torch.nn.Module, Kind.LOSS: torch.nn.Module, Kind.CALLBACK: TrainingCallback,
                              Kind.OPTIMIZER: torch.optim.Optimizer,
                              Kind.SCHEDULER: (sched.LRScheduler, sched.ReduceLROnPlateau)}
    if not inspect.isclass(obj):  # a loss, data builder, metric or step may be a plain function
        return kind in (Kind.LOSS, Kind.DATA, Kind.METRIC, Kind.STEP) and callable(obj)
    if kind is Kind.EXACT_METRIC:
        return all(callable(getattr(obj, a, None)) for a in ("update", "compute", "reset"))
    return kind in bases and issubclass(obj, bases[kind])


def _takes_output_and_target(sig: inspect.Signature) -> bool:
    """Whether the first two arguments are positional and required, as a loss's output and target are."""
    slots: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return all(q.default is inspect.Parameter.empty for q in slots)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            slots.append(p)
    return len(slots) >= 2 and all(q.default is inspect.Parameter.empty for q in slots[:2])


def not_a_loss(obj: Any) -> str | None:
    """Why a callable that is not an ``nn.Module`` class cannot be a loss ``fn(output, target, ...)``,
    or None (Python's own functions, ``os.system`` among them, are never one)."""
    top = str(getattr(obj, "__module__", None) or "").partition(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return "a function of Python's standard library, not a loss"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # an extension function without a signature: the call itself will tell
    if not _takes_output_and_target(sig):
        shown = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                          for p in sig.parameters.values())
        return f"a function taking ({shown}), not (output, target, ...) with both required"
    return None


def describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if callable(obj):
        return f"function {getattr(obj, '__qualname__', obj)!r}"
    return f"a {type(obj).__name__} object"


def kwarg_problems(obj: Any, kwargs: Mapping[str, Any], cfg_path: str, positional: int,
                   supplied: Sequence[str] = ()) -> list[ConfigProblem]:
    """Check ``kwargs`` against ``obj``'s signature (after ``positional`` leading arguments);
    ``supplied``: the names fsmtrain fills in itself."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []  # builtins without a signature: the call itself will tell
    what = describe(obj)
    params = list(sig.parameters.values())
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    leading = [p for p in params if p.kind in positional_kinds][:positional]
    rest = [p for p in params if p not in leading]
    named = {p.name: p for p in rest if p.kind in (*positional_kinds, inspect.Parameter.KEYWORD_ONLY)}
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
    problems: list[ConfigProblem] = []
    for key in kwargs:
        if key in supplied:
            problems.append(ConfigProblem(
                f"{cfg_path}.{key}", f"no {key!r} here (it is set from the top-level {key!r})", repr(key)))
        elif key not in named and not open_kwargs:
            problems.append(ConfigProblem(
                f"{cfg_path}.{key}", f"an argument of {what}: {', '.join(named) or 'none'}",
                f"unknown argument {key!r}", closest(str(key), list(named)),
            ))
    for name, p in named.items():
        if p.default is inspect.Parameter.empty and name not in kwargs and name not in supplied:
            problems.append(ConfigProblem(
                f"{cfg_path}.{name}", f"a value for the required argument {name!r} of {what}", "nothing"))
    return problems


# (key, kind, leading positional args, names filled in by fsmtrain); the kwargs are under <key>_config
_TARGETS: tuple[tuple[str, Kind, int, tuple[str, ...]], ...] = (
    ("net", Kind.MODEL, 0, ()), ("optimizer", Kind.OPTIMIZER, 1, ()), ("scheduler", Kind.SCHEDULER, 1, ()),
    ("criterion", Kind.LOSS, 0, ()), ("data", Kind.DATA, 0, ("batch_size", "seed")),
)


def _check_target(path: str, value: Any, kind: Kind, kwargs: Any, kwargs_path: str | None, positional: int,
                  supplied: Sequence[str] = ()) -> list[ConfigProblem]:
    if not isinstance(value, str):
        return []  # the schema tier reports the type
    try:
        obj = import_dotted(value)
    except ResolveError as exc:
        return [ConfigProblem(path, f"an importable dotted path to {kind.value}", exc.found, exc.suggestion)]
    if not _is_kind(obj, kind):
        return [ConfigProblem(path, kind.value, f"{value} is {describe(obj)}")]
    why = not_a_loss(obj) if kind is Kind.LOSS and not inspect.isclass(obj) else None
    if why is not None:
        return [ConfigProblem(path, kind.value, f"{value} is {why}")]
    if kwargs_path is None or not isinstance(kwargs, Mapping):
        return []
    if kind is Kind.LOSS and not inspect.isclass(obj):
        positional = 2  # a loss function is called as fn(output, target, **criterion_config)
    return kwarg_problems(obj, kwargs, kwargs_path, positional, supplied)


def _named_optimizer_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    """``optimizers.<name>.target`` and ``schedulers.<name>.target`` with their kwargs; a scheduler's
    name must be an optimizer's."""
    problems: list[ConfigProblem] = []
    optimizers = data.get("optimizers")
    names = list(optimizers) if isinstance(optimizers, Mapping) else []
    for section, kind, default in (("optimizers", Kind.OPTIMIZER, NamedOptimizerConfig.model_fields["target"].default),
                                   ("schedulers", Kind.SCHEDULER, None)):
        items = data.get(section)
        for name, item in (items.items() if isinstance(items, Mapping) else ()):
            if not isinstance(item, Mapping):
                continue
            if section == "schedulers" and name not in names:
                problems.append(ConfigProblem(f"schedulers.{name}", f"the name of an optimizer in optimizers "
                                              f"({', '.join(map(str, names)) or 'none'})", f"{name!r}",
                                              closest(str(name), names)))
                continue
            problems += _entry_problems(f"{section}.{name}", item, kind, 1, default)
    return problems


def _entry_problems(where: str, item: Mapping[str, Any], kind: Kind, positional: int = 0,
                    default: str | None = None) -> list[ConfigProblem]:
    """A ``{target, kwargs}`` entry at ``where``: its target and the kwargs it is built with."""
    return _check_target(f"{where}.target", item.get("target", default), kind, item.get("kwargs", {}),
                         f"{where}.kwargs", positional)


def resolution_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for key, kind, positional, supplied in _TARGETS:
        value = data.get(key, RunConfig.model_fields[key].default)  # net and data have none: the schema says so
        if value is not None:
            problems += _check_target(key, value, kind, data.get(f"{key}_config", {}), f"{key}_config", positional,
                                      supplied)
    problems += _named_optimizer_problems(data)
    for key in ("step", "val_step"):
        if data.get(key) is not None:
            problems += _check_target(key, data[key], Kind.STEP, None, None, 0)
    metrics = data.get("metrics")
    for name, target in (metrics.items() if isinstance(metrics, Mapping) else ()):
        problems += (_entry_problems(f"metrics.{name}", target, Kind.EXACT_METRIC) if isinstance(target, Mapping)
                     else _check_target(f"metrics.{name}", target, Kind.METRIC, None, None, 0))
    callbacks = data.get("callbacks")
    extra = callbacks.get("extra") if isinstance(callbacks, Mapping) else None
    for i, item in enumerate(extra if isinstance(extra, list) else ()):
        if isinstance(item, Mapping):
            problems += _entry_problems(f"callbacks.extra.{i}", item, Kind.CALLBACK)
    device = data.get("device", "cpu")
    if not isinstance(device, str) or not (device.startswith("cuda") or device == "mps"):
        return problems  # the CPU is always there: no need to ask torch
    import torch
    missing = ("no CUDA GPU is visible" if device.startswith("cuda") and not torch.cuda.is_available() else
               "MPS is not available" if device == "mps" and not torch.backends.mps.is_available() else None)
    if missing is not None:
        problems.append(ConfigProblem("device", f"a device this machine has ({missing})", repr(device), "cpu"))
    return problems


def checked(data: Mapping[str, Any]) -> tuple[RunConfig | None, list[ConfigProblem]]:
    """The config ``data`` makes (None when the schema refuses it) and the problems of the schema and
    resolution tiers."""
    try:
        return RunConfig.model_validate(dict(data)), resolution_problems(data)
    except ValidationError as exc:
        return None, schema_problems(exc, RunConfig) + resolution_problems(data)
