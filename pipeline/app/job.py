"""One seed's job: build what a config names, claim its run directory, train."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
import yaml
from torch import nn

from fsmtrain.app.config import builders
from fsmtrain.app.config.checks import check_data, checked_callbacks
from fsmtrain.app.config.loading import load_yaml
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.app.config.resolution import resolve_dotted
from fsmtrain.app.config.schema import TRAINING_FIELDS, RunConfig, resolved_dict
from fsmtrain.app.config.world import RECORDED_FOLDERS, user_folders
from fsmtrain.app.launch import ElasticAttempt, elastic_run_dir, has_committed_checkpoint
from fsmtrain.app.rundir import RunDirClaim, claim_existing, claim_new, claim_next_free, run_started
from fsmtrain.app.schedule import Replan, replan_schedule, resume_schedule
from fsmtrain.app.trainer import MODEL_FILE, Trainer, joined_collective
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.result import TrainResult
from fsmtrain.core.signals import installed
from fsmtrain.training.checkpoint_file import atomic_write_bytes
from fsmtrain.training.sharding import FsdpOptions

if TYPE_CHECKING:
    import optuna

__all__ = [
    "CONFIG_FILE", "MODEL_FILE", "RunParts", "RunTarget", "SeedRun", "build_parts", "config_differences",
    "config_fingerprint", "pick_run_dir", "train_seed",
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
    metrics: dict[str, Any]  # functions fn(output, target) and exact metric objects
    steps: tuple[Any, Any] = (None, None)  # the user's step and val_step, or None


def build_parts(cfg: RunConfig, seed: int) -> RunParts:
    """Seed every RNG, then build everything; a failure is a ConfigError naming the field at fault."""
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    random.seed(seed)  # python, numpy and torch: model init and dropout repeat for the same seed
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model = builders.built_from(cfg, "net_config", cfg.net, builders.build_model, "net").to(torch.device(cfg.device))
    optimizer, scheduler = builders.build_optimization(cfg, model)
    criterion = builders.built_from(cfg, "criterion_config", cfg.criterion, builders.build_criterion)
    train_loader, val_loader = check_data(cfg, seed)
    # a metric: a function fn(output, target), or an exact metric object built from its class
    metrics = {name: resolve_dotted(m) if isinstance(m, str) else
               builders.built_target(cfg, f"metrics.{name}", m.target, m.kwargs) for name, m in cfg.metrics.items()}
    step, val_step = (None if path is None else resolve_dotted(path) for path in (cfg.step, cfg.val_step))
    return RunParts(model, optimizer, scheduler, criterion, train_loader, val_loader, metrics, (step, val_step))


# What a resume may change: how long to train and where, and how it is logged; the rest must be what
# the checkpoint was trained with, or the result is not a continuation.
RESUMABLE_FIELDS: frozenset[str] = frozenset(
    {"epochs", "device", "log_level", "log", "wandb", "num_threads", "seeds", "name", "optimize", "distributed",
     "compile", "tensorboard"})


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


# Where a seed's run goes: a folder to claim, or a claimer called once the run is built.
RunTarget = Path | Callable[[], RunDirClaim]


@dataclass(frozen=True)
class Header:
    """What a command prints once a seed's run is claimed: ``== title -> path`` and its notes."""

    out: TextIO
    title: str
    notes: Sequence[str] = ()

    def say(self, claim: RunDirClaim | Path, resume: bool) -> None:
        path = claim.path if isinstance(claim, RunDirClaim) else claim
        reused = claim.cleared if isinstance(claim, RunDirClaim) else ()
        also = f" (reusing the folder of a run that never started: removed {', '.join(reused)})" if reused else ""
        print(f"== {self.title} {'resuming' if resume else '->'} {path}{also}", file=self.out, flush=True)
        for note in self.notes:
            print(f"  {note}", file=self.out, flush=True)


def _check_resume(cfg: RunConfig, seed: int, path: Path, resolved: dict[str, Any]) -> Replan | None:
    """Refuse a resume whose config changed what the run was trained with; the schedule's re-plan."""
    if not (path / CONFIG_FILE).is_file():
        return None
    before = load_yaml(path / CONFIG_FILE)
    replan = resume_schedule(before, resolved, f"fsmtrain resume {path}", cfg.source_of("epochs"))
    changed = config_differences(before, resolved)
    if replan is not None:
        changed = [c for c in changed if not c.startswith(f"{replan.path} (")]
    if seed not in cfg.seeds:  # the config.yaml written for the run would name seeds it never trained with
        changed.append(f"seeds ({cfg.seeds!r} leaves out seed {seed}, which the run was trained with)")
    if changed:
        raise ConfigError([ConfigProblem(
            "resume", "the model, optimizer, data and seed the run was trained with",
            "changed: " + "; ".join(changed) + f" (compared with {path / CONFIG_FILE})")])
    return replan


