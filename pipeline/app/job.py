"""The main job: build everything a config names and train one seed into its run directory.

Used by ``fsmtrain train`` and ``fsmtrain preflight`` (and reusable by the HPO layer). Everything
is built and checked before the run directory is created, so a config that cannot be built
leaves nothing on disk.
"""

from __future__ import annotations

import hashlib
import json
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
    load_yaml,
    resolved_dict,
    seed_everything,
)
from pipeline.app.config.blame import blamed
from pipeline.app.config.checks import check_data_arguments
from pipeline.app.config.schema import TRAINING_FIELDS
from pipeline.app.launch import ElasticAttempt, elastic_run_dir, has_committed_checkpoint
from pipeline.app.rundir import RunDirClaim, claim_existing, claim_new, claim_next_free
from pipeline.app.trainer import MODEL_FILE, Trainer, joined_collective
from pipeline.core.checks import CallbackDefinitionError
from pipeline.core.drawing import write_run_diagram
from pipeline.core.engine import Interrupted
from pipeline.core.hooks import TrainingCallback
from pipeline.core.registry import GlobalRegistrationError
from pipeline.core.result import TrainResult
from pipeline.core.runner import CallbackOrderError, CallbackRunner
from pipeline.training.atomic import atomic_write_bytes

if TYPE_CHECKING:
    import optuna

__all__ = [
    "CONFIG_FILE", "MODEL_FILE", "RunParts", "SeedRun", "build_parts", "config_differences", "config_fingerprint",
    "pick_run_dir", "run_name_for", "runs_root", "train_seed",
]

CONFIG_FILE = "config.yaml"


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


class DataBuilderError(RuntimeError):
    """The data builder raised (its own error is the ``__cause__``, traceback included)."""


class DataBuildFailed:
    """Stands in for the loaders when the data builder raised (not an argument problem): the run
    starts, and its first epoch raises the builder's error inside the machine, so the run ends
    ERROR with the traceback in ``events.jsonl`` (a missing CSV is a failed run, not a crash)."""

    def __init__(self, builder: str, error: Exception) -> None:
        self.builder, self.error = builder, error

    def __iter__(self) -> Any:
        raise DataBuilderError(f"the data builder {self.builder} raised {type(self.error).__name__}: "
                               f"{self.error}") from self.error


