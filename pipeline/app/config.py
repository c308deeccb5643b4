"""Run configs: YAML loading, validation in tiers, dotted-path builders and the default callbacks.

Validation tiers, all run before anything is created on disk, with every problem reported at once:

1. **syntax**: YAML with duplicate keys rejected (with their lines); ``1e-3`` reads as a float.
2. **schema** (pydantic): types, ranges, unknown keys (with the closest known key).
3. **resolution**: every dotted path imports and is the right kind of object, its kwargs match
   its signature, a requested accelerator exists. Paths into fsmtrain's own dependencies (torch,
   pytorch_optimizer) and into fsmtrain are read from source when that settles them, so
   validating a config imports no torch; a user's module is imported, since that it imports is
   part of the check. Any problem found is confirmed and worded by the real import.
4. **semantic warnings** (never fatal): e.g. patience >= epochs, a cosine ``T_max`` != ``epochs``.

Resolution runs on the raw mapping, independently of the schema tier, so one error lists a
misspelt class next to a negative epoch count.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import pkgutil
import random
import re
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, cast, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from pipeline.app import static_lookup
from pipeline.core.hooks import TrainingCallback

if TYPE_CHECKING:
    import optuna
    import torch
    from torch import nn

__all__ = [
    "CallbacksConfig",
    "CheckpointConfig",
    "ConfigError",
    "ConfigLoader",
    "ConfigProblem",
    "EarlyStoppingConfig",
    "ExtraCallback",
    "GradClipConfig",
    "OptimizeConfig",
    "RunConfig",
    "SearchParam",
    "WandbConfig",
    "apply_overrides",
    "build_callbacks",
    "build_criterion",
    "build_data",
    "build_metrics",
    "build_pruner",
    "build_sampler",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "config_from_dict",
    "load_config",
    "load_yaml",
    "resolve_dotted",
    "resolved_dict",
    "seed_everything",
    "trial_data",
]


# --- problems --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigProblem:
    """One mistake (or warning) in a config, located by its YAML path (``early_stopping.patience``)."""

    path: str
    expected: str
    found: str
    suggestion: str | None = None

    def __str__(self) -> str:
        text = f"{self.path or '<root>'}: expected {self.expected}; found {self.found}"
        return text + (f" (did you mean {self.suggestion}?)" if self.suggestion else "")


class ConfigError(ValueError):
    """A config is invalid. ``problems`` holds every mistake found; ``str()`` lists them all."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = source if source and source.startswith("--set") else f"config {source}" if source else "config"
        n = len(self.problems)
        if n == 1:  # one mistake, one line
            super().__init__(f"{where}: {self.problems[0]}")
            return
        lines = [f"{where} has {n} problems:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not matches:  # case slips ("adam" for "Adam") score low on ratio alone
        lowered = {c.lower(): c for c in candidates}
        matches = [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)]
    return matches[0] if matches else None


# --- YAML ------------------------------------------------------------------------------------
# YAML 1.1 wants a dot and a signed exponent for floats, so ``1e-3`` would read as a string and
# reach an optimizer as "1e-3". This resolver accepts the forms Python's float() accepts.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class ConfigLoader(yaml.SafeLoader):
    """The safe loader with floats as Python reads them; duplicate keys are found by ``_duplicates``."""


