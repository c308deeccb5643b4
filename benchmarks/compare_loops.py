"""The training loops ``compare.py`` runs side by side: the same model, data, optimizer and order of
floating-point work in every one, so all of them end with the same weights, bit for bit.

Each loop takes a :class:`Job` and appends ``time.perf_counter()`` to ``job.marks`` at the start of
every epoch (the steady-state window is measured between those marks, so imports, W&B start-up and
teardown stay out of the per-epoch figures). A loop returns extra figures for the report, if any.

``*_all`` loops do, besides training, what fsmtrain's nine built-in callbacks do each step and epoch,
each in its framework's own way (``raw_all`` by hand; the peers with their closest equivalents):

- global gradient L2 norm every step, running max kept on the device, read once per epoch;
- NaN/inf check of the losses;
- one W&B log per epoch (offline);
- Optuna ``trial.report`` / ``should_prune`` each epoch (a real in-memory study; it never prunes);
- early-stopping bookkeeping (patience longer than the run, so it never stops);
- checkpoints of model and optimizer each epoch.

Loss prediction (an exponential least-squares fit per epoch) and overfit detection have no peer
equivalent and are not reproduced by hand: they are fsmtrain-only work inside ``fsm_all``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
LR = 1e-3
EVERY_N_STEPS_ENV = "FSMTRAIN_BENCH_EVERY_N_STEPS"  # fsm_all_steps: its checkpoint.every_n_steps
MIN_DELTA = 1e-4  # fsmtrain's relative early-stopping min_delta


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train: list[Batch]
    val: list[Batch]
    epochs: int
    scratch: Path
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    marks: list[float] = field(default_factory=list)

    @property
    def patience(self) -> int:
        return self.epochs + 1  # bookkeeping every epoch, never a stop: every loop runs every epoch


def _grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return norm


def _trial() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study().ask()  # MedianPruner: never prunes the first trial, but does the work


# --- raw ------------------------------------------------------------------------------------------
def _raw_epochs(job: Job, per_epoch: Callable[[int, float, float, torch.Tensor], bool] | None) -> None:
    model, opt, loss_fn = job.model, job.optimizer, nn.MSELoss()
    params = [p for p in model.parameters() if p.requires_grad]
    gmax = torch.zeros((), device=job.device)
    for epoch in range(job.epochs):
        job.marks.append(time.perf_counter())
        model.train()
        total = torch.zeros((), device=job.device)
        seen = 0
        gmax.fill_(-1.0)
        for x, y in job.train:
            loss = loss_fn(model(x), y)
            total += loss.detach() * y.shape[0]
            seen += y.shape[0]
            loss.backward()
            if per_epoch is not None:
                torch.maximum(gmax, _grad_norm(params), out=gmax)
            opt.step()
            opt.zero_grad(set_to_none=True)
        train_loss = (total / seen).item()
        model.eval()
        vsum = torch.zeros((), device=job.device)
        vseen = 0
        with torch.inference_mode():
            for x, y in job.val:
                vsum += loss_fn(model(x), y) * y.shape[0]
                vseen += y.shape[0]
        val_loss = (vsum / vseen).item()
        if per_epoch is not None and per_epoch(epoch, train_loss, val_loss, gmax):
            break


def raw(job: Job) -> dict[str, Any]:
    _raw_epochs(job, None)
    return {}


def _durable_save(state: dict[str, Any], path: Path, commits: Any) -> None:
    """What fsmtrain does for each checkpoint, by hand: sha256 of the bytes, a temp file fsync'd and
    renamed over the old one, the folder fsync'd, and an fsync'd commit line naming the digest."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    digest = hashlib.sha256(data).hexdigest()
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    commits.write(json.dumps({"event": "checkpoint_committed", "path": path.name, "sha256": digest}) + "\n")
    commits.flush()
    os.fsync(commits.fileno())


