"""The main job: build everything a config names and train one seed into its run directory.

Used by ``fsmtrain train`` and ``fsmtrain preflight`` (and reusable by the HPO layer). Everything
is built and checked before the run directory is created, so a config that cannot be built
leaves nothing on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from torch import nn

from pipeline.app.config import (
    ConfigError,
    ConfigProblem,
    RunConfig,
    build_callbacks,
    build_criterion,
    build_data,
    build_metrics,
    build_model,
    build_optimizer,
    build_scheduler,
    resolved_dict,
    seed_everything,
)
from pipeline.app.trainer import Trainer
from pipeline.core.drawing import write_run_diagram
from pipeline.core.engine import TrainResult
from pipeline.core.hooks import TrainingCallback

if TYPE_CHECKING:
    import optuna

__all__ = ["CONFIG_FILE", "MODEL_FILE", "RunParts", "SeedRun", "build_parts", "run_dir_for", "train_seed"]

CONFIG_FILE = "config.yaml"
MODEL_FILE = "model.pt"


@dataclass
class RunParts:
    """Everything one seed of a config builds, before training starts."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    criterion: Callable[[Any, Any], torch.Tensor]
    train_loader: Any
    val_loader: Any
    metrics: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _built(path: str, what: str, fn: Callable[[], Any]) -> Any:
    """Run one builder; a constructor rejecting its kwargs becomes a ConfigError naming the field."""
    try:
        return fn()
    except ConfigError:
        raise
    except (TypeError, ValueError, ImportError, RuntimeError) as exc:
        raise ConfigError([ConfigProblem(path, f"arguments {what} accepts", f"{type(exc).__name__}: {exc}")]) from exc


def build_parts(cfg: RunConfig, seed: int) -> RunParts:
    """Seed every RNG, then build model, optimizer, scheduler, loss, loaders and metrics."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    seed_everything(seed)
    model = _built("net_config", cfg.net, lambda: build_model(cfg)).to(torch.device(cfg.device))
    optimizer = _built("optimizer_config", cfg.optimizer, lambda: build_optimizer(cfg, model.parameters()))
    scheduler = _built("scheduler_config", str(cfg.scheduler), lambda: build_scheduler(cfg, optimizer))
    criterion = _built("criterion_config", cfg.criterion, lambda: build_criterion(cfg))
    train_loader, val_loader = _built("data_config", cfg.data, lambda: build_data(cfg, seed))
    metrics = _built("metrics", "metric functions", lambda: build_metrics(cfg))
    return RunParts(model, optimizer, scheduler, criterion, train_loader, val_loader, metrics)


def run_dir_for(cfg: RunConfig, seed: int, run_name: str, base: Path | None = None) -> Path:
    """``<base or runs/<project>>/<run-name>-seed<seed>``, with ``-2``, ``-3``… when it is taken,
    so a repeated command never mixes two runs' logs."""
    root = base if base is not None else Path("runs") / cfg.project
    candidate = root / f"{run_name}-seed{seed}"
    n = 2
    while candidate.exists() and any(candidate.iterdir()):
        candidate = root / f"{run_name}-seed{seed}-{n}"
        n += 1
    return candidate


@dataclass
class SeedRun:
    """One trained seed: its trainer, and the exception (or interrupt) that ended it, if any."""

    seed: int
    run_dir: Path
    trainer: Trainer
    error: BaseException | None = None

    @property
    def result(self) -> TrainResult | None:
        """Set whenever the run reached train_end, including after an error or an interrupt."""
        return self.trainer.engine.result


def train_seed(
    cfg: RunConfig,
    seed: int,
    run_dir: Path,
    *,
    extra_callbacks: Sequence[TrainingCallback] = (),
    trial: optuna.trial.Trial | None = None,
    extras: Mapping[str, Any] | None = None,
) -> SeedRun:
    """Train one seed: writes ``config.yaml``, ``events.jsonl``, ``checkpoints/``, ``wandb/`` and,
    when ``fit()`` returns, ``model.pt``. An exception or Ctrl-C during ``fit()`` is caught after
    the run reached train_end and returned in ``SeedRun.error``; build errors raise ``ConfigError``
    before anything is written. ``extras`` join the run context (``hpo``: study and trial, which
    the ``run_start`` event records)."""
    parts = build_parts(cfg, seed)
    callbacks = [*build_callbacks(cfg, run_dir=run_dir, trial=trial), *extra_callbacks]
    resolved = resolved_dict(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")
    trainer = Trainer(
        parts.model, parts.optimizer, parts.criterion, parts.train_loader, parts.val_loader,
        max_epochs=cfg.epochs, callbacks=callbacks, scheduler=parts.scheduler, device=cfg.device,
        metrics=parts.metrics, run_dir=run_dir, run_id=run_dir.name, log_level=cfg.log_level,
        extras={"config": resolved, "seed": seed, **(extras or {})},
    )
    try:
        trainer.fit()
    except (Exception, KeyboardInterrupt) as exc:
        _write_path_diagram(trainer)
        return SeedRun(seed, run_dir, trainer, exc)
    torch.save(trainer.model.state_dict(), run_dir / MODEL_FILE)
    _write_path_diagram(trainer)
    return SeedRun(seed, run_dir, trainer)


def _write_path_diagram(trainer: Trainer) -> None:
    """``lifecycle.mmd``: the path this run took, drawn from its own log."""
    if trainer.engine.result is not None and trainer.events.path is not None:
        write_run_diagram(trainer.events.path)
