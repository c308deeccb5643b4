"""The checks of the user's code that ``train``, ``validate`` and ``preflight`` share, so all three
refuse the same things in the same words: constructors, callbacks and the data builder."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsmtrain.app.config.builders import (
    build_callbacks,
    build_criterion,
    build_data,
    build_model,
    build_optimization,
    built_from,
)
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.resolution import resolve_dotted
from fsmtrain.app.config.schema import RunConfig
from fsmtrain.core.checks import CallbackDefinitionError
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.registry import GlobalRegistrationError
from fsmtrain.core.runner import CallbackOrderError, CallbackRunner
from fsmtrain.training.sharding import unshardable

__all__ = ["UNWRITTEN_RUN_DIR", "check_builds", "check_data", "check_data_arguments", "checked_callbacks"]

UNWRITTEN_RUN_DIR = Path("runs") / "(checked, never created)"  # so the file-writing callbacks are checked too


def checked_callbacks(cfg: RunConfig, *, run_dir: Path = UNWRITTEN_RUN_DIR, trial: Any = None,
                      extra: Sequence[TrainingCallback] = (), world_size: int = 1) -> list[TrainingCallback]:
    """The run's callbacks as ``train`` builds them, ``extra`` added; a rejection is one ConfigError."""
    callbacks = [*build_callbacks(cfg, run_dir=run_dir, trial=trial), *extra]
    refused = unshardable(callbacks) if cfg.distributed.strategy == "fsdp" else []
    if refused:
        raise cfg.error([ConfigProblem("distributed.strategy", "callbacks that work on sharded parameters (fsdp)",
                                       f"{'; '.join(refused)}, which need(s) the whole parameters or gradients on "
                                       "one rank; leave it out, or use strategy ddp")])
    try:
        CallbackRunner(callbacks)
    except (CallbackDefinitionError, CallbackOrderError, GlobalRegistrationError) as exc:
        raise cfg.error([ConfigProblem("callbacks", "callbacks the runner accepts", str(exc))]) from exc
    manual_problems(cfg, callbacks, world_size)
    return callbacks


def manual_problems(cfg: RunConfig, callbacks: Sequence[TrainingCallback], world_size: int = 1) -> None:
    """A manual step's needs: one process, no callback on the hooks it leaves out, no fp16 scaling, its
    own val_step."""
    from fsmtrain.training.optimizers import is_manual, skipped_hooks
    step = None if cfg.step is None else resolve_dotted(cfg.step)
    if not is_manual(step):
        return
    needing, manual = skipped_hooks(step, callbacks), f"the manual step {cfg.step}"
    problems = [ConfigProblem(path, expected, found) for wrong, path, expected, found in (
        (needing, "callbacks", f"no callback on the hooks around backward and the optimizer step: {manual} does "
         "those itself (turn them off: callbacks.gradient_monitor.enabled: false, grad_clip: null, "
         "grad_accumulation: 1)", "; ".join(needing)),
        (cfg.precision == "16-mixed", "precision", f"'32' or 'bf16-mixed' ({manual} runs its own backward, without "
         "fp16's loss scaling)", repr(cfg.precision)),
        (world_size > 1, "step", f"one process ({manual} runs its own backward, which DDP's gradient averaging does "
         f"not reach: it trains on one process (this run has {world_size}))", f"{world_size} ranks"),
        (cfg.val_step is None, "val_step", f"a val_step ({manual} steps optimizers, so it cannot validate)", "none"),
    ) if wrong]
    if problems:
        raise cfg.error(problems)


def check_data(cfg: RunConfig, seed: int) -> tuple[Any, Any]:
    """Call the data builder once, as ``train`` will: its (train, val) loaders, or a ConfigError (at the
    ``data_config`` value the builder's message names, if any)."""
    check_data_arguments(cfg, seed)
    try:
        return build_data(cfg, seed)
    except ConfigError:
        raise
    except Exception as exc:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        leaf = next((k for k, v in cfg.data_config.items() if isinstance(v, str) and v and v in text), None)
        path = f"data_config.{leaf}" if leaf else "data"
        expected = f"a data builder call that returns (train, val) ({cfg.data} with batch_size, seed and data_config)"
        raise cfg.error([ConfigProblem(path, expected, f"{cfg.data} raised {text}")]) from exc


def batches(loader: Any) -> str:
    """How many batches a loader has, for a person (an iterable one may not know)."""
    if loader is None:
        return "none"
    try:
        return str(len(loader))
    except TypeError:
        return "unknown (no len())"

_SIMPLE = (int, float, str, bool)


def check_data_arguments(cfg: RunConfig, seed: int) -> None:
    """The data builder accepts ``batch_size``, ``seed`` and ``data_config``, each value of the simple
    type its annotation names."""
    builder = resolve_dotted(cfg.data)
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return  # a builtin or extension: nothing to check before calling it
    try:
        sig.bind(batch_size=cfg.batch_size, seed=seed, **cfg.data_config)
    except TypeError as exc:
        text = str(exc)
        leaf = next((k for k in cfg.data_config if f"'{k}'" in text), None)
        path = f"data_config.{leaf}" if leaf else "data_config"
        raise cfg.error([ConfigProblem(path, f"arguments {cfg.data} accepts", text)]) from None
    try:
        hints = typing.get_type_hints(builder)
    except Exception:
        return
    problems = [ConfigProblem(f"data_config.{name}", f"{want.__name__} ({cfg.data} says so)", repr(value))
                for name, value in cfg.data_config.items() if (want := hints.get(name)) in _SIMPLE
                and not _fits(value, want)]
    if problems:
        raise cfg.error(problems)


def _fits(value: Any, want: type) -> bool:
    """An int passes for a float; a bool passes for a bool only."""
    return isinstance(value, (int, float) if want is float else want) and (want is bool or not isinstance(value, bool))


def check_builds(cfg: RunConfig) -> tuple[list[str], str]:
    """What ``validate`` builds, and what it did with the data, for the summary line."""
    import torch
    build_optimization(cfg, built_from(cfg, "net_config", cfg.net, build_model, "net"),
                       [torch.nn.Parameter(torch.zeros(1))])
    built_from(cfg, "criterion_config", cfg.criterion, build_criterion)
    named = "s" if cfg.optimizers is not None else ""
    built = ["model", "loss", f"optimizer{named}", *([f"scheduler{named}"] if cfg.scheduler or cfg.schedulers else [])]
    checked_callbacks(cfg)
    if cfg.callbacks.extra:
        built.append("extra callbacks")
    check_data_arguments(cfg, cfg.seeds[0])
    return built, "checked the data builder's arguments (the data was not built: --data builds it)"