def raw_all(job: Job, durable: bool = False, save: bool = True) -> dict[str, Any]:
    """``save=False``: everything but the checkpoint (``raw_all_unsaved``, for ``parts.py``)."""
    import wandb

    trial = _trial()
    run = wandb.init(project="bench", mode="offline", dir=str(job.scratch))
    best = math.inf
    bad = 0
    ckpt = job.scratch / "latest.pt"
    saves: list[float] = []  # the training thread's stall per checkpoint: the whole synchronous save

    def per_epoch(epoch: int, train_loss: float, val_loss: float, gmax: torch.Tensor) -> bool:
        nonlocal best, bad
        max_grad_norm = gmax.item()
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
            return True
        trial.report(val_loss, epoch)
        if trial.should_prune():
            return True
        if not math.isfinite(best) or val_loss < best - abs(best) * MIN_DELTA:  # relative, as fsmtrain's
            best, bad = val_loss, 0
        else:
            bad += 1
        run.log({"train_loss": train_loss, "val_loss": val_loss, "lr": job.optimizer.param_groups[0]["lr"],
                 "max_grad_norm": max_grad_norm}, step=epoch)
        if not save:
            return bad >= job.patience
        t0 = time.perf_counter()
        state = {"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict()}
        if durable:
            _durable_save(state, ckpt, commits)
        else:
            torch.save(state, ckpt)
        saves.append(time.perf_counter() - t0)
        return bad >= job.patience

    commits = open(job.scratch / "commits.jsonl", "a")  # noqa: SIM115 (closed below, beside W&B)
    try:
        _raw_epochs(job, per_epoch)
    finally:
        run.finish()
        commits.close()
    return {"stall_ms": 1e3 * statistics.median(saves[1:] or saves)} if saves else {}


def raw_all_unsaved(job: Job) -> dict[str, Any]:
    return raw_all(job, save=False)


def raw_all_durable(job: Job) -> dict[str, Any]:
    return raw_all(job, durable=True)


# --- fsmtrain -------------------------------------------------------------------------------------
def _fsm(job: Job, callbacks: list[Any], run_dir: Path, log_fsync: str = "commits") -> Any:
    from fsmtrain import Trainer, TrainingCallback

    class Mark(TrainingCallback):
        priority = -1000  # first at epoch begin

        def on_train_epoch_begin(self, epoch: Any) -> None:
            job.marks.append(time.perf_counter())

    trainer = Trainer(job.model, job.optimizer, nn.MSELoss(), job.train, job.val, max_epochs=job.epochs,
                      callbacks=[Mark(), *callbacks], run_dir=run_dir, console_level="error", default_callbacks=False,
                      device=job.device, log_fsync=log_fsync)
    return trainer.fit()


def fsm(job: Job) -> dict[str, Any]:
    _fsm(job, [], job.scratch / "run")
    return {}


def nine_builtins(job: Job, run_dir: Path, every_n_steps: int | None = None, background: bool = True) -> list[Any]:
    """The nine built-ins exactly as ``fsmtrain train`` builds them (config defaults, W&B offline,
    a pruner on an Optuna trial), through ``fsmtrain.app.config.build_callbacks``; ``every_n_steps``:
    ``checkpoint.every_n_steps`` too; ``background=False``: ``checkpoint.background: false``."""
    from fsmtrain.app.config import build_callbacks, config_from_dict

    cfg = config_from_dict({
        "net": "fsmtrain.training.models.MLP", "net_config": {"in_features": 1, "out_features": 1},
        "data": "fsmtrain.training.data.synthetic_regression",  # not used: only the callbacks are built
        "optimizer": "torch.optim.AdamW", "epochs": job.epochs, "batch_size": job.train[0][1].shape[0],
        "early_stopping": {"patience": job.patience},
        "wandb": {"enabled": True, "mode": "offline", "project": "bench"},
        "checkpoint": {"background": background,
                       **({} if every_n_steps is None else {"every_n_steps": every_n_steps})},
    })
    # metrics.csv is a tenth, not one of the nine, and no peer writes one
    callbacks = [c for c in build_callbacks(cfg, run_dir=run_dir, trial=_trial())
                 if type(c).__name__ != "MetricsCsvCallback"]
    assert len(callbacks) == 9, [type(c).__name__ for c in callbacks]
    return callbacks


def fsm_all(job: Job, log_fsync: str = "commits", every_n_steps: int | None = None,
            background: bool = True) -> dict[str, Any]:
    from fsmtrain.core.events import read_events

    run_dir = job.scratch / "run"
    _fsm(job, nine_builtins(job, run_dir, every_n_steps, background), run_dir, log_fsync)
    per_callback: dict[str, list[float]] = {}
    epoch_seconds: list[float] = []
    stepped: set[int] = set()  # the epochs that committed a checkpoint at a step
    for event in read_events(run_dir / "events.jsonl"):
        if event["event"] == "epoch":
            payload = event["payload"]
            epoch_seconds.append(payload["seconds"])
            for name, seconds in payload.get("callback_seconds", {}).items():
                per_callback.setdefault(name, []).append(seconds)
        elif event["event"] == "checkpoint" and event["payload"].get("kind") == "step":
            stepped.add(event["epoch"])
    per_callback.pop("Mark", None)
    stall = per_callback.get("CheckpointCallback", [0.0])  # the checkpoint's time on the training thread
    out = {"callback_ms": {k: 1e3 * sum(v[1:]) / max(1, len(v) - 1) for k, v in per_callback.items()},
           "stall_ms": 1e3 * statistics.median(stall[1:] or stall)}
    if every_n_steps is not None:  # a step checkpoint's own time on the training thread, and its epochs' time
        plain = [s for i, s in enumerate(stall) if i and i not in stepped] or [0.0]
        out["step_stall_ms"] = [1e3 * (stall[i] - statistics.median(plain)) for i in sorted(stepped) if i < len(stall)]
        out["stepped_epochs"] = sorted(stepped)
    return out


def fsm_all_steps(job: Job) -> dict[str, Any]:
    return fsm_all(job, every_n_steps=int(os.environ.get(EVERY_N_STEPS_ENV, "100")))


def fsm_all_foreground(job: Job) -> dict[str, Any]:
    return fsm_all(job, background=False)


def _nothing(context: Any) -> None:
    """A hook that does nothing: the runner still dispatches, times and attributes it."""


def fsm_all_hollow(job: Job) -> dict[str, Any]:
    """The nine, each per-epoch and per-step hook dispatched but doing nothing (set up and torn down as
    usual): what the runner, the slots and the log cost around the nine's own work. A measurement only."""
    from fsmtrain.core.lifecycle import EPOCH_HOOK_ORDER

    run_dir = job.scratch / "run"
    nine = nine_builtins(job, run_dir)
    for cb in nine:
        for hook in cb.overridden_hooks():
            if hook in EPOCH_HOOK_ORDER:
                setattr(cb, hook, _nothing)
    _fsm(job, nine, run_dir)
    return {}


def fsm_all_unwritten(job: Job) -> dict[str, Any]:
    """The nine with the writer thread's commit a no-op: each state is decided, collected, serialized and
    handed over on the training thread as usual, and nothing is written. What the training thread pays
    for a checkpoint without the writer's work beside it. A measurement only."""
    from fsmtrain.training.checkpoint import CheckpointManager

    commit = CheckpointManager._commit
    setattr(CheckpointManager, "_commit", lambda self, plan, log: None)  # noqa: B010 (a method, replaced)
    try:
        return fsm_all(job)
    finally:
        setattr(CheckpointManager, "_commit", commit)  # noqa: B010


def fsm_all_fsync_never(job: Job) -> dict[str, Any]:
    return fsm_all(job, "never")


def fsm_all_fsync_every(job: Job) -> dict[str, Any]:
    return fsm_all(job, "every")


# --- Ignite ---------------------------------------------------------------------------------------
def _ignite(job: Job, full: bool) -> None:
    from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
    from ignite.metrics import Average, Loss

    loss_fn = nn.MSELoss()
    trainer = create_supervised_trainer(job.model, job.optimizer, loss_fn, device=job.device)
    evaluator = create_supervised_evaluator(job.model, metrics={"loss": Loss(loss_fn)}, device=job.device)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda _: job.marks.append(time.perf_counter()))
    Average(output_transform=lambda out: out).attach(trainer, "train_loss")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(job.val))
    if full:
        _ignite_equivalents(job, trainer, evaluator)
    trainer.run(job.train, max_epochs=job.epochs)