def _duplicates(node: yaml.Node, path: tuple[str, ...] = ()) -> list[ConfigProblem]:
    """Every repeated key in the composed tree, with its YAML path and both lines (PyYAML keeps the last)."""
    found: list[ConfigProblem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            if key in seen and key_node.tag != "tag:yaml.org,2002:merge":
                found.append(ConfigProblem(
                    ".".join((*path, key)), "each key once per mapping",
                    f"duplicate key {key!r} at line {line} (first at line {seen[key]})",
                ))
            seen.setdefault(key, line)
            found += _duplicates(value_node, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicates(item, (*path, str(i)))
    return found


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's message without its source snippet: what it found, and where (1-based)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        return f"{what} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _parse_yaml(text: str, source: str) -> Any:
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        problems = _duplicates(node) if node is not None else []
        if problems:
            raise ConfigError(problems, source)
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem("", "valid YAML", _yaml_error(exc))], source) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file into a plain dict (syntax tier only)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([ConfigProblem("", "an existing YAML file", f"no file at {str(p)!r}")], str(p))
    raw = p.read_bytes()
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\x00"), raw.index(b"\x00") + 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigProblem("", "a YAML text file (UTF-8)", f"binary content ({exc.reason} at byte "
                                                                            f"{exc.start})")], str(p)) from None
    data = _parse_yaml(text, str(p))
    if data is None:
        raise ConfigError([ConfigProblem("", "a mapping of config keys", "an empty file (no keys at all)")], str(p))
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("", "a mapping of config keys", type(data).__name__)], str(p))
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``"a.b=value"`` overrides to a copy of ``data``; ``value`` is parsed as a YAML scalar
    (so ``lr=1e-3`` is a float, ``seeds=[1,2]`` a list, ``scheduler=null`` None)."""
    out = copy.deepcopy(dict(data))
    problems: list[ConfigProblem] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or any(not p for p in parts):
            problems.append(ConfigProblem(key or item, "an override of the form key.path=value", repr(item)))
            continue
        try:
            value = _parse_yaml(raw, f"--set {item}")
        except ConfigError as exc:
            problems.extend(ConfigProblem(key, p.expected, p.found) for p in exc.problems)
            continue
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                problems.append(ConfigProblem(key, f"{where} to be a mapping", type(child).__name__))
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, "overrides")
    return out


# --- schema ----------------------------------------------------------------------------------
class _Section(BaseModel):
    # strict: "3" is not an int; extra keys are mistakes, not silently ignored settings
    model_config = ConfigDict(extra="forbid", strict=True)


class EarlyStoppingConfig(_Section):
    enabled: bool = True
    patience: int = Field(default=20, ge=1)
    mode: Literal["min", "max"] = "min"
    min_delta: float = Field(default=1e-4, ge=0)
    monitor: str = "val_loss"


class CheckpointConfig(_Section):
    enabled: bool = True
    save_every_n_epochs: int = Field(default=1, ge=1)
    keep_last_k: int = Field(default=3, ge=1)
    save_best: bool = True
    save_latest: bool = True  # latest.pt at every epoch end, so any kill leaves a recent resume point
    monitor: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    background: bool = True  # write on a writer thread while the next epoch trains; committed when durable


class TensorBoardConfig(_Section):
    enabled: bool = False  # event files in <run dir>/tensorboard (needs the tensorboard extra)


class WandbConfig(_Section):
    enabled: bool = False
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str | None = None
    tags: list[str] = Field(default_factory=list)


class Toggle(_Section):
    enabled: bool = True


class GradientMonitorOptions(_Section):
    enabled: bool = True
    warn_threshold: float = Field(default=1e4, gt=0)


class OverfitOptions(_Section):
    enabled: bool = True
    warmup_epochs: int = Field(default=5, ge=0)
    window_size: int = Field(default=5, ge=1)


class ExtraCallback(_Section):
    target: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CallbacksConfig(_Section):
    nan_detection: Toggle = Field(default_factory=Toggle)
    optimizer_mode: Toggle = Field(default_factory=Toggle)
    gradient_monitor: GradientMonitorOptions = Field(default_factory=GradientMonitorOptions)
    loss_prediction: Toggle = Field(default_factory=Toggle)
    overfit_detection: OverfitOptions = Field(default_factory=OverfitOptions)
    extra: list[ExtraCallback] = Field(default_factory=list)


class GradClipConfig(_Section):
    max_norm: float | None = Field(default=None, gt=0)
    max_value: float | None = Field(default=None, gt=0)
    norm_type: float = 2.0

    @model_validator(mode="after")
    def _one_limit(self) -> GradClipConfig:
        if self.max_norm is None and self.max_value is None:
            raise ValueError("set max_norm or max_value (or grad_clip: null to disable clipping)")
        return self


_SCALAR_CHOICE = (type(None), bool, int, float, str)
_STUDY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SearchParam(_Section):
    """One hyper-parameter of a study, keyed in ``search_space`` by the config path it sets
    (``optimizer_config.lr``): ``float`` / ``int`` from ``low`` to ``high`` (``log`` or ``step``
    optional), or ``categorical`` over ``choices``."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(default=None, gt=0)
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _complete(self) -> SearchParam:
        # Each message is what was expected; the schema tier adds the path and what was found.
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a non-empty 'choices' list for a categorical parameter")
            if any(not isinstance(c, _SCALAR_CHOICE) for c in self.choices):
                raise ValueError("choices that are null, booleans, numbers or strings (Optuna stores them)")
            if len({repr(c) for c in self.choices}) != len(self.choices):
                raise ValueError("each choice once")
            if self.low is not None or self.high is not None or self.step is not None or self.log:
                raise ValueError("only 'choices' for a categorical parameter (no low, high, step or log)")
            return self
        if self.choices is not None:
            raise ValueError(f"low and high for a {self.type} parameter, not 'choices'")
        if self.low is None or self.high is None:
            raise ValueError(f"both low and high for a {self.type} parameter")
        if self.low > self.high:
            raise ValueError("low <= high")
        if self.log and self.step is not None:
            raise ValueError("log or step, not both (Optuna samples a log range without steps)")
        if self.type == "int":
            if any(v is not None and float(v) != int(v) for v in (self.low, self.high, self.step)):
                raise ValueError("whole numbers for low, high and step of an int parameter")
            if self.log and self.low < 1:
                raise ValueError("low >= 1 for a log-scale int parameter")
        elif self.log and self.low <= 0:
            raise ValueError("low > 0 for a log-scale float parameter")
        return self

    def probe_values(self) -> list[Any]:
        """Values that must all make a valid config: both ends of a range, or every choice."""
        if self.type == "categorical":
            return list(self.choices or [])
        ends = [self.low, self.high]
        return [int(v) for v in ends if v is not None] if self.type == "int" else ends


class OptimizeConfig(_Section):
    """The ``optimize:`` section read by ``fsmtrain hpo`` (``fsmtrain train`` trains the config once)."""

    study_name: str | None = None
    storage: str | None = None
    n_trials: int = Field(default=20, ge=1)
    timeout: float | None = Field(default=None, gt=0)
    direction: Literal["minimize", "maximize"] = "minimize"
    sampler: str = "optuna.samplers.TPESampler"
    sampler_config: dict[str, Any] = Field(default_factory=dict)
    pruner: str = "optuna.pruners.MedianPruner"
    pruner_config: dict[str, Any] = Field(default_factory=dict)
    search_space: dict[str, SearchParam] = Field(default_factory=dict)
    # a trial averages the run objective over the first n_seeds of `seeds` (default: all of them)
    n_seeds: int | None = Field(default=None, ge=1)
    # RDB storages (PostgreSQL, SQLite): a trial whose worker stops beating for grace_period seconds
    # is failed and re-enqueued, at most max_retry times
    heartbeat_interval: int = Field(default=60, ge=1)
    grace_period: int | None = Field(default=None, ge=1)
    max_retry: int = Field(default=3, ge=0)

    @field_validator("study_name")
    @classmethod
    def _study_name(cls, v: str | None) -> str | None:
        if v is not None and not _STUDY_NAME_RE.match(v):
            raise ValueError("a study name that is one folder name: letters, digits, '.', '_', '-'")
        return v


