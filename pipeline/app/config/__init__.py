"""Run configs: loading and validating one, in tiers; the public face of the ``config_*`` modules
and of :mod:`fsmtrain.app.config.builders` (the dotted-path builders and the default callbacks).

Validation tiers, all run before anything is created on disk, with every problem reported at once:

1. **syntax** (:mod:`~fsmtrain.app.config.loading`): YAML with duplicate keys rejected (with their
   lines); ``1e-3`` reads as a float.
2. **schema** (:mod:`~fsmtrain.app.config.schema`, pydantic): types, ranges, unknown keys (with the
   closest known key).
3. **resolution** (:mod:`~fsmtrain.app.config.resolution`): every dotted path imports and is the
   right kind of object, its kwargs match its signature, a requested accelerator exists; the ``optimize:``
   section's sampler, pruner and search space (:mod:`~fsmtrain.app.config.optimize`).
4. **semantic warnings** (:mod:`~fsmtrain.app.config.tiers`; never fatal): e.g. a patience the user set
   >= epochs, a cosine ``T_max`` != ``epochs``.

Resolution runs on the raw mapping, independently of the schema tier, so one error lists a
misspelt class next to a negative epoch count. Every command that takes a config or a run
directory loads it through one loader of the user's world (:mod:`~fsmtrain.app.config.world`): the
config's folder, the run's recorded folders and the working folder on the import path, then every tier.
"""

from __future__ import annotations

from fsmtrain.app.config.builders import (
    build_callbacks,
    build_criterion,
    build_data,
    build_metrics,
    build_model,
    build_optimizer,
    build_scheduler,
    seed_everything,
)
from fsmtrain.app.config.loading import ConfigLoader, apply_overrides, load_yaml
from fsmtrain.app.config.optimize import build_pruner, build_sampler, trial_data
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.resolution import resolve_dotted
from fsmtrain.app.config.schema import (
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
)
from fsmtrain.app.config.tiers import config_from_dict
from fsmtrain.app.config.world import (
    RECORDED_FOLDERS,
    enter_user_world,
    load_config,
    load_config_and_data,
    load_recorded_config,
    load_run_config,
    user_folders,
)

__all__ = [
    "RECORDED_FOLDERS",
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
    "enter_user_world",
    "load_config",
    "load_config_and_data",
    "load_recorded_config",
    "load_run_config",
    "load_yaml",
    "resolve_dotted",
    "resolved_dict",
    "seed_everything",
    "trial_data",
    "user_folders",
]