def _ignite_equivalents(job: Job, trainer: Any, evaluator: Any) -> None:
    from ignite.engine import Events
    from ignite.handlers import Checkpoint, DiskSaver, EarlyStopping, TerminateOnNan
    from ignite.handlers.wandb_logger import WandBLogger

    params = [p for p in job.model.parameters() if p.requires_grad]
    gmax = torch.zeros((), device=job.device)
    trial = _trial()
    wandb_logger = WandBLogger(project="bench", mode="offline", dir=str(job.scratch))

    trainer.add_event_handler(Events.EPOCH_STARTED, lambda _: gmax.fill_(-1.0))

    def grad_norm(_: Any) -> None:  # ignite zeroes the grads at the start of the next iteration
        torch.maximum(gmax, _grad_norm(params), out=gmax)

    trainer.add_event_handler(Events.ITERATION_COMPLETED, grad_norm)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    evaluator.add_event_handler(
        Events.COMPLETED, EarlyStopping(job.patience, lambda e: -e.state.metrics["loss"], trainer, min_delta=0.0))

    def prune(_: Any) -> None:
        trial.report(evaluator.state.metrics["loss"], trainer.state.epoch - 1)
        if trial.should_prune():
            trainer.terminate()

    evaluator.add_event_handler(Events.COMPLETED, prune)

    def log(_: Any) -> None:
        wandb_logger.log({"train_loss": trainer.state.metrics["train_loss"],
                          "val_loss": evaluator.state.metrics["loss"], "lr": job.optimizer.param_groups[0]["lr"],
                          "max_grad_norm": gmax.item()}, step=trainer.state.epoch - 1)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, log)
    to_save = {"model": job.model, "optimizer": job.optimizer, "trainer": trainer}
    saver = DiskSaver(job.scratch / "checkpoints", require_empty=False)
    for handler in (
        Checkpoint(to_save, saver, n_saved=3),  # periodic, keep the last 3
        Checkpoint(to_save, saver, filename_prefix="best", n_saved=1,
                   score_function=lambda _: -evaluator.state.metrics["loss"], score_name="neg_val_loss"),
        Checkpoint(to_save, saver, filename_prefix="latest", n_saved=1),
    ):
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.add_event_handler(Events.COMPLETED, lambda _: wandb_logger.close())


