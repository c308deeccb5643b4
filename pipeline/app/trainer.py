"""The ``Trainer`` facade: a torch driver, the engine that walks the lifecycle machine, and the
callbacks, put together for one run."""

from __future__ import annotations

import io
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog  # noqa: F401  # EventLog's console: 0.19 s of import paid with the Trainer's, not in its first fit
import torch
from torch import nn

from fsmtrain.app.defaults import default_callbacks as with_defaults
from fsmtrain.app.ranks import Settled, global_batch, settle_claim, share_resumption
from fsmtrain.app.rundir import RunDirClaim, claim_existing, claim_new, next_free
from fsmtrain.callbacks.checkpoint import CheckpointCallback
from fsmtrain.callbacks.progress_bar import current_stderr
from fsmtrain.core.chain import key_from_env
from fsmtrain.core.consensus import log_name_for_rank
from fsmtrain.core.context import UNBOUNDED_EPOCHS, RunContext
from fsmtrain.core.drawing import run_diagram
from fsmtrain.core.engine import Engine, Interrupted
from fsmtrain.core.events import FSYNC_POLICIES, EventLog, check_levels
from fsmtrain.core.hooks import TrainingCallback, bind_callbacks, unbind_callbacks
from fsmtrain.core.result import TrainResult
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.core.signals import preemption_signals as notices_of
from fsmtrain.core.signals import stop_on_signals
from fsmtrain.core.stop import StopReason
from fsmtrain.training.checkpoint_file import atomic_write_bytes
from fsmtrain.training.distributed import TorchCollective, shard_train_loader, shard_val_loader, wrap_model
from fsmtrain.training.driver import LossFn, MetricFn, TorchDriver, loader_generator
from fsmtrain.training.inference import run_over
from fsmtrain.training.optimizers import NamedOptimizers, NamedSchedulers, check_manual
from fsmtrain.training.precision import PrecisionPolicy
from fsmtrain.training.resume import Restart, ResumeError, Resumption, check_log_key
from fsmtrain.training.resume_match import mismatches
from fsmtrain.training.sharding import FsdpOptions, Sharding, gathered_weights, shard_model, sharding_line, unshardable
from fsmtrain.training.step import StepFn

__all__ = ["TrainResult", "Trainer"]


