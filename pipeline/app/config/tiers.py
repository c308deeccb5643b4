"""Every tier of a config at once: schema, resolution and the ``optimize:`` section, then the
semantic warnings (never fatal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from fsmtrain.app.config.optimize import optimize_build_problems, optimize_problems
from fsmtrain.app.config.problems import ConfigError, ConfigProblem, closest, schema_problems
from fsmtrain.app.config.resolution import resolution_problems
from fsmtrain.app.config.schema import RunConfig

__all__ = ["config_from_dict"]


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
        raise ConfigError([ConfigProblem("", "a mapping of config keys", type(data).__name__)], source)
    problems: list[ConfigProblem] = []
    cfg: RunConfig | None = None
    try:
        cfg = RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems += schema_problems(exc, RunConfig)
    problems += resolution_problems(data)
    problems += optimize_problems(data)
    if not problems and cfg is not None:
        problems += optimize_build_problems(cfg)
    if problems or cfg is None:
        raise ConfigError(problems, source)
    cfg._warnings = _semantic_warnings(cfg)
    cfg._source = source
    return cfg
