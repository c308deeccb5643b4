"""What a validated run config builds, each from its dotted path: the model, optimizer, scheduler,
loss, data, metrics and callbacks."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel

from fsmtrain.app.config.problems import ConfigError, ConfigProblem, closest
from fsmtrain.app.config.resolution import Kind, resolve_dotted
from fsmtrain.app.config.schema import CallbacksConfig, CheckpointConfig, RunConfig, resolved_dict
from fsmtrain.core.hooks import TrainingCallback

if TYPE_CHECKING:
    import optuna
    import torch
    from torch import nn

    from fsmtrain.training.optimizers import NamedOptimizers


# A constructor's rejection is blamed on the config leaf that caused it (``optimizer_config.lr``): the key
# without which the constructor accepts the rest.
def blamed(cfg: RunConfig, section: str, what: str, build: Callable[[Mapping[str, Any]], Any],
           kwargs: Mapping[str, Any], target: str | None = None) -> Any:
    """``build(kwargs)``; a rejection becomes a ConfigError at ``section.<leaf>``, or at ``target``
    (the key naming the constructor) when there were no kwargs."""
    try:
        return build(kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # a constructor's own check, whatever it raises
        leaf = _culprit(kwargs, build, exc)
        why = f"{type(exc).__name__}: {exc}".strip()
        if not kwargs and target is not None:
            problem = ConfigProblem(target, f"{what} to build with no arguments (the config gives it none in "
                                    f"{section})", f"{what}() raised {why}")
        elif leaf is None:
            problem = ConfigProblem(section, f"arguments {what} accepts", why)
        else:
            problem = ConfigProblem(f"{section}.{leaf}", f"a value {what} accepts", f"{kwargs[leaf]!r} ({why})")
        raise cfg.error([problem]) from exc


def _culprit(kwargs: Mapping[str, Any], build: Callable[[Mapping[str, Any]], Any], exc: Exception) -> str | None:
    for key in kwargs:
        try:
            build({k: v for k, v in kwargs.items() if k != key})
        except Exception:
            continue
        return key
    text = str(exc)
    return next((key for key in kwargs if key in text), None)


def built_from(cfg: RunConfig, section: str, what: str, build: Callable[[RunConfig], Any],
               target: str | None = None) -> Any:
    """``build(cfg)`` with the kwargs of ``section`` (``optimizer_config``), blamed as :func:`blamed` does."""
    return blamed(cfg, section, what, lambda kw: build(cfg.model_copy(update={section: dict(kw)})),
                  getattr(cfg, section), target)


def build_model(cfg: RunConfig) -> nn.Module:
    from torch import nn
    model = resolve_dotted(cfg.net)(**cfg.net_config)
    if not isinstance(model, nn.Module):
        raise ConfigError([ConfigProblem("net", Kind.MODEL.value, f"{cfg.net} built a {type(model).__name__}")],
                          cfg.source)
    return model


def build_optimization(cfg: RunConfig, model: nn.Module, params: Any = None) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer (or several, by name) over ``model``'s parameters, and its scheduler(s) or None.
    ``params``: what a single optimizer steps instead (validate's stand-in, for a model without any)."""
    if cfg.optimizers is not None:  # and their schedulers, by the name of the optimizer each schedules
        from fsmtrain.training.optimizers import NamedSchedulers
        named = build_named_optimizers(cfg, model)
        schedulers = {name: built_target(cfg, f"schedulers.{name}", sc.target, sc.kwargs, named[name])
                      for name, sc in cfg.schedulers.items()}
        return named, NamedSchedulers(schedulers) if schedulers else None
    optimizer = built_from(cfg, "optimizer_config", cfg.optimizer,  # a fresh iterator per try
                           lambda c: build_optimizer(c, model.parameters() if params is None else params))
    return optimizer, built_from(cfg, "scheduler_config", str(cfg.scheduler), lambda c: build_scheduler(c, optimizer))


def build_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    return _optimizer(cfg, cfg.optimizer, cfg.optimizer_config, params, "optimizer", "optimizer_config")