def build_parts(cfg: RunConfig, seed: int) -> RunParts:
    """Seed every RNG, then build model, optimizer, scheduler, loss, loaders and metrics. A
    constructor's rejection is a ConfigError at the leaf it rejected (pipeline.app.config.checks)."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    seed_everything(seed)
    model = blamed(cfg, "net_config", cfg.net, lambda kw: build_model(cfg.model_copy(update={"net_config": dict(kw)})),
                   cfg.net_config).to(torch.device(cfg.device))
    optimizer = blamed(cfg, "optimizer_config", cfg.optimizer,
                       lambda kw: build_optimizer(cfg.model_copy(update={"optimizer_config": dict(kw)}),
                                                  model.parameters()), cfg.optimizer_config)
    scheduler = blamed(cfg, "scheduler_config", str(cfg.scheduler),
                       lambda kw: build_scheduler(cfg.model_copy(update={"scheduler_config": dict(kw)}), optimizer),
                       cfg.scheduler_config)
    criterion = blamed(cfg, "criterion_config", cfg.criterion,
                       lambda kw: build_criterion(cfg.model_copy(update={"criterion_config": dict(kw)})),
                       cfg.criterion_config)
    check_data_arguments(cfg, seed)
    try:
        train_loader, val_loader = build_data(cfg, seed)
    except ConfigError:
        raise
    except Exception as exc:  # the builder ran and failed: a run that fails, with its record
        train_loader, val_loader = DataBuildFailed(cfg.data, exc), None
    metrics = _built("metrics", "metric functions", lambda: build_metrics(cfg))
    return RunParts(model, optimizer, scheduler, criterion, train_loader, val_loader, metrics)


def run_name_for(cfg: RunConfig, seed: int, run_name: str) -> str:
    return f"{run_name}-seed{seed}"


def runs_root(cfg: RunConfig, base: Path | None = None) -> Path:
    return base if base is not None else Path("runs") / cfg.project


# What a resume may change: how long to train and where, and how it is logged. Everything else
# (model, optimizer, scheduler, loss, data, batch size, the seed, the training loop's own options)
# must be what the checkpoint was trained with, or the result is not a continuation.
RESUMABLE_FIELDS: frozenset[str] = frozenset(
    {"epochs", "device", "log_level", "wandb", "num_threads", "seeds", "name", "optimize", "distributed", "compile",
     "tensorboard"})


def config_fingerprint(resolved: dict[str, Any], seed: int) -> str:
    """sha256 of what a resume must not change (the fields a resume may change are left out)."""
    picked = {k: resolved.get(k) for k in TRAINING_FIELDS}
    picked["seed"] = seed
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()


def config_differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Leaf paths where two resolved configs differ, outside the fields a resume may change."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[str] = []
        for key in sorted(set(before) | set(after)):
            if not path and key in RESUMABLE_FIELDS:
                continue
            sub = f"{path}.{key}" if path else str(key)
            out += config_differences(before.get(key), after.get(key), sub)
        return out
    return [] if before == after else [f"{path} ({before!r} -> {after!r})"]


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
    run_dir: Path | RunDirClaim,
    *,
    extra_callbacks: Sequence[TrainingCallback] = (),
    trial: optuna.trial.Trial | None = None,
    resume: bool = False,
    extras: Mapping[str, Any] | None = None,
) -> SeedRun:
    """Train one seed: writes ``config.yaml``, ``events.jsonl``, ``checkpoints/``, ``wandb/`` and,
    when ``fit()`` returns, ``model.pt``. An exception or a signal during ``fit()`` is caught after
    the run reached train_end and returned in ``SeedRun.error``; build errors raise ``ConfigError``
    (and a run directory that cannot be claimed ``RunDirError``) before anything is written.
    ``extras`` join the run context (``hpo``: study and trial, which the ``run_start`` event records).

    ``resume=True`` continues the run in ``run_dir`` from its newest committed checkpoint; ``cfg``
    may differ from the run's ``config.yaml`` only in the fields a resume may change."""
    resolved = resolved_dict(cfg)
    path = run_dir.path if isinstance(run_dir, RunDirClaim) else run_dir
    if resume:
        before = load_yaml(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else None
        changed = config_differences(before, resolved) if before is not None else []
        # `seeds` may change between resumes of a job (a seed added to the list starts its own run),
        # but the list must still hold this run's seed: else the config.yaml written below would
        # name seeds that the run was never trained with.
        if seed not in cfg.seeds:
            changed.append(f"seeds ({cfg.seeds!r} leaves out seed {seed}, which the run was trained with)")
        if changed:
            raise ConfigError([ConfigProblem(
                "resume", "the model, optimizer, data and seed the run was trained with",
                "changed: " + "; ".join(changed) + f" (compared with {path / CONFIG_FILE})")])
    try:
        parts = build_parts(cfg, seed)
        callbacks = [*build_callbacks(cfg, run_dir=path, trial=trial), *extra_callbacks]
        _check_callbacks(callbacks)
    except BaseException:
        if isinstance(run_dir, RunDirClaim):
            run_dir.abandon()  # claimed for a run that could not be built: leave nothing behind
        raise
    collective = joined_collective(torch.device(cfg.device), cfg.distributed.agreement_timeout_s)
    owner = collective is None or collective.rank == 0  # rank 0 owns the run dir and what is in it

    def take() -> RunDirClaim:
        return run_dir if isinstance(run_dir, RunDirClaim) else (claim_existing(path) if resume else claim_new(path))

    claim: RunDirClaim | Path = take() if collective is None else collective.on_rank_zero(take, lambda c: c.path)
    try:
        if owner:
            atomic_write_bytes(path / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode("utf-8"))
        trainer = Trainer(
            parts.model, parts.optimizer, parts.criterion, parts.train_loader, parts.val_loader,
            max_epochs=cfg.epochs, callbacks=callbacks, scheduler=parts.scheduler, device=cfg.device,
            metrics=parts.metrics, run_dir=claim, run_id=path.name, log_level=cfg.log_level,
            extras={"config": resolved, "seed": seed, "config_fingerprint": config_fingerprint(resolved, seed),
                    **(extras or {})},
            resume_from="latest" if resume else None, default_callbacks=False, precision=cfg.precision,
            compile=cfg.compile, collective=collective,
        )
    except BaseException:
        if isinstance(claim, RunDirClaim):
            if resume:
                claim.release()
            else:
                claim.abandon()
        raise
    try:
        trainer.fit()
    except (Exception, KeyboardInterrupt) as exc:
        if owner:
            _write_path_diagram(trainer)
        _all_ranks_done(trainer, exc)
        return SeedRun(seed, path, trainer, exc)
    if owner:
        atomic_write_bytes(path / MODEL_FILE, trainer.model_bytes())
        _write_path_diagram(trainer)
    _all_ranks_done(trainer, None)
    return SeedRun(seed, path, trainer)


def _all_ranks_done(trainer: Trainer, error: BaseException | None) -> None:
    """A run the ranks ended together (completed, an agreed stop or signal) ends with a barrier, so
    no rank exits (and no launcher tears the others down) while rank 0 still writes its files. A
    rank that failed on its own skips it: the others are not coming."""
    collective = trainer.collective
    if collective is None:
        return
    if error is None or isinstance(error, Interrupted):
        collective.barrier()


def _check_callbacks(callbacks: Sequence[TrainingCallback]) -> None:
    """A callback mistake (misspelt hook, wrong signature, broken slot order) is a config error,
    reported before the run directory is written."""
    try:
        CallbackRunner(callbacks)
    except (CallbackDefinitionError, CallbackOrderError, GlobalRegistrationError) as exc:
        raise ConfigError([ConfigProblem("callbacks", "callbacks the runner accepts", str(exc))]) from exc


def _write_path_diagram(trainer: Trainer) -> None:
    """``lifecycle.mmd``: the path this run took, drawn from its own log."""
    if trainer.engine.result is not None and trainer.events.path is not None:
        write_run_diagram(trainer.events.path)


def pick_run_dir(root: Path, name: str, resume: bool, attempt: ElasticAttempt | None) -> tuple[Any, bool, str | None]:
    """The run directory of one seed (rank 0 picks): ``(claim or path, resume it?, a note to show)``.

    An elastic agent's restart (``TORCHELASTIC_RESTART_COUNT`` > 0) continues the run directory
    its first attempt claimed from the newest committed checkpoint, as ``--resume`` would; when that
    attempt committed none, it starts from the beginning in a new run directory, and says so."""
    if attempt is not None and attempt.restart > 0:
        earlier = elastic_run_dir(root, name, attempt)
        if earlier is not None and has_committed_checkpoint(earlier):
            return earlier, True, (f"elastic restart {attempt.restart} of {attempt.max_restarts}: continuing "
                                   f"{earlier} from its newest committed checkpoint")
        if earlier is not None:
            claim = claim_next_free(root, name)
            return claim, False, (f"elastic restart {attempt.restart} of {attempt.max_restarts}: the attempt before "
                                  f"committed no checkpoint in {earlier}; this run starts from the beginning in "
                                  f"{claim.path}")
    if resume and (root / name / "events.jsonl").is_file():
        return root / name, True, None
    return (claim_new(root / name) if resume else claim_next_free(root, name)), False, None
