"""Run configs, checked in tiers (syntax, schema, dotted paths and their kwargs, semantic warnings) before
anything is created, every problem reported at once; and the builders of what a config names."""

from __future__ import annotations

from fsmtrain.app.config.builders import build_callbacks, build_optimizer, build_scheduler
from fsmtrain.app.config.loading import apply_overrides, load_yaml
from fsmtrain.app.config.optimize import build_pruner, build_sampler, trial_data
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.resolution import resolve_dotted
from fsmtrain.app.config.schema import OptimizeConfig, RunConfig, SearchParam, resolved_dict
from fsmtrain.app.config.world import config_from_dict, load_config, load_config_and_data, load_run_config

__all__ = [
    "ConfigError", "ConfigProblem", "OptimizeConfig", "RunConfig", "SearchParam", "apply_overrides",
    "build_callbacks", "build_optimizer", "build_pruner", "build_sampler", "build_scheduler", "config_from_dict",
    "load_config", "load_config_and_data", "load_run_config", "load_yaml", "resolve_dotted", "resolved_dict",
    "trial_data",
]
