"""Run configs: loading and validating one, in tiers; the public face of the ``config_*`` modules
and of :mod:`pipeline.app.config.builders` (the dotted-path builders and the default callbacks).

Validation tiers, all run before anything is created on disk, with every problem reported at once:

1. **syntax** (:mod:`~pipeline.app.config.loading`): YAML with duplicate keys rejected (with their
   lines); ``1e-3`` reads as a float.
2. **schema** (:mod:`~pipeline.app.config.schema`, pydantic): types, ranges, unknown keys (with the
   closest known key).
3. **resolution** (:mod:`~pipeline.app.config.resolution`): every dotted path imports and is the
   right kind of object, its kwargs match its signature, a requested accelerator exists; the ``optimize:``
   section's sampler, pruner and search space (:mod:`~pipeline.app.config.optimize`).
4. **semantic warnings** (here; never fatal): e.g. patience >= epochs, a cosine ``T_max`` != ``epochs``.

Resolution runs on the raw mapping, independently of the schema tier, so one error lists a
misspelt class next to a negative epoch count.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.app.config.builders import (
    build_callbacks,
    build_criterion,
    build_data,
    build_metrics,
    build_model,
    build_optimizer,
    build_scheduler,
    seed_everything,
)
from pipeline.app.config.loading import ConfigLoader, apply_overrides, load_yaml, override_of
from pipeline.app.config.optimize import (
    build_pruner,
    build_sampler,
    optimize_build_problems,
    optimize_problems,
    trial_data,
)
from pipeline.app.config.problems import ConfigError, ConfigProblem, closest
from pipeline.app.config.resolution import resolution_problems, resolve_dotted
from pipeline.app.config.schema import (
    CallbacksConfig,
    CheckpointConfig,
    EarlyStoppingConfig,
    ExtraCallback,
    GradClipConfig,
    OptimizeConfig,
    RunConfig,
    SearchParam,
    WandbConfig,
    resolved_dict,
    schema_problems,
)

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
                                       repr(monitor), closest(monitor, sorted(known))))
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
        problems += schema_problems(exc)
    problems += resolution_problems(data)
    problems += optimize_problems(data)
    if not problems and cfg is not None:
        problems += optimize_build_problems(cfg)
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
        blamed = {override_of(p.path, overrides) for p in exc.problems}
        if len(blamed) == 1 and None not in blamed:
            raise ConfigError(exc.problems, f"--set {blamed.pop()}") from None
        raise


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
