"""Periodic, best and latest checkpoints at each fully evaluated epoch's end, and at steps when asked."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fsmtrain.core.context import CheckpointContext, EpochContext, FaultContext, RunContext, StepContext, epoch_number
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.events import EVENTS_FILE
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback, int_at_least
from fsmtrain.core.ledger import committed_checkpoints
from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.stop import StopReason
from fsmtrain.training.checkpoint import CheckpointLog, CheckpointManager, shown_path
from fsmtrain.training.sharding import writers_group

__all__ = ["CheckpointCallback"]


class CheckpointCallback(TrainingCallback):
    """On ``on_epoch_end`` (priority 95, last, so the epoch is fully evaluated): the policy and commit
    protocol of :class:`~fsmtrain.training.checkpoint.CheckpointManager`, its writer thread (``background``)
    logging each file once durable and raising a failed write at the next phase boundary; a replay only
    logs ``checkpoint_planned``. ``every_n_steps`` / ``every_minutes``: also a ``step_<n>.pt`` holding the
    data position, so a resume continues with the next batch."""

    priority = 95
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    replay = ReplaySupport.DRY

    def __init__(self, directory: str | Path, save_every_n_epochs: int = 1, keep_last_k: int = 3,
                 save_best: bool = True, monitor: str = "val_loss", mode: str = "min", save_latest: bool = True,
                 background: bool = True, drain_timeout_s: float = 600.0, every_n_steps: int | None = None,
                 every_minutes: float | None = None) -> None:
        self.drain_timeout_s = drain_timeout_s  # how long the teardown waits for the last writes
        self.every_n_steps = None if every_n_steps is None else int_at_least("every_n_steps", every_n_steps, 1)
        if every_minutes is not None and not every_minutes > 0:
            raise ValueError(f"every_minutes must be > 0, got {every_minutes!r}")
        self.every_seconds = None if every_minutes is None else 60.0 * every_minutes
        self._due = math.inf  # the clock time of the next checkpoint by minutes
        self.manager = CheckpointManager(directory, save_every_n_epochs, keep_last_k, save_best, monitor, mode,
                                         save_latest, background)
        self._log: CheckpointLog | None = None
        self._saved_epoch: int | None = None  # the last epoch whose end the policy saved

    def on_train_begin(self, run: RunContext) -> None:
        if run.dry_run:
            return
        settings = {**self.manager.settings(), "directory": shown_path(self.manager.directory, run.run_dir)}
        if not run.extras.get("rank", 0):  # a sharded run's other ranks write shards, rank 0 commits them
            run.emit("checkpoint_settings", source=self.name, settings=settings)
        self._log = CheckpointLog(run)
        self.manager.sharded = run.extras.get("strategy") == "fsdp"  # a folder of shards (DCP), on any world size
        self.manager.rank = int(run.extras.get("rank", 0))
        self.manager.group = writers_group(run.model)
        self.manager.reset(lambda epoch, why, step: self._sink().skipped(epoch, why, True, step))
        self._due = time.monotonic() + (self.every_seconds or math.inf)

    def overridden_hooks(self) -> tuple[str, ...]:
        hooks = super().overridden_hooks()  # no per-batch hook unless checkpoints at steps are asked for
        steps = self.every_n_steps is not None or self.every_seconds is not None
        return hooks if steps else tuple(h for h in hooks if h != "on_train_step_end")

    def on_train_step_end(self, step: StepContext) -> None:
        run = step.run
        done = run.global_step + 1  # this step, counted once its hooks have run
        n, every = self.every_n_steps, self.every_seconds
        if not ((n is not None and done % n == 0) or (every is not None and time.monotonic() >= self._due)):
            return
        self._due = time.monotonic() + (every or math.inf)
        if run.dry_run:
            return self._plan_step(step, done)
        self.manager.writer.raise_failure()
        if self.manager.sharded and step.skip_optimizer_step:
            return self._sink().skipped(run.epoch, _MID_WINDOW.format(f"step {done}"), False, done)
        self.manager.save_step(run, done, step.batch_index + 1, self._sink())

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self.manager.writer.raise_failure()

    on_val_begin = on_train_epoch_begin

    def on_val_end(self, epoch: EpochContext) -> None:
        """A validation inside the epoch that improves on the best: a step checkpoint with the ``best`` role."""
        run, m = epoch.run, self.manager
        if not epoch.inside or not m.save_best or (run.stop is not None and run.stop.reason is StopReason.NAN):
            return
        if m.improved(epoch.metrics.get(m.monitor)):
            m.best_value, m.best_epoch = float(epoch.metrics[m.monitor]), epoch.index
            if run.dry_run:
                return self._plan_step(epoch, run.global_step)
            m.save_step(run, run.global_step, int(run.epoch_state()["batch"]), self._sink(), best=True)

    def _plan_step(self, ctx: StepContext | EpochContext, step: int) -> None:
        """A replay's step checkpoint: only its intent, in the log."""
        path = shown_path(self.manager.step_path(step), ctx.run.run_dir)
        ctx.emit("checkpoint_planned", path=path, epoch=ctx.run.epoch, kind="step", step=step)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        run = epoch.run
        final = run.ends_after(epoch.index)
        # NaNDetectionCallback (priority 5) has spoken by now: a NAN epoch's weights are never `best`.
        healthy = run.stop is None or run.stop.reason is not StopReason.NAN
        if run.dry_run:
            for kind in self.manager.decide(epoch.index, epoch.metrics, final, healthy):
                path = self.manager.directory / self.manager.name_for(kind, epoch.index)
                epoch.emit("checkpoint_planned", path=shown_path(path, run.run_dir), epoch=epoch.index, kind=kind)
            return
        if self.manager.save(run, epoch.index, epoch.metrics, final, self._sink(), healthy) is not None:
            self._saved_epoch = epoch.index

    def on_exception(self, fault: FaultContext) -> None:
        """A signal stopped the run inside an epoch: the state after its last step is saved. At an epoch's
        end (a signal during its validation waits for it), the epoch is saved if its policy left it out."""
        run = fault.run
        if run.dry_run or not isinstance(fault.exception, Interrupted) or self._log is None:
            return
        if fault.phase is Phase.EPOCH_END:
            done = run.history[-1] if run.history else None
            if done is not None and done.epoch == run.epoch - 1 != self._saved_epoch:
                healthy = run.stop is None or run.stop.reason is not StopReason.NAN
                self.manager.save(run, done.epoch, done.metrics, True, self._sink(), healthy)
            return
        batch = int(run.epoch_state().get("batch", 0))
        if batch < 1 or fault.phase not in (Phase.TRAIN_STEP, Phase.VAL):
            return
        # A sharded run's ranks were stopped by an agreed signal at the same batch: each writes its shards.
        window = max([int(getattr(cb, "steps", 1)) for cb in run.callbacks if cb.name == "GradientAccumulationCallback"]
                     or [1])
        if self.manager.sharded and batch % window:
            run.warn(self.name, f"{fault.exception}: " + _MID_WINDOW.format(f"the state after step {run.global_step}")
                     + "; a resume continues from the last committed checkpoint")
            return
        if self.manager.save_step(run, run.global_step, batch, self._sink()) is not None and not self.manager.rank:
            run.emit("checkpoint_preempted", level="warning", source=self.name, step=run.global_step,
                     message=f"{fault.exception}: the state after step {run.global_step} (batch {batch} of epoch "
                     f"{epoch_number(run.epoch)}) is saved as {self.manager.step_path(run.global_step).name}; "
                     "`fsmtrain resume` continues from the next batch")

    def on_load_checkpoint(self, ckpt: CheckpointContext) -> None:
        """A resumed run: the files on disk are the ones its log commits."""
        run_dir = ckpt.run.run_dir
        if run_dir is not None and (Path(run_dir) / EVENTS_FILE).is_file():
            self.manager.adopt(committed_checkpoints(Path(run_dir) / EVENTS_FILE), Path(run_dir))

    def on_train_end(self, run: RunContext) -> None:
        if run.dry_run:
            return
        timed_out = False
        try:
            timed_out = not self.manager.writer.drain(self.drain_timeout_s)
        finally:
            self.manager.close(0 if timed_out else self.drain_timeout_s)  # timed out: not a second wait
        if timed_out:  # a hung disk must not hang the teardown: the run ends on what is committed
            run.warn(self.name, f"the checkpoint writer did not finish within {self.drain_timeout_s:g} s; the "
                     "teardown goes on without it, and the newest checkpoint the log commits is the one to resume "
                     "from", timeout_s=self.drain_timeout_s)
            return
        if self._log is not None and self._log.run is run:  # else the run failed before on_train_begin reached us
            self.manager.finish(self._log)

    def _sink(self) -> CheckpointLog:
        if self._log is None:
            raise RuntimeError("CheckpointCallback: on_train_begin has not run for this run")
        return self._log

    def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)


_MID_WINDOW = ("{} is not saved: it falls inside a gradient accumulation window, and a sharded (FSDP2) run's "
               "gradients there live in FSDP's unsharded buffers, which a checkpoint does not hold")
