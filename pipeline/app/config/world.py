"""Config loading for every command: every tier at once, with the config's folder, the folders the run
recorded and the working folder on the import path, so its dotted paths import the same from anywhere."""

from __future__ import annotations

import importlib
import site
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsmtrain.app.config.loading import apply_overrides, load_yaml, override_of
from fsmtrain.app.config.optimize import optimize_build_problems, optimize_problems
from fsmtrain.app.config.problems import ConfigError, ConfigProblem, closest, config_error
from fsmtrain.app.config.resolution import checked
from fsmtrain.app.config.schema import RunConfig
from fsmtrain.core.events import EVENTS_FILE, first_run_start

__all__ = [
    "RECORDED_FOLDERS", "config_from_dict", "enter_user_world", "load_config", "load_config_and_data",
    "load_recorded_config", "load_run_config", "user_folders",
]

RECORDED_FOLDERS = "user_folders"
"""The ``run_start`` key that lists the folders a run's own modules were imported from."""


def _semantic_warnings(cfg: RunConfig) -> list[ConfigProblem]:
    found: list[ConfigProblem] = []
    es = cfg.early_stopping
    # the default patience too: early stopping is on by default, and one that can never fire is silent
    if es.enabled and cfg.epochs is not None and es.patience >= cfg.epochs:
        chosen = "early_stopping" in cfg.model_fields_set and "patience" in es.model_fields_set
        found.append(ConfigProblem(
            "early_stopping.patience", f"patience < epochs ({cfg.epochs}) for early stopping to ever fire",
            str(es.patience) if chosen else f"{es.patience} (the default)"))
    if cfg.scheduler and cfg.scheduler.endswith("CosineAnnealingLR"):
        t_max = cfg.scheduler_config.get("T_max")
        if t_max != cfg.epochs and cfg.epochs is not None:
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
                                       repr(monitor), closest(monitor, sorted(known))))
    if cfg.wandb.enabled and cfg.wandb.mode == "online":
        found.append(ConfigProblem("wandb.mode", "offline unless this machine can reach W&B", "'online'"))
    return found


def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> RunConfig:
    """Validate an already-loaded mapping through every tier; raise ``ConfigError`` listing all problems."""
    if not isinstance(data, Mapping):
        raise config_error("", "a mapping of config keys", type(data).__name__, source)
    cfg, problems = checked(data)
    problems += optimize_problems(data)
    if not problems and cfg is not None:
        problems += optimize_build_problems(cfg)
    if problems or cfg is None:
        raise ConfigError(problems, source)
    cfg._warnings = _semantic_warnings(cfg)
    cfg._source = source
    return cfg


def enter_user_world(config_dir: Path | None = None, recorded: Iterable[str] = ()) -> None:
    """Put the config's folder, the recorded folders and the working folder at the front of the
    import path (in that order of precedence)."""
    given = (config_dir, *(Path(f) for f in recorded), Path.cwd())
    for folder in reversed(list(dict.fromkeys(str(f.resolve()) for f in given if f is not None))):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    importlib.invalidate_caches()


def _validated(data: Mapping[str, Any], source: str, overrides: Sequence[str]) -> RunConfig:
    """Every tier; a mistake that only an override made is blamed on that ``--set``, not on the file."""
    try:
        cfg = config_from_dict(data, source)
    except ConfigError as exc:
        blamed = {override_of(p.path, overrides) for p in exc.problems}
        if overrides and len(blamed) == 1 and None not in blamed:
            raise ConfigError(exc.problems, f"--set {blamed.pop()}") from None
        raise
    cfg._overrides = tuple(overrides)
    return cfg


def load_config_and_data(path: str | Path, overrides: Sequence[str] = ()) -> tuple[RunConfig, dict[str, Any]]:
    """The config at ``path`` with ``overrides`` applied, validated, and the mapping it was made from
    (``fsmtrain hpo`` draws each trial's config from it)."""
    enter_user_world(Path(path).parent)
    data = apply_overrides(load_yaml(path), overrides)
    return _validated(data, str(path), overrides), data


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load ``path``, apply ``--set`` style overrides and validate it through every tier."""
    return load_config_and_data(path, overrides)[0]


def load_run_config(run_dir: Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The resolved ``config.yaml`` of a run, with the folders its ``run_start`` recorded importable."""
    path, log = run_dir / "config.yaml", run_dir / EVENTS_FILE
    found = ((first_run_start(log) if log.is_file() else None) or {}).get(RECORDED_FOLDERS)
    recorded = [str(f) for f in found] if isinstance(found, list) else []
    return load_recorded_config(load_yaml(path), recorded, overrides, str(path))


def load_recorded_config(data: Mapping[str, Any], recorded: Iterable[str], overrides: Sequence[str] = (),
                         source: str = "recorded by the run") -> RunConfig:
    """A config a run's log recorded (replay rebuilds the run's callbacks from it)."""
    enter_user_world(None, recorded)
    return _validated(apply_overrides(data, overrides), source, overrides)


def _dotted_paths(cfg: RunConfig) -> list[str]:
    paths = [cfg.net, cfg.optimizer, cfg.criterion, cfg.data,
             *(m if isinstance(m, str) else m.target for m in cfg.metrics.values()),
             *(extra.target for extra in cfg.callbacks.extra), *(p for p in (cfg.step, cfg.val_step) if p),
             *(o.target for o in (cfg.optimizers or {}).values()), *(s.target for s in cfg.schedulers.values())]
    if cfg.scheduler is not None:
        paths.append(cfg.scheduler)
    if cfg.optimize is not None:
        paths += [cfg.optimize.sampler, cfg.optimize.pruner]
    return paths


def _import_root(module: Any) -> Path | None:
    """The folder a top-level module was imported from (the one holding ``m.py`` or ``m/``)."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    if locations:  # a package (a namespace package has no origin)
        return Path(locations[0]).parent.resolve()
    if isinstance(origin, str) and origin not in ("built-in", "frozen"):
        return Path(origin).parent.resolve()
    return None


def user_folders(cfg: RunConfig) -> list[str]:
    """The folders the config's own modules were imported from, outside fsmtrain and the installed
    packages (``run_start`` records them)."""
    paths = sysconfig.get_paths()  # the interpreter's own and installed packages: never a user's folder
    roots = [*site.getsitepackages(), site.getusersitepackages(),
             *(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)]
    installed = [Path(r).resolve() for r in roots]
    out: list[str] = []
    for path in _dotted_paths(cfg):
        top = path.split(".", 1)[0]
        module = sys.modules.get(top)
        if top == "fsmtrain" or top in sys.stdlib_module_names or module is None:
            continue
        root = _import_root(module)
        if root is None or any(root == r or r in root.parents for r in installed):
            continue
        if str(root) not in out:
            out.append(str(root))
    return out
