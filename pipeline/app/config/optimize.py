"""The ``optimize:`` section of a run config: the study's sampler and pruner (checked, then built)
and its search space, each path of which must give a valid config at both ends of its range."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from fsmtrain.app.config.loading import set_at
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.resolution import (
    ResolveError,
    checked,
    describe,
    import_dotted,
    kwarg_problems,
    resolve_dotted,
)
from fsmtrain.app.config.schema import OptimizeConfig, RunConfig, SearchParam

if TYPE_CHECKING:
    import optuna


_PART_MODULES = {"sampler": "optuna.samplers", "pruner": "optuna.pruners"}
_OWN_PARTS = {"PredictedFinalLossPruner": "fsmtrain.app.hpo.pruner.PredictedFinalLossPruner"}
_PART_KIND = {
    "sampler": "an Optuna sampler class (optuna.samplers.BaseSampler subclass, e.g. optuna.samplers.TPESampler)",
    "pruner": "an Optuna pruner class (optuna.pruners.BasePruner subclass, e.g. optuna.pruners.MedianPruner)",
}


def _study_part_class(name: str, part: str) -> Any:
    """The sampler or pruner class ``name`` names, a bare class name (``TPESampler``,
    ``PredictedFinalLossPruner``) looked up where it lives; a ConfigError at ``optimize.<part>``."""
    import optuna
    try:
        obj = import_dotted(name if "." in name else _OWN_PARTS.get(name, f"{_PART_MODULES[part]}.{name}"))
    except ResolveError as exc:
        raise ConfigError([ConfigProblem(f"optimize.{part}", _PART_KIND[part], exc.found, exc.suggestion)]) from None
    base = optuna.samplers.BaseSampler if part == "sampler" else optuna.pruners.BasePruner
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise ConfigError([ConfigProblem(f"optimize.{part}", _PART_KIND[part], f"{name} is {describe(obj)}")])
    return obj


def _nested(value: Any) -> Any:
    """``{target: dotted.Class, kwargs: {...}}`` inside sampler/pruner kwargs builds that object
    (``PatientPruner(wrapped_pruner=...)``); everything else passes through."""
    if isinstance(value, Mapping) and "target" in value and set(value) <= {"target", "kwargs"}:
        return resolve_dotted(str(value["target"]))(**{k: _nested(v) for k, v in dict(value.get("kwargs", {})).items()})
    return value


def _is_grid(cls: Any) -> bool:
    import optuna
    return inspect.isclass(cls) and issubclass(cls, optuna.samplers.GridSampler)


def build_sampler(opt: OptimizeConfig, *, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The configured sampler (a GridSampler's grid: the categorical parameters, unless given);
    ``seed``, the one a worker claimed, replaces a configured integer seed."""
    cls = _study_part_class(opt.sampler, "sampler")
    kwargs = {k: _nested(v) for k, v in opt.sampler_config.items()}
    if _is_grid(cls) and "search_space" not in kwargs:
        kwargs["search_space"] = {path: list(p.choices or []) for path, p in opt.search_space.items()
                                  if p.type == "categorical"}
    if seed is not None and type(kwargs.get("seed")) is int:
        kwargs["seed"] = seed
    return cast("optuna.samplers.BaseSampler", cls(**kwargs))


def build_pruner(opt: OptimizeConfig) -> optuna.pruners.BasePruner:
    cls = _study_part_class(opt.pruner, "pruner")
    return cast("optuna.pruners.BasePruner", cls(**{k: _nested(v) for k, v in opt.pruner_config.items()}))


def trial_data(data: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The config mapping of one trial: a copy of ``data`` without its ``optimize`` section, each
    ``params`` value set at its path (``{"optimizer_config.lr": 0.01}``)."""
    out = copy.deepcopy({k: v for k, v in data.items() if k != "optimize"})
    for path, value in params.items():
        problem = set_at(out, path, value)
        if problem is not None:
            raise ConfigError([ConfigProblem(f"optimize.search_space.{path}", problem.expected, problem.found)])
    return out


def _search_space_problems(data: Mapping[str, Any], space: Mapping[str, Any]) -> list[ConfigProblem]:
    """Each search-space path, set to both ends of its range (or each choice), must give a config
    that passes the schema and resolution tiers; a failure is reported at the search path."""
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
            try:
                probe = trial_data(data, {str(path): value})
            except ConfigError as exc:
                found[where] = exc.problems[0]
                break
            for p in checked(probe)[1]:
                if not (p.path == path or p.path.startswith(f"{path}.") or str(path).startswith(f"{p.path}.")):
                    continue
                fix = p.suggestion
                if fix and p.found.startswith(("unknown key", "unknown argument")):
                    fix = ".".join([*p.path.split(".")[:-1], fix])
                at = "" if p.path == path else f" at {p.path}"
                found.setdefault(where, ConfigProblem(where, f"{p.expected}{at} (for {value!r})", p.found, fix))
    return list(found.values())


def optimize_problems(data: Mapping[str, Any]) -> list[ConfigProblem]:
    opt = data.get("optimize")
    if not isinstance(opt, Mapping):
        return []
    problems: list[ConfigProblem] = []
    parts: dict[str, Any] = {}
    for part in ("sampler", "pruner"):
        name, kwargs = opt.get(part, OptimizeConfig.model_fields[part].default), opt.get(f"{part}_config", {})
        if not isinstance(name, str):
            continue
        try:
            parts[part] = cls = _study_part_class(name, part)
        except ConfigError as exc:
            problems += exc.problems
            continue
        if isinstance(kwargs, Mapping):
            supplied = ("search_space",) if part == "sampler" and _is_grid(cls) else ()
            problems += kwarg_problems(cls, kwargs, f"optimize.{part}_config", 0, supplied)
    space = opt.get("search_space", {})
    if isinstance(space, Mapping):
        if not space:
            problems.append(ConfigProblem("optimize.search_space", "at least one parameter to search", "none"))
        problems += _search_space_problems(data, space)
        grid_config = opt.get("sampler_config", {})
        if _is_grid(parts.get("sampler")) and isinstance(grid_config, Mapping) and "search_space" not in grid_config:
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


def optimize_build_problems(cfg: RunConfig) -> list[ConfigProblem]:
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