_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


class DistributedConfig(_Section):
    """Multi-process runs (``torchrun`` or ``fsmtrain train --nproc N``); one process ignores it."""

    backend: Literal["gloo", "nccl"] | None = None  # default: gloo on CPU, nccl on CUDA
    timeout_s: float = Field(default=1800.0, gt=0)  # how long a collective waits for a slow rank


class RunConfig(_Section):
    project: str = Field(default="fsmtrain", min_length=1)
    name: str | None = None
    device: str = "cpu"
    seeds: list[int] = Field(default_factory=lambda: [0])
    net: str
    net_config: dict[str, Any] = Field(default_factory=dict)
    optimizer: str = "torch.optim.Adam"
    optimizer_config: dict[str, Any] = Field(default_factory=dict)
    scheduler: str | None = None
    scheduler_config: dict[str, Any] = Field(default_factory=dict)
    criterion: str = "torch.nn.MSELoss"
    criterion_config: dict[str, Any] = Field(default_factory=dict)
    data: str
    data_config: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, str] = Field(default_factory=dict)
    epochs: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    callbacks: CallbacksConfig = Field(default_factory=CallbacksConfig)
    grad_clip: GradClipConfig | None = None
    grad_accumulation: int = Field(default=1, ge=1)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # small models on shared CPUs run much faster single-threaded (no spinning intra-op workers)
    num_threads: int | None = Field(default=None, ge=1)
    optimize: OptimizeConfig | None = None
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    precision: Literal["32", "bf16-mixed", "16-mixed"] = "32"  # autocast (and fp16 loss scaling)
    compile: bool = False  # torch.compile the training forward

    _warnings: list[ConfigProblem] = PrivateAttr(default_factory=list)
    _source: str | None = PrivateAttr(default=None)  # the file it was read from
    _overrides: tuple[str, ...] = PrivateAttr(default=())  # the --set items applied to it

    def source_of(self, path: str) -> str | None:
        """Where the value at ``path`` came from: ``--set <item>`` if an override wrote it, else the file."""
        item = _override_of(path, self._overrides)
        return f"--set {item}" if item is not None else self._source

    @property
    def source(self) -> str | None:
        return self._source

    def __eq__(self, other: object) -> bool:
        """Equal settings (where they were read from is not part of a config's value)."""
        return isinstance(other, RunConfig) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    @property
    def warnings(self) -> list[ConfigProblem]:
        """Semantic-tier findings: legal, but probably not what was meant."""
        return list(self._warnings)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v: Any) -> Any:
        return "32" if v == 32 and type(v) is int else v  # `precision: 32` in YAML is a number

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("a non-empty list of seeds")
        dupes = sorted({s for s in v if v.count(s) > 1})
        if dupes:
            raise ValueError(f"unique seeds; {dupes} repeated")
        return v

    @field_validator("project", "name")
    @classmethod
    def _one_path_component(cls, v: str | None) -> str | None:
        # Run directories are runs/<project>/<name>-seed<s>: neither may climb out of that folder.
        if v is not None and (v in (".", "..") or "/" in v or "\\" in v or "\x00" in v):
            raise ValueError(f"a single folder name (no '/', '\\', '.' or '..'), got {v!r}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError("one of cpu, cuda, cuda:N, mps")
        return v


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _annotation_at(model: type[BaseModel], loc: Sequence[int | str]) -> tuple[type[BaseModel] | None, Any]:
    """Walk ``loc`` through the schema: (the model that owns the last key, the annotation there)."""
    owner: type[BaseModel] | None = model
    ann: Any = model
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            owner = ann
            field = ann.model_fields.get(str(part))
            if field is None:
                return owner, None
            ann = field.annotation
        elif get_origin(ann) in (list, dict):
            owner = None
            ann = get_args(ann)[-1] if get_args(ann) else Any
        else:
            return None, None
    return owner, _unwrap(ann)


def _schema_problems(err: ValidationError) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = ".".join(str(p) for p in loc)
        kind = e["type"]
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Input should be ")
        found = repr(e["input"])
        suggestion: str | None = None
        if kind == "extra_forbidden":
            _, section = _annotation_at(RunConfig, loc[:-1])
            is_model = isinstance(section, type) and issubclass(section, BaseModel)
            known = list(section.model_fields) if is_model else []
            close = _closest(str(loc[-1]), known)
            problems.append(ConfigProblem(
                path, f"a known key{' of ' + '.'.join(map(str, loc[:-1])) if loc[:-1] else ''}",
                f"unknown key {str(loc[-1])!r}", close,
            ))
            continue
        if kind == "missing":
            problems.append(ConfigProblem(path, "a value (this key is required)", "nothing"))
            continue
        if kind == "literal_error":
            _, ann = _annotation_at(RunConfig, loc)
            options = [str(a) for a in get_args(ann)] if get_origin(ann) is Literal else []
            suggestion = _closest(str(e["input"]), options)
        problems.append(ConfigProblem(path, msg, found, suggestion))
    return problems


# --- resolution ------------------------------------------------------------------------------
class Kind(str, Enum):
    MODEL = "a torch.nn.Module subclass"
    OPTIMIZER = "a torch.optim.Optimizer subclass"
    SCHEDULER = "an LR scheduler class (torch.optim.lr_scheduler.LRScheduler or ReduceLROnPlateau)"
    LOSS = "a loss: an nn.Module subclass or a function (output, target) -> tensor"
    DATA = "a data builder function (batch_size=, seed=, **data_config) -> (train, val)"
    METRIC = "a metric function (output, target) -> 0-d tensor"
    CALLBACK = "a TrainingCallback subclass"


class _ResolveError(Exception):
    def __init__(self, found: str, suggestion: str | None = None) -> None:
        super().__init__(found)
        self.found = found
        self.suggestion = suggestion


def _names_in(obj: Any) -> list[str]:
    names = [n for n in dir(obj) if not n.startswith("_")]
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        names += [m.name for m in pkgutil.iter_modules(obj.__path__)]
    return names


def _import_dotted(path: str) -> Any:
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise _ResolveError(f"{path!r}, which is not a dotted import path like torch.optim.Adam")
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            raise _ResolveError(f"importing {modname} failed: {exc}") from None
        except Exception as exc:  # a broken user module is reported, not raised
            raise _ResolveError(f"importing {modname} failed: {type(exc).__name__}: {exc}") from None
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
            close = _closest(attr, _names_in(obj))
            fixed = ".".join([prefix, close, *parts[j + 1 :]]) if close else None
            raise _ResolveError(f"{prefix} has no attribute {attr!r}", fixed)
        return obj
    # What the user could have meant: their own modules and installed packages, not the stdlib's.
    top = sorted({m.name for m in pkgutil.iter_modules()
                  if m.name not in sys.stdlib_module_names and not m.name.startswith("_")})
    close = _closest(parts[0], top)
    raise _ResolveError(f"no module named {parts[0]!r}", ".".join([close, *parts[1:]]) if close else None)


def resolve_dotted(path: str) -> Any:
    """Import ``package.module.Name``; raises ``ConfigError`` (with a close match) when it does not exist."""
    try:
        return _import_dotted(path)
    except _ResolveError as exc:
        raise ConfigError([ConfigProblem(path, "an importable dotted path", exc.found, exc.suggestion)]) from None


def _is_kind(obj: Any, kind: Kind) -> bool:
    import torch
    from torch import nn

    cls = obj if inspect.isclass(obj) else None
    if kind is Kind.MODEL:
        return cls is not None and issubclass(cls, nn.Module)
    if kind is Kind.OPTIMIZER:
        return cls is not None and issubclass(cls, torch.optim.Optimizer)
    if kind is Kind.SCHEDULER:
        sched = torch.optim.lr_scheduler
        return cls is not None and issubclass(cls, (sched.LRScheduler, sched.ReduceLROnPlateau))
    if kind is Kind.LOSS:
        return (cls is not None and issubclass(cls, nn.Module)) or (cls is None and callable(obj))
    if kind is Kind.CALLBACK:
        return cls is not None and issubclass(cls, TrainingCallback)
    return cls is None and callable(obj)  # DATA, METRIC: plain functions


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if callable(obj):
        return f"function {getattr(obj, '__qualname__', obj)!r}"
    return f"a {type(obj).__name__} object"


def _kwarg_problems(
    obj: Any, kwargs: Mapping[str, Any], cfg_path: str, positional: int, supplied: Sequence[str] = ()
) -> list[ConfigProblem]:
    """Check ``kwargs`` against ``obj``'s signature (after ``positional`` leading arguments)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []  # builtins without a signature: the call itself will tell
    return _signature_problems(sig, _describe(obj), kwargs, cfg_path, positional, supplied)


def _signature_problems(
    sig: inspect.Signature, what: str, kwargs: Mapping[str, Any], cfg_path: str, positional: int,
    supplied: Sequence[str] = (),
) -> list[ConfigProblem]:
    params = list(sig.parameters.values())
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    skip = 0
    rest = []
    for p in params:
        if skip < positional and p.kind in positional_kinds:
            skip += 1
            continue
        rest.append(p)
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
                f"unknown argument {key!r}", _closest(str(key), list(named)),
            ))
    for name, p in named.items():
        if p.default is inspect.Parameter.empty and name not in kwargs and name not in supplied:
            problems.append(ConfigProblem(
                f"{cfg_path}.{name}", f"a value for the required argument {name!r} of {what}", "nothing"))
    return problems


# (key, kwargs key, kind, default, leading positional args, names filled in by fsmtrain)
_TARGETS: tuple[tuple[str, str, Kind, str | None, int, tuple[str, ...]], ...] = (
    ("net", "net_config", Kind.MODEL, None, 0, ()),
    ("optimizer", "optimizer_config", Kind.OPTIMIZER, "torch.optim.Adam", 1, ()),
    ("scheduler", "scheduler_config", Kind.SCHEDULER, None, 1, ()),
    ("criterion", "criterion_config", Kind.LOSS, "torch.nn.MSELoss", 0, ()),
    ("data", "data_config", Kind.DATA, None, 0, ("batch_size", "seed")),
)


# fsmtrain's own dependencies and fsmtrain itself: `train` imports them anyway, so reading their
# source is enough for validate. A user's module is imported for real (that it imports is checked).
_READ_FROM_SOURCE = frozenset({"torch", "pytorch_optimizer", "pipeline", "callbacks"})
# _is_kind's issubclass checks, as the qualified names static_lookup gives a class's bases.
_KIND_BASES: dict[Kind, frozenset[str]] = {
    Kind.MODEL: frozenset({"torch.nn.modules.module.Module"}),
    Kind.OPTIMIZER: frozenset({"torch.optim.optimizer.Optimizer"}),
    Kind.SCHEDULER: frozenset({"torch.optim.lr_scheduler.LRScheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau"}),
    Kind.LOSS: frozenset({"torch.nn.modules.module.Module"}),
    Kind.CALLBACK: frozenset({"pipeline.core.hooks.TrainingCallback"}),
}
_FUNCTION_KINDS = frozenset({Kind.LOSS, Kind.DATA, Kind.METRIC})


def _fine_from_source(
    value: str, kind: Kind, kwargs: Any, kwargs_path: str | None, positional: int, supplied: Sequence[str],
) -> bool:
    """True when the source alone shows ``value`` is ``kind`` and ``kwargs`` fit its signature.
    False means "import it": the import path then finds, and words, any problem."""
    if value.partition(".")[0] not in _READ_FROM_SOURCE:
        return False
    try:
        found = static_lookup.lookup(value)
    except static_lookup.Undecided:
        return False
    is_kind = (not _KIND_BASES.get(kind, frozenset()).isdisjoint(found.lineage) if found.is_class
               else kind in _FUNCTION_KINDS)
    if not is_kind:
        return False
    if kwargs_path is None or not isinstance(kwargs, Mapping):
        return True
    return not _signature_problems(found.signature, found.qualname, kwargs, kwargs_path, positional, supplied)


def _check_target(
    path: str, value: Any, kind: Kind, kwargs: Any, kwargs_path: str | None, positional: int,
    supplied: Sequence[str] = (),
) -> list[ConfigProblem]:
    if not isinstance(value, str):
        return []  # the schema tier reports the type
    if _fine_from_source(value, kind, kwargs, kwargs_path, positional, supplied):
        return []
    try:
        obj = _import_dotted(value)
    except _ResolveError as exc:
        return [ConfigProblem(path, f"an importable dotted path to {kind.value}", exc.found, exc.suggestion)]
    if not _is_kind(obj, kind):
        return [ConfigProblem(path, kind.value, f"{value} is {_describe(obj)}")]
    if kwargs_path is None or not isinstance(kwargs, Mapping):
        return []
    # signature(cls) is the constructor without self
    return _kwarg_problems(obj, kwargs, kwargs_path, positional, supplied)


def _resolution_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    for key, cfg_key, kind, default, positional, supplied in _TARGETS:
        value = data.get(key, default)
        if value is None:
            continue
        problems += _check_target(key, value, kind, data.get(cfg_key, {}), cfg_key, positional, supplied)
    metrics = data.get("metrics")
    if isinstance(metrics, Mapping):
        for name, target in metrics.items():
            problems += _check_target(f"metrics.{name}", target, Kind.METRIC, None, None, 0)
    callbacks = data.get("callbacks")
    extra = callbacks.get("extra") if isinstance(callbacks, Mapping) else None
    if isinstance(extra, list):
        for i, item in enumerate(extra):
            if isinstance(item, Mapping):
                problems += _check_target(
                    f"callbacks.extra.{i}.target", item.get("target"), Kind.CALLBACK,
                    item.get("kwargs", {}), f"callbacks.extra.{i}.kwargs", 0)
    device = data.get("device", "cpu")
    if not isinstance(device, str) or not (device.startswith("cuda") or device == "mps"):
        return problems  # the CPU is always there: no need to ask torch
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(ConfigProblem("device", "a device this machine has (no CUDA GPU is visible)", repr(device),
                                      "cpu"))
    if device == "mps" and not torch.backends.mps.is_available():
        problems.append(ConfigProblem("device", "a device this machine has (MPS is not available)", repr(device),
                                      "cpu"))
    return problems


# --- the optimize section: sampler, pruner, search space ------------------------------------------
_PART_MODULES = {"sampler": "optuna.samplers", "pruner": "optuna.pruners"}
_OWN_PARTS = {"PredictedFinalLossPruner": "pipeline.app.hpo_pruner.PredictedFinalLossPruner"}
_PART_KIND = {
    "sampler": "an Optuna sampler class (optuna.samplers.BaseSampler subclass, e.g. optuna.samplers.TPESampler)",
    "pruner": "an Optuna pruner class (optuna.pruners.BasePruner subclass, e.g. optuna.pruners.MedianPruner)",
}


def _part_path(name: str, part: str) -> str:
    """A bare class name (``TPESampler``, ``PredictedFinalLossPruner``) is looked up where it lives."""
    if "." in name:
        return name
    return _OWN_PARTS.get(name, f"{_PART_MODULES[part]}.{name}")


def _study_part_class(name: str, part: str) -> Any:
    """The sampler or pruner class ``name`` names; raises ``_ResolveError``."""
    import optuna

    obj = _import_dotted(_part_path(name, part))
    base = optuna.samplers.BaseSampler if part == "sampler" else optuna.pruners.BasePruner
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise _ResolveError(f"{name} is {_describe(obj)}")
    return obj


def _nested(value: Any) -> Any:
    """``{target: dotted.Class, kwargs: {...}}`` inside sampler/pruner kwargs builds that object
    (``PatientPruner(wrapped_pruner=...)``); everything else passes through."""
    if isinstance(value, Mapping) and "target" in value and set(value) <= {"target", "kwargs"}:
        return resolve_dotted(str(value["target"]))(**{k: _nested(v) for k, v in dict(value.get("kwargs", {})).items()})
    return value


def _grid_space(opt: OptimizeConfig) -> dict[str, list[Any]]:
    return {path: list(p.choices or []) for path, p in opt.search_space.items() if p.type == "categorical"}


def _is_grid(cls: Any) -> bool:
    import optuna

    return inspect.isclass(cls) and issubclass(cls, optuna.samplers.GridSampler)


def build_sampler(opt: OptimizeConfig, *, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The configured sampler. ``GridSampler`` gets its grid from the categorical parameters unless
    ``sampler_config.search_space`` is given; worker ``k`` of a study adds ``k`` to a ``seed`` so
    parallel workers do not propose the same parameters."""
    try:
        cls = _study_part_class(opt.sampler, "sampler")
    except _ResolveError as exc:
        raise ConfigError([ConfigProblem("optimize.sampler", _PART_KIND["sampler"], exc.found,
                                         exc.suggestion)]) from None
    kwargs = {k: _nested(v) for k, v in opt.sampler_config.items()}
    if _is_grid(cls) and "search_space" not in kwargs:
        kwargs["search_space"] = _grid_space(opt)
    if seed_offset and isinstance(kwargs.get("seed"), int):
        kwargs["seed"] += seed_offset
    return cast("optuna.samplers.BaseSampler", cls(**kwargs))


def build_pruner(opt: OptimizeConfig) -> optuna.pruners.BasePruner:
    try:
        cls = _study_part_class(opt.pruner, "pruner")
    except _ResolveError as exc:
        raise ConfigError([ConfigProblem("optimize.pruner", _PART_KIND["pruner"], exc.found,
                                         exc.suggestion)]) from None
    return cast("optuna.pruners.BasePruner", cls(**{k: _nested(v) for k, v in opt.pruner_config.items()}))


def _related(problem_path: str, path: str) -> bool:
    return problem_path == path or problem_path.startswith(path + ".") or path.startswith(problem_path + ".")


def _with_value(data: Mapping[str, Any], parts: Sequence[str], value: Any) -> dict[str, Any] | str:
    """A copy of ``data`` with ``value`` at the path ``parts``; a string says why it cannot be set."""
    out = copy.deepcopy(dict(data))
    node: Any = out
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return f"{'.'.join(parts[: depth + 1])} is a {type(child).__name__}, not a mapping"
        node = child
    node[parts[-1]] = value
    return out


def trial_data(data: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The config mapping of one trial: ``data`` without its ``optimize`` section, each
    ``params`` value set at its path (``{"optimizer_config.lr": 0.01}``)."""
    out: dict[str, Any] = {k: v for k, v in data.items() if k != "optimize"}
    for path, value in params.items():
        probe = _with_value(out, path.split("."), value)
        if isinstance(probe, str):
            raise ConfigError([ConfigProblem(f"optimize.search_space.{path}", "a config path that can be set", probe)])
        out = probe
    return out


def _search_space_problems(data: Mapping[str, Any], space: Mapping[str, Any]) -> list[ConfigProblem]:
    """Each search-space path, set to both ends of its range (or each choice), must give a config
    that passes the schema and resolution tiers; what fails there is reported at the search path."""
    base = {k: v for k, v in data.items() if k != "optimize"}
    found: dict[str, ConfigProblem] = {}
    for path, spec in space.items():
        where = f"optimize.search_space.{path}"
        parts = str(path).split(".")
        if not all(parts) or parts[0] == "optimize":
            found[where] = ConfigProblem(where, "a dotted config path such as optimizer_config.lr", repr(path))
            continue
        try:
            param = SearchParam.model_validate(spec)
        except ValidationError:
            continue  # the schema tier reports it
        for value in param.probe_values():
            probe = _with_value(base, parts, value)
            if isinstance(probe, str):
                found[where] = ConfigProblem(where, "a config path that can be set", probe)
                break
            problems: list[ConfigProblem] = []
            try:
                RunConfig.model_validate(probe)
            except ValidationError as exc:
                problems += _schema_problems(exc)
            problems += _resolution_problems(probe)
            for p in problems:
                if not _related(p.path, str(path)):
                    continue
                fix = p.suggestion
                if fix and p.found.startswith(("unknown key", "unknown argument")):
                    fix = ".".join([*p.path.split(".")[:-1], fix])
                at = "" if p.path == path else f" at {p.path}"
                found.setdefault(where, ConfigProblem(where, f"{p.expected}{at} (for {value!r})", p.found, fix))
    return list(found.values())


def _optimize_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    opt = data.get("optimize")
    if not isinstance(opt, Mapping):
        return []
    problems: list[ConfigProblem] = []
    parts: dict[str, Any] = {}
    for part, default in (("sampler", "optuna.samplers.TPESampler"), ("pruner", "optuna.pruners.MedianPruner")):
        name, kwargs = opt.get(part, default), opt.get(f"{part}_config", {})
        if not isinstance(name, str):
            continue
        try:
            parts[part] = cls = _study_part_class(name, part)
        except _ResolveError as exc:
            problems.append(ConfigProblem(f"optimize.{part}", _PART_KIND[part], exc.found, exc.suggestion))
            continue
        if isinstance(kwargs, Mapping):
            supplied = ("search_space",) if part == "sampler" and _is_grid(cls) else ()
            problems += _kwarg_problems(cls, kwargs, f"optimize.{part}_config", 0, supplied)
    space = opt.get("search_space", {})
    if isinstance(space, Mapping):
        if not space:
            problems.append(ConfigProblem("optimize.search_space", "at least one parameter to search", "none"))
        problems += _search_space_problems(data, space)
        grid = parts.get("sampler")
        sampler_config = opt.get("sampler_config", {})
        if grid is not None and _is_grid(grid) and isinstance(sampler_config, Mapping) \
                and "search_space" not in sampler_config:
            for path, spec in space.items():
                if isinstance(spec, Mapping) and spec.get("type") != "categorical":
                    problems.append(ConfigProblem(
                        f"optimize.search_space.{path}",
                        "a categorical parameter (GridSampler builds its grid from the choices)",
                        f"type {spec.get('type')!r}"))
    seeds, n_seeds = data.get("seeds", [0]), opt.get("n_seeds")
    if isinstance(seeds, list) and type(n_seeds) is int and n_seeds > len(seeds):
        problems.append(ConfigProblem("optimize.n_seeds", f"at most the {len(seeds)} seed(s) listed in seeds",
                                      str(n_seeds)))
    return problems


def _optimize_build_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """Construct the sampler and pruner once: their constructors check more than a signature can."""
    opt = cfg.optimize
    if opt is None:
        return []
    problems: list[ConfigProblem] = []
    for part, build in (("sampler", lambda: build_sampler(opt)), ("pruner", lambda: build_pruner(opt))):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for GP, QMC, Wilcoxon...
                build()
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:
            name = getattr(opt, part)
            problems.append(ConfigProblem(f"optimize.{part}_config", f"arguments {name} accepts",
                                          f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
    return problems


def _semantic_warnings(cfg: RunConfig) -> list[ConfigProblem]:
    found: list[ConfigProblem] = []
    es = cfg.early_stopping
    if es.enabled and es.patience >= cfg.epochs:
        found.append(ConfigProblem(
            "early_stopping.patience", f"patience < epochs ({cfg.epochs}) for early stopping to ever fire",
            str(es.patience)))
    if cfg.scheduler and cfg.scheduler.endswith("CosineAnnealingLR"):
        t_max = cfg.scheduler_config.get("T_max")
        if t_max != cfg.epochs:
            found.append(ConfigProblem(
                "scheduler_config.T_max", f"T_max == epochs ({cfg.epochs}) so the cosine ends with training",
                repr(t_max)))
    known = {"val_loss", "train_loss", *cfg.metrics}
    for path, monitor, on in (
        ("early_stopping.monitor", es.monitor, es.enabled),
        ("checkpoint.monitor", cfg.checkpoint.monitor, cfg.checkpoint.enabled and cfg.checkpoint.save_best),
    ):
        if on and monitor not in known:
            found.append(ConfigProblem(path, f"a metric the run reports: {', '.join(sorted(known))}",
                                       repr(monitor), _closest(monitor, sorted(known))))
    if cfg.wandb.enabled and cfg.wandb.mode == "online":
        found.append(ConfigProblem("wandb.mode", "offline unless this machine can reach W&B", "'online'"))
    return found


def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> RunConfig:
    """Validate an already-loaded mapping through every tier; raise ``ConfigError`` listing all problems."""
    if not isinstance(data, Mapping):
        raise ConfigError([ConfigProblem("", "a mapping of config keys", type(data).__name__)], source)
    problems: list[ConfigProblem] = []
    cfg: RunConfig | None = None
    try:
        cfg = RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems += _schema_problems(exc)
    problems += _resolution_problems(data)
    problems += _optimize_problems(data)
    if not problems and cfg is not None:
        problems += _optimize_build_problems(cfg)
    if problems or cfg is None:
        raise ConfigError(problems, source)
    cfg._warnings = _semantic_warnings(cfg)
    cfg._source = source
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path``, apply ``--set`` style overrides, validate through every tier. The working
    folder and the config's folder become importable first (dotted paths such as ``mydata.build``).
    A mistake that only an override made is blamed on that ``--set``, not on the file."""
    add_user_folders(Path(path).parent)
    data = load_yaml(path)
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        cfg = config_from_dict(data, str(path))
        cfg._overrides = tuple(overrides)
        return cfg
    except ConfigError as exc:
        blamed = {_override_of(p.path, overrides) for p in exc.problems}
        if len(blamed) == 1 and None not in blamed:
            raise ConfigError(exc.problems, f"--set {blamed.pop()}") from None
        raise


def _override_of(path: str, overrides: Sequence[str]) -> str | None:
    """The ``--set`` that wrote the value at ``path`` (or above it), if one did."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if key and (path == key or path.startswith(key + ".")):
            return item
    return None


def add_user_folders(config_dir: Path | None = None) -> None:
    """Make the working folder and the config's folder importable, as ``python -m`` makes the
    working folder: a user's ``mydata.py`` beside the config resolves from every entry point."""
    for folder in (Path.cwd(), config_dir):
        if folder is None:
            continue
        text = str(folder.resolve())
        if text not in sys.path:
            sys.path.insert(0, text)
        importlib.invalidate_caches()


def resolved_dict(cfg: RunConfig) -> dict[str, Any]:
    """Every field with defaults filled in, JSON/YAML-safe: what a run's ``config.yaml`` holds."""
    return cfg.model_dump(mode="json")


# --- builders --------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch so model init and dropout repeat for the same seed."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: RunConfig) -> nn.Module:
    from torch import nn

    model = resolve_dotted(cfg.net)(**cfg.net_config)
    if not isinstance(model, nn.Module):
        raise ConfigError([ConfigProblem("net", Kind.MODEL.value, f"{cfg.net} built a {type(model).__name__}")])
    return model


def build_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    import torch

    opt = resolve_dotted(cfg.optimizer)(params, **cfg.optimizer_config)
    assert isinstance(opt, torch.optim.Optimizer)
    return opt


def build_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler is None:
        return None
    return resolve_dotted(cfg.scheduler)(optimizer, **cfg.scheduler_config)


def build_criterion(cfg: RunConfig) -> Callable[[Any, Any], torch.Tensor]:
    obj = resolve_dotted(cfg.criterion)
    if inspect.isclass(obj):
        return cast("Callable[[Any, Any], torch.Tensor]", obj(**cfg.criterion_config))
    fn = partial(obj, **cfg.criterion_config) if cfg.criterion_config else obj
    return cast("Callable[[Any, Any], torch.Tensor]", fn)


def build_data(cfg: RunConfig, seed: int) -> tuple[Any, Any]:
    """Call the data builder; wrap datasets it returns in seeded loaders. Returns (train, val)."""
    from torch.utils.data import DataLoader

    from pipeline.training.data import make_loaders

    out = resolve_dotted(cfg.data)(batch_size=cfg.batch_size, seed=seed, **cfg.data_config)
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError([ConfigProblem("data", "a builder returning (train, val)", type(out).__name__)])
    train, val = out
    if not isinstance(train, DataLoader) and hasattr(train, "__getitem__"):
        return tuple(make_loaders(train, val, batch_size=cfg.batch_size, seed=seed))  # type: ignore[return-value]
    return train, val


def build_metrics(cfg: RunConfig) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    return {name: resolve_dotted(path) for name, path in cfg.metrics.items()}


def build_callbacks(
    cfg: RunConfig, *, run_dir: Path | None, trial: optuna.trial.Trial | Any | None = None
) -> list[TrainingCallback]:
    """The default callback list: the nine built-ins as configured, then clipping/accumulation, then
    the user's extra callbacks (the runner orders them all by priority).

    ``trial`` is an Optuna trial, or anything with its ``report``/``should_prune`` (replay passes a
    recorded one); the pruner joins only when it is given."""
    import callbacks as cb

    c = cfg.callbacks
    out: list[TrainingCallback] = []
    if c.nan_detection.enabled:
        out.append(cb.NaNDetectionCallback())
    if c.optimizer_mode.enabled:
        out.append(cb.OptimizerModeCallback())
    if c.gradient_monitor.enabled:
        out.append(cb.GradientMonitorCallback(warn_threshold=c.gradient_monitor.warn_threshold))
    if c.loss_prediction.enabled:
        out.append(cb.LossPredictionCallback(max_epochs=cfg.epochs))
    if c.overfit_detection.enabled:
        out.append(cb.OverfitDetectionCallback(
            warmup_epochs=c.overfit_detection.warmup_epochs, window_size=c.overfit_detection.window_size))
    if cfg.wandb.enabled:
        out.append(cb.WandbLoggingCallback(
            project=cfg.wandb.project or cfg.project, mode=cfg.wandb.mode, tags=tuple(cfg.wandb.tags),
            config=resolved_dict(cfg), directory=run_dir,  # wandb adds its own wandb/ folder
            name=None if run_dir is None else run_dir.name,
        ))
    if cfg.tensorboard.enabled and run_dir is not None:
        out.append(cb.TensorBoardLoggingCallback(run_dir / "tensorboard"))
    if trial is not None:
        out.append(cb.PrunerCallback(trial))
    es = cfg.early_stopping
    if es.enabled:
        out.append(cb.EarlyStoppingCallback(
            patience=es.patience, mode=es.mode, min_delta=es.min_delta, monitor=es.monitor))
    if run_dir is not None:
        out.append(cb.MetricsCsvCallback(run_dir / "metrics.csv"))
    ck = cfg.checkpoint
    if ck.enabled and run_dir is not None:
        out.append(cb.CheckpointCallback(
            run_dir / "checkpoints", save_every_n_epochs=ck.save_every_n_epochs, keep_last_k=ck.keep_last_k,
            save_best=ck.save_best, monitor=ck.monitor, mode=ck.mode, save_latest=ck.save_latest,
            background=ck.background,
        ))
    if cfg.grad_clip is not None:
        gc = cfg.grad_clip
        out.append(cb.GradientClippingCallback(max_norm=gc.max_norm, max_value=gc.max_value, norm_type=gc.norm_type))
    if cfg.grad_accumulation > 1:
        out.append(cb.GradientAccumulationCallback(steps=cfg.grad_accumulation))
    for extra in c.extra:
        out.append(resolve_dotted(extra.target)(**extra.kwargs))
    return out