def train_seed(cfg: RunConfig, seed: int, run_dir: RunTarget, *, extra_callbacks: Sequence[TrainingCallback] = (),
               trial: optuna.trial.Trial | None = None, resume: bool = False,
               extras: Mapping[str, Any] | None = None, header: Header | None = None) -> SeedRun:
    """Build, claim and train one seed; everything is built before the run directory is claimed. An
    exception or a signal during ``fit()`` is returned in ``SeedRun.error``; a signal during start-up
    raises ``Interrupted``."""
    resolved, fsdp = resolved_dict(cfg), cfg.distributed.fsdp
    assert not (resume and callable(run_dir)), "a resumed run is named by its folder"
    replan = _check_resume(cfg, seed, run_dir, resolved) if resume and not callable(run_dir) else None
    collective = joined_collective(torch.device(cfg.device), cfg.distributed.agreement_timeout_s)
    # one process honours a start-up signal now; ranks agree on one inside the run
    startup = installed() if collective is None else None
    parts = build_parts(cfg, seed)
    if startup is not None:
        startup.raise_if_signalled()

    take = run_dir if callable(run_dir) else partial(claim_existing if resume else claim_new, run_dir)
    claim: RunDirClaim | Path = take() if collective is None else collective.on_rank_zero(take, lambda c: c.path)
    path = claim.path if isinstance(claim, RunDirClaim) else claim

    def write_config() -> None:
        if collective is None or collective.rank == 0:  # rank 0 owns the run dir and what is in it
            atomic_write_bytes(path / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode("utf-8"))
    try:
        if not resume:  # a new folder says at once what it was claimed for, while the callbacks build
            write_config()
        callbacks = checked_callbacks(cfg, run_dir=path, trial=trial, extra=extra_callbacks,
                                      world_size=1 if collective is None else collective.world_size)
        if header is not None:
            header.say(claim, resume)
        if resume:  # rewritten only once the resumed run's parts are all built
            write_config()
        cleared = {"reused_run_dir": list(claim.cleared)} if isinstance(claim, RunDirClaim) and claim.cleared else {}
        trainer = Trainer(
            parts.model, parts.optimizer, parts.criterion, parts.train_loader, parts.val_loader,
            max_epochs=cfg.max_epochs, max_steps=cfg.max_steps, val_every_n_steps=cfg.val_every_n_steps,
            callbacks=callbacks, scheduler=parts.scheduler, device=cfg.device,
            metrics=parts.metrics, run_dir=claim, run_id=path.name, log_level=cfg.log_level,
            extras={"config": resolved, "seed": seed, "config_fingerprint": config_fingerprint(resolved, seed),
                    RECORDED_FOLDERS: user_folders(cfg), **cleared, **(extras or {})},
            resume_from="latest" if resume else None, default_callbacks=False, precision=cfg.precision,
            compile=cfg.compile, log_fsync=cfg.log.fsync, write_outputs=True, collective=collective,
            step=parts.steps[0], val_step=parts.steps[1], preemption_signals=cfg.preemption.signals,
            preemption_rounds_every=None if cfg.preemption.rounds_every == "auto" else cfg.preemption.rounds_every,
            strategy=cfg.distributed.strategy, fsdp=FsdpOptions(
                fsdp.shard, fsdp.reshard_after_forward, fsdp.mixed_precision.param_dtype,
                fsdp.mixed_precision.reduce_dtype, fsdp.cpu_offload),
        )
        if startup is not None and startup.signum is not None:
            trainer.close()
            startup.raise_if_signalled()
    except BaseException:
        if isinstance(claim, RunDirClaim):
            claim.let_go()  # a resumed run's folder is only released; a new one that never started goes
        raise
    if replan is not None and trainer.resumption is not None:
        replan_schedule(cfg, trainer.resumption, replan)
    error: BaseException | None = None
    try:
        trainer.fit()
    except (Exception, KeyboardInterrupt) as exc:
        error = exc
    # A run the ranks ended together ends with a barrier, so no rank exits while rank 0 still writes its
    # files; a rank that failed on its own skips it.
    if collective is not None and (error is None or isinstance(error, Interrupted)):
        collective.barrier()
    return SeedRun(seed, path, trainer, error)


def pick_run_dir(root: Path, name: str, resume: bool,
                 attempt: ElasticAttempt | None) -> tuple[RunTarget, bool, str | None]:
    """Where one seed's run goes under ``root`` (rank 0 picks): the run to resume or the claimer of a new
    one (a new name: the next free one), whether it resumes, and what to say of the choice. An elastic
    restart continues the run its first attempt claimed, or starts anew when that committed no checkpoint."""
    if attempt is not None and attempt.restart > 0:
        earlier = elastic_run_dir(root, name, attempt)
        said = f"elastic restart {attempt.restart} of {attempt.max_restarts}: "
        if earlier is not None and has_committed_checkpoint(earlier):
            return earlier, True, f"{said}continuing {earlier} from its newest committed checkpoint"
        if earlier is not None:
            return partial(claim_next_free, root, name), False, (
                f"{said}the attempt before committed no checkpoint in {earlier}; this run starts from the beginning "
                "in a new run directory")
    if resume and run_started(root / name):
        return root / name, True, None
    return partial(claim_new, root / name) if resume else partial(claim_next_free, root, name), False, None
