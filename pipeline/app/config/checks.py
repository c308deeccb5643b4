"""What ``validate`` builds to reject what ``train`` would.

``train`` builds the model, optimizer, scheduler and loss before it claims a run directory;
``validate`` builds the same cheaply (the optimizer and scheduler on one dummy parameter) and
checks the data builder's arguments against its signature. Either way a constructor that rejects
its arguments is blamed on the leaf of the config that caused it (:mod:`pipeline.app.config.blame`).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pipeline.app.config.blame import blamed
from pipeline.app.config.builders import build_criterion, build_extra_callbacks, build_optimizer
from pipeline.app.config.problems import ConfigError, ConfigProblem
from pipeline.app.config.resolution import resolve_dotted
from pipeline.app.config.schema import RunConfig

__all__ = ["check_builds", "check_data_arguments"]

_SIMPLE = (int, float, str, bool)


def check_data_arguments(cfg: RunConfig, seed: int) -> None:
    """The data builder's signature accepts ``batch_size``, ``seed`` and ``data_config``, and each
    value has the simple type its annotation names (``n_features: int`` is not ``'eight'``)."""
    builder = resolve_dotted(cfg.data)
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return  # a builtin or extension: nothing to check before calling it
    try:
        bound = sig.bind(batch_size=cfg.batch_size, seed=seed, **cfg.data_config)
    except TypeError as exc:
        text = str(exc)
        leaf = next((k for k in cfg.data_config if f"'{k}'" in text), None)
        path = f"data_config.{leaf}" if leaf else "data_config"
        raise ConfigError([ConfigProblem(path, f"arguments {cfg.data} accepts", text)], cfg.source_of(path)) from None
    try:
        hints = typing.get_type_hints(builder)
    except Exception:
        return
    problems = []
    for name, value in bound.arguments.items():
        if name not in cfg.data_config:
            continue
        want = hints.get(name)
        if want in _SIMPLE and not _fits(value, want):
            problems.append(ConfigProblem(f"data_config.{name}", f"{want.__name__} ({cfg.data} says so)", repr(value)))
    if problems:
        raise ConfigError(problems, cfg.source_of(problems[0].path) if len(problems) == 1 else cfg.source)


def _fits(value: Any, want: type) -> bool:
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)


def check_builds(cfg: RunConfig) -> list[str]:
    """What ``validate`` builds: the model, the loss, the optimizer and scheduler on one dummy
    parameter, the user's extra callbacks, and the data builder's arguments. Returns what was
    built, for the summary line."""
    import torch


    model = blamed(cfg, "net_config", cfg.net, lambda kw: resolve_dotted(cfg.net)(**kw), cfg.net_config)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([ConfigProblem("net", "a torch.nn.Module subclass", f"{cfg.net} built a "
                                         f"{type(model).__name__}")], cfg.source)
    blamed(cfg, "criterion_config", cfg.criterion,
           lambda kw: build_criterion(cfg.model_copy(update={"criterion_config": dict(kw)})), cfg.criterion_config)
    dummy = torch.nn.Parameter(torch.zeros(1))
    optimizer = blamed(cfg, "optimizer_config", cfg.optimizer,
                       lambda kw: build_optimizer(cfg.model_copy(update={"optimizer_config": dict(kw)}), [dummy]),
                       cfg.optimizer_config)
    built = ["model", "loss", "optimizer"]
    if cfg.scheduler is not None:
        scheduler_cls = resolve_dotted(cfg.scheduler)
        blamed(cfg, "scheduler_config", cfg.scheduler, lambda kw: scheduler_cls(optimizer, **kw), cfg.scheduler_config)
        built.append("scheduler")
    if build_extra_callbacks(cfg):
        built.append("extra callbacks")
    check_data_arguments(cfg, cfg.seeds[0])
    return built