class Trainer:
    """Train ``model`` by walking the lifecycle machine. ``run_dir`` is claimed and locked for the run's life
    (``run_name``: a new run's folder, or the next free ``-2``, ``-3``…; neither: events in memory);
    ``resume_from="latest"`` continues it. ``step`` and ``val_step`` replace ``loss_fn`` with ``fn(model, batch)``;
    ``optimizer`` and ``scheduler`` may be mappings by name; ``max_epochs`` defaults to 1, or unbounded with
    ``max_steps``. ``default_callbacks`` adds those of ``fsmtrain train``; ``write_outputs`` writes ``model.pt`` and
    ``lifecycle.mmd``; ``preemption_signals`` save the last step and exit 143 (with several ranks, compared in a
    round every ``preemption_rounds_every`` batches; None: about every 500 ms); ``log_key`` (default
    ``FSMTRAIN_LOG_KEY``) makes the log's chain an HMAC. In a process group (``strategy`` ddp or fsdp) rank 0 owns
    the run dir."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
                 loss_fn: LossFn | None,
                 train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, max_epochs: int | None = None,
                 callbacks: Sequence[TrainingCallback] = (), scheduler: Any = None,
                 device: str | torch.device = "cpu", *, metrics: Mapping[str, MetricFn] | None = None,
                 run_dir: str | Path | RunDirClaim | None = None, run_name: str | Path | None = None,
                 run_id: str | None = None, log_level: str = "info", console_level: str = "warning",
                 strict: bool | None = None, extras: Mapping[str, Any] | None = None,
                 resume_from: str | Path | None = None, log_key: bytes | None = None,
                 collective: TorchCollective | None = None, default_callbacks: bool = True, precision: str = "32",
                 compile: bool = False, log_fsync: str = "commits", write_outputs: bool | None = None,
                 step: StepFn | None = None, val_step: StepFn | None = None, max_steps: int | None = None,
                 val_every_n_steps: int | None = None,
                 preemption_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"), preemption_rounds_every: int | None = None,
                 strategy: str = "ddp", fsdp: FsdpOptions | None = None) -> None:
        self.notices = notices_of(preemption_signals)
        self.rounds_every = preemption_rounds_every
        self.strategy, self.fsdp = strategy, fsdp or FsdpOptions()
        self.sharding: Sharding | None = None
        self.val_every_n_steps = val_every_n_steps
        max_epochs = max_epochs if max_epochs is not None else 1 if max_steps is None else UNBOUNDED_EPOCHS
        optimizer = NamedOptimizers(optimizer) if isinstance(optimizer, Mapping) else optimizer
        scheduler = NamedSchedulers(scheduler) if isinstance(scheduler, Mapping) else scheduler
        self.max_steps = max_steps
        _check_arguments(model, optimizer, train_loader, callbacks, run_dir, resume_from, strategy, log_fsync,
                         {"level": log_level, "console_level": console_level},
                         {"max_steps": (max_steps, 1, True), "val_every_n_steps": (val_every_n_steps, 1, True),
                          "max_epochs": (max_epochs, 0, False),
                          "preemption_rounds_every": (preemption_rounds_every, 1, True)})
        if run_name is not None:
            if run_dir is not None or resume_from is not None:
                raise ValueError("run_name names a new run's folder: give it without run_dir and resume_from")
            run_dir = next_free(run_name)
            extras = {**(extras or {}), "run_name": str(run_name)}  # run_start records the name asked for
            if run_dir != Path(run_name):
                print(f"fsmtrain: {run_name} holds a run; this one goes to {run_dir}", file=sys.stderr, flush=True)
        self.precision = PrecisionPolicy(precision, torch.device(device))
        self.write_outputs = default_callbacks if write_outputs is None else write_outputs
        if default_callbacks:
            target = run_dir.path if isinstance(run_dir, RunDirClaim) else None if run_dir is None else Path(run_dir)
            callbacks = with_defaults(callbacks, run_dir=target, max_epochs=max_epochs)
        self.device = torch.device(device)
        meta = strategy == "fsdp" and any(p.is_meta for p in model.parameters())  # sharded, then made on the device
        self.model = model if meta else model.to(self.device)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.collective = collective if collective is not None else joined_collective(self.device)
        c = self.collective
        self.rank, self.world_size = (0, 1) if c is None else (c.rank, c.world_size)
        if strategy == "fsdp" and c is not None:
            callbacks = _sharded_callbacks(callbacks)  # on every rank, before any collective
        if self.rank > 0:
            callbacks = [cb for cb in callbacks if not cb.rank_zero_only]
        self.claim: RunDirClaim | None = None
        self.resumption: Resumption | None = None
        self.restart: Restart | None = None
        self.settled: Settled | None = None  # a multi-process run: the claim the ranks agreed on
        self.events: EventLog | None = None
        check_manual(step, callbacks, self.world_size)
        binding = bind_callbacks(callbacks)  # one another Trainer holds is refused before anything is claimed
        try:
            # Everything that can fail without the run directory is built before it is claimed.
            self.runner = CallbackRunner(callbacks)
            run_extras = _run_extras(extras, train_loader, self.collective, self.runner.callbacks, strategy)
            self.driver = self._driver(loss_fn, train_loader, val_loader, metrics, run_extras, compile,
                                       (step, val_step))
            self.run_dir = self._claim(run_dir, resume_from is not None)
            self._start(max_epochs, run_id, run_extras, resume_from, log_key, log_level, console_level, strict,
                        log_fsync)
        except BaseException:
            self.close()  # a claim this constructor made is let go: a retry finds the folder free
            unbind_callbacks(callbacks, binding)
            raise

    def _driver(self, loss_fn: LossFn | None, train_loader: Iterable[Any], val_loader: Iterable[Any] | None,
                metrics: Mapping[str, MetricFn] | None, run_extras: Mapping[str, Any], compile: bool,
                steps: tuple[StepFn | None, StepFn | None]) -> TorchDriver:
        train_model: nn.Module | None = None
        rank, world = self.rank, self.world_size
        if self.collective is not None:
            train_loader = shard_train_loader(train_loader, rank, world, int(run_extras.get("data_seed", 0)))
            val_loader = None if val_loader is None else shard_val_loader(val_loader, rank, world)
            if self.strategy == "fsdp":
                self.sharding = shard_model(self.model, self.optimizer, self.fsdp, self.device)  # in place
                train_model = self.model
            else:
                train_model = wrap_model(self.model, self.device)
        if any(p.is_meta for p in self.model.parameters()):
            raise ValueError("model: its parameters are on the meta device, which only strategy 'fsdp' on several "
                             "ranks materialises (each rank its shards); build it on a real device")
        return TorchDriver(
            self.model, self.optimizer, loss_fn, train_loader, val_loader,
            scheduler=self.scheduler, device=self.device, metrics=metrics,
            train_model=torch.compile(train_model or self.model) if compile else train_model,  # type: ignore[arg-type]
            all_reduce=None if self.collective is None else self.collective.all_reduce_sum,
            precision=self.precision, rank=rank, world_size=world, step=steps[0], val_step=steps[1],
        )

    def _start(self, max_epochs: int, run_id: str | None, run_extras: dict[str, Any], resume_from: str | Path | None,
               log_key: bytes | None, log_level: str, console_level: str, strict: bool | None, log_fsync: str) -> None:
        key = log_key if log_key is not None else key_from_env()
        found: Resumption | Restart | None = None
        if resume_from is not None and self.run_dir is not None:
            check_log_key(self.run_dir, key)
            found = share_resumption(self.collective, self.run_dir, resume_from, self.settled)
            if isinstance(found, Restart):
                self.restart = found
            else:
                self.resumption = found
                problems = mismatches(found.state, self.model, self.optimizer, self.scheduler)
                if problems:
                    raise ResumeError(f"{self.run_dir}: cannot resume from {found.shown}: {'; '.join(problems)}; "
                                      "build the Trainer with the model, optimizer and scheduler the run was trained "
                                      "with")
            run_id = found.tail.run_id or run_id
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.events = EventLog(
            self.run_dir / log_name_for_rank(self.rank) if self.run_dir is not None else None, self.run_id,
            level=log_level, console=current_stderr() if self.rank == 0 else None,  # one console: rank 0's
            console_level=console_level, keep=self.run_dir is None, key=key, fsync=log_fsync,
            start_seq=0 if found is None else found.tail.next_seq,
            config=run_extras.get("config"),  # the chain's genesis: run id and resolved config
        )
        self.run = RunContext(
            self.run_id, max_epochs, self.events,
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, run_dir=self.run_dir,
            max_steps=self.max_steps, val_every_n_steps=self.val_every_n_steps,
        )
        self.run.scaler = self.precision.scaler
        self.run.exact_metrics = self.driver.exact
        self.run.extras.update(run_extras)
        if self.sharding is not None:
            self.run.extras["sharding"] = self.sharding.record()
        line = sharding_line(self.sharding, self.strategy, self.world_size)
        if line is not None and self.rank == 0:
            print(f"fsmtrain: {line}", file=sys.stderr, flush=True)
        if self.settled is not None:
            self.run.extras.update(self.settled.record())  # the launch and the layout, in every rank's run_start
        if self.resumption is not None:
            self.run.extras["world_size_before"] = self.resumption.notes.get("world_size_before")
            if isinstance(self.run.extras.get("elastic"), dict):
                self.resumption.notes["restart"] = self.run.extras["elastic"]["restart"]
            self.resumption.prepare(self.run)
        outputs = self.write_outputs and self.run_dir is not None and (self.rank == 0 or self.sharding is not None)
        self.engine = Engine(self.driver, self.runner, self.run, strict=strict,
                             restore=None if found is None else found.restore, collective=self.collective,
                             outputs=self._write_outputs if outputs else None,
                             rounds_every=self.rounds_every)

    def _claim(self, run_dir: str | Path | RunDirClaim | None, resume: bool) -> Path | None:
        """Claim the run directory (in a process group: rank 0, the others learn its path)."""
        def claim() -> RunDirClaim | None:
            if isinstance(run_dir, RunDirClaim):
                self.claim = run_dir
            elif run_dir is not None:
                self.claim = claim_existing(run_dir) if resume else claim_new(run_dir)
            return self.claim
        if self.collective is None:
            made = claim()
            return made.path if made is not None else None
        self.settled = settle_claim(self.collective, claim, uuid.uuid4().hex)
        self.collective.bind(self.settled.launch)  # the run's failure board
        return self.settled.path

    @property
    def callbacks(self) -> tuple[TrainingCallback, ...]:
        return self.runner.callbacks

    def fit(self) -> TrainResult:
        """Train. SIGINT and SIGTERM end the run at the next boundary with INTERRUPTED and raise
        ``Interrupted`` after the teardown (one landing during the teardown keeps the run's reason)."""
        try:
            with stop_on_signals(self.run, self.notices):
                result = self.engine.execute()
            late = self.run.pending_signal
            if late is not None and result.stop_reason is not StopReason.INTERRUPTED:
                raise Interrupted(late)
            return result
        finally:
            self.close()

    def predict(self, data: Iterable[Any] | None = None) -> Any:
        """The model's outputs over ``data`` (default: the val data), one row per example, from every rank."""
        return run_over(self.driver, self.run, self.collective, data).outputs

    def _write_outputs(self, run: RunContext, finished: bool) -> None:
        """The teardown's ``model.pt`` (when the run ended for its own reason) and ``lifecycle.mmd``."""
        assert self.run_dir is not None and self.events is not None and self.events.path is not None
        state: dict[str, Any] | None = self.model.state_dict() if finished else None
        if self.sharding is not None and self.collective is not None:  # gathered from every rank (rank 0 holds it)
            state, why = gathered_weights(self.model, self.collective, finished)
            if why is not None and finished:
                run.warn("trainer", f"model.pt is not written: {why}")
        if run.extras.get("rank", 0):
            return  # a rank of a sharded run: it gave its shards to rank 0's model.pt
        if state is not None:
            weights = io.BytesIO()
            torch.save(state, weights)  # the plain module's, not DDP's, FSDP's or compile's
            atomic_write_bytes(self.run_dir / MODEL_FILE, weights.getvalue())
        atomic_write_bytes(self.run_dir / DIAGRAM_FILE, run_diagram(self.events.path).encode("utf-8"))

    def close(self) -> None:
        """Close the log and let the run directory go (``fit`` does this itself)."""
        if self.events is not None:
            self.events.close()
        if self.claim is not None:
            self.claim.let_go()


def _sharded_callbacks(callbacks: Sequence[TrainingCallback]) -> list[TrainingCallback]:
    """A sharded run's callbacks: those needing whole tensors refused; checkpoints written by every rank."""
    refused = unshardable(callbacks)
    if refused:
        raise ValueError(f"strategy fsdp: {'; '.join(refused)} cannot work on sharded parameters (it needs the "
                         "whole parameters or gradients on one rank); leave it out or use strategy ddp")
    for cb in callbacks:
        if isinstance(cb, CheckpointCallback):
            cb.rank_zero_only = False  # type: ignore[misc]  # every rank writes its shards (rank 0 commits)
    return list(callbacks)


def joined_collective(device: torch.device, agreement_timeout_s: float = 600.0) -> TorchCollective | None:
    """This process's collective, when it is one of several ranks of an initialised process group."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCollective(device, agreement_timeout_s)
    return None


MODEL_FILE = "model.pt"
DIAGRAM_FILE = "lifecycle.mmd"


def _check_arguments(model: Any, optimizer: Any, train_loader: Iterable[Any], callbacks: Sequence[Any],
                     run_dir: Any, resume_from: Any, strategy: str, log_fsync: str, levels: Mapping[str, str],
                     counts: Mapping[str, tuple[Any, int, bool]]) -> None:
    """The constructor's arguments, checked before anything is built or claimed."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    for name, (value, low, optional) in counts.items():  # whole numbers >= low (or None where optional)
        if not (optional and value is None) and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, got {value!r}")
    for what, value, kind, shown in (("model", model, nn.Module, "torch.nn.Module"),
                                     ("optimizer", optimizer, torch.optim.Optimizer, "torch.optim.Optimizer")):
        if not isinstance(value, kind):
            raise TypeError(f"{what} must be a {shown}, got {type(value).__name__}")
    if hasattr(train_loader, "__len__") and len(train_loader) == 0:  # type: ignore[arg-type]
        raise ValueError("train_loader yields no batches (is the dataset smaller than one batch with drop_last?)")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, TrainingCallback):
            raise TypeError(f"callbacks[{i}] must be a TrainingCallback, got {type(cb).__name__}")
    if resume_from is not None and run_dir is None:
        raise ValueError("resume_from needs the run_dir of the run to continue")
    check_levels(**levels)
    if log_fsync not in FSYNC_POLICIES:
        raise ValueError(f"log_fsync: fsync must be one of {', '.join(FSYNC_POLICIES)}, got {log_fsync!r}")


def _run_extras(extras: Mapping[str, Any] | None, train_loader: Iterable[Any], collective: TorchCollective | None,
                callbacks: Sequence[TrainingCallback], strategy: str) -> dict[str, Any]:
    """What ``run_start`` records of the run beyond its config: data seed, global batch, rank layout."""
    run_extras = dict(extras or {})
    gen = loader_generator(train_loader)
    if gen is not None:
        run_extras.setdefault("data_seed", gen.initial_seed())
    batch = global_batch(train_loader, 1 if collective is None else collective.world_size, callbacks)
    if batch is not None:
        run_extras["global_batch"] = batch
    if collective is not None:
        run_extras.update(rank=collective.rank, world_size=collective.world_size)
    run_extras["strategy"] = strategy
    return run_extras
