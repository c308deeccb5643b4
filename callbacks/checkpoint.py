"""Write periodic, best and latest checkpoints at the end of each fully evaluated epoch."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from pipeline.core.context import EpochContext, RunContext
from pipeline.core.hooks import ReplaySupport, Tier, TrainingCallback
from pipeline.core.stop import StopReason
from pipeline.training.checkpoint import CheckpointManager, SavedCheckpoint, Written

__all__ = ["CheckpointCallback"]


@functools.lru_cache(maxsize=64)
def _shown_dir(directory: str, run_dir: str | None) -> str:
    """A folder relative to the run directory when it is under it, else absolute. Lexical (no
    symlink resolution), and cached: checkpoint folders do not move during a run."""
    absolute = os.path.abspath(directory)
    if run_dir is not None:
        relative = os.path.relpath(absolute, os.path.abspath(run_dir))
        if not relative.startswith(os.pardir):
            return relative
    return absolute


def _shown(path: Path, run: RunContext) -> str:
    return _shown_in(str(path.parent), path.name, run)


def _shown_in(folder: str, name: str, run: RunContext) -> str:
    shown = _shown_dir(folder, None if run.run_dir is None else str(run.run_dir))
    return name if shown == os.curdir else os.path.join(shown, name)


class CheckpointCallback(TrainingCallback):
    """On ``on_epoch_end`` (priority 95, last, so the epoch is fully evaluated): the policy and the
    commit protocol of :class:`pipeline.training.checkpoint.CheckpointManager`. The state is captured
    there; with ``background=True`` (the default) its bytes are written on a writer thread while the
    next epoch trains, and the writer logs them the moment they are durable: a ``checkpoint`` event
    per file (path, sha256, epoch, kind, and ``chain_head``: the log's chain head the file stores) and
    a ``checkpoint_removed`` event per file removed. The next epoch's end and ``train_end`` wait for
    a write still in flight. ``background=False`` writes and logs the same files before the epoch
    ends. A failed write is raised at the next phase boundary (an epoch's or validation's start, the
    next epoch's end, or ``train_end``).
    In replay (``run.dry_run``) no file is written; ``checkpoint_planned`` events record intent."""

    priority = 95
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    replay = ReplaySupport.DRY

    def __init__(
        self,
        directory: str | Path,
        save_every_n_epochs: int = 1,
        keep_last_k: int = 3,
        save_best: bool = True,
        monitor: str = "val_loss",
        mode: str = "min",
        save_latest: bool = True,
        background: bool = True,
    ) -> None:
        self.manager = CheckpointManager(directory, save_every_n_epochs, keep_last_k, save_best, monitor, mode,
                                         save_latest, background)
        self.saved: list[SavedCheckpoint] = []

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self.manager.pending.raise_failure()

    def on_val_begin(self, epoch: EpochContext) -> None:
        self.manager.pending.raise_failure()

    def on_epoch_end(self, epoch: EpochContext) -> None:
        run = epoch.run
        final = run.stop is not None or epoch.index + 1 >= run.max_epochs
        # NaNDetectionCallback (priority 5) has spoken by now: a NAN epoch's weights are never `best`.
        healthy = run.stop is None or run.stop.reason is not StopReason.NAN
        if run.dry_run:
            kinds = self.manager.kinds_for(epoch.index, epoch.metrics, final, healthy)
            if "best" in kinds:
                self.manager.best_value = float(epoch.metrics[self.manager.monitor])
                self.manager.best_epoch = epoch.index
            folder = str(self.manager.directory)
            for kind in kinds:
                epoch.emit("checkpoint_planned", path=_shown_in(folder, self.manager.name_for(kind, epoch.index), run),
                           epoch=epoch.index, kind=kind)
            return
        self.manager.collect()  # the previous write is committed before this state pins the log
        plan = self.manager.plan(run, epoch.index, epoch.metrics, final, healthy)
        if plan is not None:
            self.manager.submit(plan, lambda written: self._log(run, written))

    def on_train_end(self, run: RunContext) -> None:
        if run.dry_run:
            return
        try:
            self.manager.collect()
        finally:
            self.manager.pending.close()
        for path in self.manager.finish():
            run.emit("checkpoint_removed", path=_shown(path, run))

    def _log(self, run: RunContext, written: Written) -> None:
        """Commit what a write made durable (on the writer thread, for a background write)."""
        for ck in written.saved:
            run.emit_beside("checkpoint", path=_shown(ck.path, run), sha256=ck.sha256, epoch=ck.epoch, kind=ck.kind,
                            chain_head=written.chain_head)
        for path in written.removed:
            run.emit_beside("checkpoint_removed", path=_shown(path, run))
        self.saved.extend(written.saved)

    def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)