def ignite(job: Job) -> dict[str, Any]:
    _ignite(job, full=False)
    return {}


def ignite_all(job: Job) -> dict[str, Any]:
    _ignite(job, full=True)
    return {}


# --- Lightning ------------------------------------------------------------------------------------
class _Batches:
    """The batch list as one iterable: Lightning reads a plain list as a list of data loaders."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _lightning(job: Job, full: bool) -> None:
    import logging
    import warnings

    import lightning.pytorch as pl

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.model
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss: torch.Tensor = self.loss_fn(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=y.shape[0])
            return loss

        def validation_step(self, batch: Batch, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", self.loss_fn(self.net(x), y), on_epoch=True, batch_size=y.shape[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return job.optimizer

    class Mark(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            job.marks.append(time.perf_counter())

    callbacks: list[pl.Callback] = [Mark()]
    logger: Any = False
    if full:
        callbacks += _lightning_equivalents(job)
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="bench", offline=True, save_dir=str(job.scratch))
    trainer = pl.Trainer(
        accelerator="gpu" if job.device.type == "cuda" else "cpu", devices=1, max_epochs=job.epochs, logger=logger,
        callbacks=callbacks, enable_checkpointing=full, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(job.scratch), log_every_n_steps=len(job.train),
    )
    trainer.fit(Module(), train_dataloaders=_Batches(job.train), val_dataloaders=_Batches(job.val))


def _lightning_equivalents(job: Job) -> list[Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    trial = _trial()

    class GradNorm(pl.Callback):
        def __init__(self) -> None:
            self.params = [p for p in job.model.parameters() if p.requires_grad]
            self.gmax = torch.zeros((), device=job.device)

        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.gmax.fill_(-1.0)

        def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, opt: Any) -> None:
            torch.maximum(self.gmax, _grad_norm(self.params), out=self.gmax)

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            module.log("max_grad_norm", self.gmax.item())

    class Prune(pl.Callback):
        def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            trial.report(float(trainer.callback_metrics["val_loss"]), trainer.current_epoch)
            if trial.should_prune():
                trainer.should_stop = True

    checkpoints = job.scratch / "checkpoints"
    return [
        GradNorm(), Prune(),
        EarlyStopping(monitor="val_loss", patience=job.patience, check_finite=True),  # also the NaN check
        ModelCheckpoint(checkpoints, "periodic-{epoch}", monitor="epoch", mode="max", save_top_k=3),
        ModelCheckpoint(checkpoints, "best-{epoch}", monitor="val_loss", mode="min", save_top_k=1, save_last=True),
    ]


def lightning(job: Job) -> dict[str, Any]:
    _lightning(job, full=False)
    return {}


def lightning_all(job: Job) -> dict[str, Any]:
    _lightning(job, full=True)
    return {}


def fsm_all_without(prefix: str) -> Callable[[Job], dict[str, Any]]:
    """The nine less the one whose class name starts with ``prefix`` (its share of an epoch, e.g. in
    ``instructions.py --frameworks fsm_all,fsm_all_no_checkpoint``)."""

    def loop(job: Job) -> dict[str, Any]:
        run_dir = job.scratch / "run"
        kept = [c for c in nine_builtins(job, run_dir) if not type(c).__name__.lower().startswith(prefix)]
        assert len(kept) == 8, prefix
        _fsm(job, kept, run_dir)
        return {}

    return loop


# name -> (loop, what it is, the modules it needs beyond torch: imported before the clock starts)
# fsmtrain + nine: the Trainer, the config that builds the nine (nine_builtins), and what they use
NINE_IMPORTS = ("fsmtrain.app.trainer", "fsmtrain.app.config", "callbacks", "wandb", "optuna")
LOOPS: dict[str, tuple[Callable[[Job], dict[str, Any]], str, tuple[str, ...]]] = {
    "raw": (raw, "raw PyTorch loop", ()),
    "raw_all": (raw_all, "raw loop + the nine's work by hand", ("wandb", "optuna")),
    "raw_all_durable": (raw_all_durable, "raw_all + fsmtrain's durability by hand (sha256, fsync, rename, commit)",
                        ("wandb", "optuna")),
    "raw_all_unsaved": (raw_all_unsaved, "raw_all without its checkpoint", ("wandb", "optuna")),
    "fsm": (fsm, "fsmtrain core, no callbacks", ("fsmtrain.app.trainer",)),
    "fsm_all": (fsm_all, "fsmtrain + nine built-ins", NINE_IMPORTS),
    # the nine less one, for its share
    **{f"fsm_all_no_{p}": (fsm_all_without(p), f"fsmtrain + nine less {p}", NINE_IMPORTS)
       for p in ("checkpoint", "gradient", "wandb", "pruner", "loss")},
    # the nine's hooks doing nothing; the nine with nothing written (benchmarks/parts.py)
    "fsm_all_hollow": (fsm_all_hollow, "fsmtrain + nine, each epoch and step hook a no-op", NINE_IMPORTS),
    "fsm_all_unwritten": (fsm_all_unwritten, "fsmtrain + nine, the writer's commit a no-op", NINE_IMPORTS),
    # the nine with the log's fsync at another setting (fsm_all: "commits", the default)
    "fsm_all_fsync_never": (fsm_all_fsync_never, "fsmtrain + nine, log.fsync never", NINE_IMPORTS),
    "fsm_all_fsync_every": (fsm_all_fsync_every, "fsmtrain + nine, log.fsync every", NINE_IMPORTS),
    # the nine with each checkpoint written on the training thread (checkpoint.background: false)
    "fsm_all_foreground": (fsm_all_foreground, "fsmtrain + nine, checkpoints written on the training thread",
                           NINE_IMPORTS),
    # the nine with checkpoint.every_n_steps (benchmarks/step_checkpoints.py; default 100)
    "fsm_all_steps": (fsm_all_steps, "fsmtrain + nine, checkpoint.every_n_steps", NINE_IMPORTS),
    "ignite": (ignite, "Ignite", ("ignite.engine", "ignite.metrics")),
    "ignite_all": (ignite_all, "Ignite + equivalents",
                   ("ignite.engine", "ignite.metrics", "ignite.handlers", "ignite.handlers.wandb_logger", "wandb",
                    "optuna")),
    "lightning": (lightning, "Lightning", ("lightning.pytorch",)),
    "lightning_all": (lightning_all, "Lightning + equivalents", ("lightning.pytorch", "wandb", "optuna")),
}