def _optimizer(cfg: RunConfig, target: str, kwargs: Mapping[str, Any], params: Any, where: str,
               kwargs_where: str) -> torch.optim.Optimizer:
    """``target(params, **kwargs)``, refused (at ``where`` or ``kwargs_where``) when its step needs a closure
    or a number it steps with is not finite."""
    import torch
    opt = resolve_dotted(target)(params, **kwargs)
    assert isinstance(opt, torch.optim.Optimizer)
    closure = inspect.signature(opt.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:  # LBFGS: re-evaluates the loss itself
        raise cfg.error([ConfigProblem(
            where, "an optimizer whose step() needs no closure (fsmtrain calls optimizer.step() once a batch)",
            f"{target}, whose step() requires a closure")])
    # torch takes lr=inf and trains to NaN at the first step: every number it steps with must be finite
    bad = [ConfigProblem(path, f"a finite number ({target} steps with it)", repr(value))
           for path, value in _non_finite(kwargs, kwargs_where)]
    if bad:
        raise cfg.error(bad)
    return opt


def _non_finite(value: Any, path: str) -> list[tuple[str, float]]:
    """The non-finite floats in a config value (``lr``, ``betas: [0.9, .inf]``), with their paths."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [(path, value)]
    if isinstance(value, Mapping):
        return [found for k, v in value.items() for found in _non_finite(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [found for i, v in enumerate(value) for found in _non_finite(v, f"{path}.{i}")]
    return []


def build_named_optimizers(cfg: RunConfig, model: nn.Module) -> NamedOptimizers:
    """``cfg.optimizers``, each over the parameters of its submodule of ``model``, as one NamedOptimizers."""
    from fsmtrain.training.optimizers import NamedOptimizers
    built: dict[str, torch.optim.Optimizer] = {}
    for name, oc in (cfg.optimizers or {}).items():
        try:
            part = model.get_submodule(oc.params)
        except AttributeError:
            known, path = [n for n, _ in model.named_modules() if n], f"optimizers.{name}.params"
            raise cfg.error([ConfigProblem(path, f"a submodule of the model ({', '.join(known[:12]) or 'none'})",
                                           repr(oc.params), closest(oc.params, known))]) from None
        where = f"optimizers.{name}"
        build = partial(_optimizer, cfg, oc.target, params=list(part.parameters()), where=f"{where}.target",
                        kwargs_where=f"{where}.kwargs")
        built[name] = blamed(cfg, f"{where}.kwargs", oc.target, build, oc.kwargs, f"{where}.target")
    try:
        return NamedOptimizers(built)
    except ValueError as exc:  # two optimizers over one parameter
        raise cfg.error([ConfigProblem("optimizers", "optimizers over parts of the model that do not overlap",
                                       str(exc))]) from None


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

    from fsmtrain.training.data import make_loaders
    out = resolve_dotted(cfg.data)(batch_size=cfg.batch_size, seed=seed, **cfg.data_config)
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError([ConfigProblem("data", "a builder returning (train, val)", type(out).__name__)])
    train, val = out
    if not isinstance(train, DataLoader) and hasattr(train, "__getitem__"):
        return tuple(make_loaders(train, val, batch_size=cfg.batch_size, seed=seed))  # type: ignore[return-value]
    return train, val


def build_callbacks(cfg: RunConfig, *, run_dir: Path | None,
                    trial: optuna.trial.Trial | Any | None = None) -> list[TrainingCallback]:
    """The run's callbacks as configured, then the user's extras. ``trial``: anything with Optuna's
    ``report`` and ``should_prune`` (replay passes a recorded one); the pruner joins only with one."""
    import fsmtrain.callbacks as cb
    out = watching_callbacks(cfg.callbacks, cfg.max_epochs)
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
    if cfg.early_stopping.enabled:
        out.append(cb.EarlyStoppingCallback(**_options(cfg.early_stopping)))
    if run_dir is not None:
        out.append(cb.MetricsCsvCallback(run_dir / "metrics.csv"))
    if cfg.checkpoint.enabled and run_dir is not None:
        out.append(checkpoint_callback(cfg.checkpoint, run_dir))
    if cfg.grad_clip is not None:
        out.append(cb.GradientClippingCallback(**_options(cfg.grad_clip)))
    if cfg.grad_accumulation > 1:
        out.append(cb.GradientAccumulationCallback(steps=cfg.grad_accumulation))
    if cfg.log_every_n_steps is not None:
        out.append(cb.StepLogCallback(cfg.log_every_n_steps))
    out += [built_target(cfg, f"callbacks.extra.{i}", extra.target, extra.kwargs)
            for i, extra in enumerate(cfg.callbacks.extra)]
    return out


def built_target(cfg: RunConfig, where: str, target: str, kwargs: Mapping[str, Any], *leading: Any) -> Any:
    """``target(*leading, **kwargs)`` of a ``{target, kwargs}`` entry at ``where``, a rejection blamed as
    :func:`blamed` does (on ``where.kwargs.<leaf>``)."""
    cls = resolve_dotted(target)
    return blamed(cfg, f"{where}.kwargs", target, lambda kw: cls(*leading, **kw), kwargs, f"{where}.target")


def _options(section: BaseModel) -> dict[str, Any]:
    """A config section's fields as its callback's keyword arguments (the names are the same)."""
    return section.model_dump(exclude={"enabled"})


def watching_callbacks(c: CallbacksConfig, epochs: int) -> list[TrainingCallback]:
    """The built-ins that only watch a run, as ``c`` enables them."""
    import fsmtrain.callbacks as cb
    out: list[TrainingCallback] = []
    if c.nan_detection.enabled:
        out.append(cb.NaNDetectionCallback())
    if c.optimizer_mode.enabled:
        out.append(cb.OptimizerModeCallback())
    if c.gradient_monitor.enabled:
        out.append(cb.GradientMonitorCallback(**_options(c.gradient_monitor)))
    if c.loss_prediction.enabled:
        out.append(cb.LossPredictionCallback(max_epochs=epochs))
    if c.overfit_detection.enabled:
        out.append(cb.OverfitDetectionCallback(**_options(c.overfit_detection)))
    return out


def checkpoint_callback(ck: CheckpointConfig, run_dir: Path) -> TrainingCallback:
    import fsmtrain.callbacks as cb
    return cb.CheckpointCallback(run_dir / "checkpoints", **_options(ck))
