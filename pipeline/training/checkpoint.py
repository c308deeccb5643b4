"""The checkpoint store: what a checkpoint holds, which files an epoch gets, and how they reach the
disk without holding training up.

A checkpoint is one ``torch.save`` file of a plain dict that ``torch.load(weights_only=True)`` accepts:
tensors, numbers, strings, lists and dicts only (RNG states are converted to tensors and lists of
ints for that reason: :mod:`fsmtrain.training.rng`). It holds the model, optimizer and scheduler
state, every stateful callback's ``state_dict`` (keyed by callback name), whatever callbacks add in
``on_save_checkpoint``, the RNG states, the machine position and the config fingerprint.

Files in ``directory``: ``epoch_<n>.pt`` (periodic, ``n`` the epoch number, 1-based, kept
``keep_last_k`` by epoch number), ``best.pt`` and ``latest.pt`` (other names of an epoch's file).
A file exists for the audit and for resume only once the log has committed it (see
:class:`CheckpointManager`); one file is :mod:`fsmtrain.training.checkpoint_files`' business
(written hashed and atomically, loaded against its committed sha256). On the training thread an
epoch's state is only staged (:mod:`fsmtrain.training.staging`); the writer thread
(:mod:`fsmtrain.training.checkpoint_writer`) does the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsmtrain.core.context import CheckpointContext, EpochRecord, RunContext
from fsmtrain.training.atomic import atomic_link, fsync_dir
from fsmtrain.training.checkpoint_files import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointWriteError,
    SavedCheckpoint,
    check_room,
    committed_sha256,
    load_checkpoint,
    save_state,
    sha256_of,
)
from fsmtrain.training.checkpoint_folder import CheckpointFolder
from fsmtrain.training.checkpoint_writer import SLOTS, CheckpointWriter, Job
from fsmtrain.training.resume_match import object_classes
from fsmtrain.training.rng import capture_rng_state
from fsmtrain.training.staging import BufferSet, Staged, stage, tensor_bytes

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointLog",
    "CheckpointManager",
    "HistoryText",
    "SavedCheckpoint",
    "WritePlan",
    "Written",
    "committed_sha256",
    "load_checkpoint",
    "read_history",
    "sha256_of",
]


def _callback_states(run: RunContext) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for i, cb in enumerate(run.callbacks):
        if not getattr(cb, "stateful", False):
            continue
        key = cb.name if cb.name not in states else f"{cb.name}#{i}"
        states[key] = cb.state_dict()
    return states


def _history_entry(epoch: int, metrics: Mapping[str, float]) -> str:
    # json.dumps writes floats as repr (exact) and non-finite ones as NaN/Infinity, which loads reads back
    return json.dumps({"epoch": epoch, "metrics": {k: float(v) for k, v in metrics.items()}}, separators=(",", ":"))


class HistoryText:
    """A checkpoint's ``history``: the epochs done as one JSON text (``[{"epoch", "metrics"}, …]``).

    One string pickles as one object (a list of dicts costs ``torch.save`` a call per number), and
    each epoch's entry is encoded once and kept, so a checkpoint costs O(1) encoding, not O(epochs)."""

    def __init__(self) -> None:
        self._records: list[EpochRecord] = []
        self._entries: list[str] = []

    def text(self, history: list[EpochRecord], epoch: int, metrics: Mapping[str, float]) -> str:
        n = len(self._records)
        if n > len(history) or (n and history[n - 1] is not self._records[-1]):
            self._records, self._entries, n = [], [], 0  # a new or replaced history: encode it afresh
        for record in history[n:]:
            self._records.append(record)
            self._entries.append(_history_entry(record.epoch, record.metrics))
        done = len(self._records)
        while done and self._records[done - 1].epoch >= epoch:  # only epochs before this one
            done -= 1
        return "[" + ",".join([*self._entries[:done], _history_entry(epoch, metrics)]) + "]"


def read_history(value: Any) -> list[dict[str, Any]]:
    """A checkpoint's ``history`` as a list of ``{"epoch", "metrics"}`` (the JSON text, or the list
    older checkpoints hold)."""
    entries: list[dict[str, Any]] = json.loads(value) if isinstance(value, str) else list(value or [])
    return entries


@dataclass(frozen=True)
class WritePlan:
    """One epoch's checkpoint, decided and staged on the training thread: what
    :meth:`CheckpointManager.write` puts on disk, on whichever thread runs it."""

    epoch: int
    periodic: bool
    roles: tuple[str, ...]  # "latest", "best": other names of the epoch's file
    staged: Staged  # the state, in host buffers no one else writes while it is pending
    chain_head: str | None  # the log's head the state stores

    @property
    def best(self) -> bool:
        return "best" in self.roles


@dataclass(frozen=True)
class Written:
    """What one write left on disk, durable, for the log to commit."""

    saved: tuple[SavedCheckpoint, ...]
    chain_head: str | None  # the log's head the files store


class CheckpointLog(Protocol):
    """Where the store reports what it did (the callback logs it)."""

    def committed(self, written: Written) -> None: ...  # on the writer thread, once durable

    def removed(self, paths: tuple[Path, ...], beside: bool) -> None: ...  # before the files go

    def skipped(self, epoch: int, why: str, beside: bool) -> None: ...  # a state that is never written


class CheckpointManager(CheckpointFolder):
    """Decides which checkpoints an epoch gets, and writes them so that a kill at any moment leaves a
    committed checkpoint that loads, while training goes on.

    Policy (:meth:`kinds_for`): a periodic file when ``(epoch + 1) % save_every_n_epochs == 0``,
    ``best`` when the monitored value strictly improves (``mode`` "min" or "max") on a healthy
    epoch, and ``latest`` at every epoch end (``save_latest``; else with each periodic file and on
    the run's last epoch). ``keep_last_k=0`` keeps every periodic file.

    Protocol: :meth:`save` (the training thread) decides, asks the writer for a slot (a slow disk
    drops a waiting state rather than make training wait: :mod:`fsmtrain.training.checkpoint_writer`),
    builds the state and stages it into that slot's host buffers. :meth:`write` (the writer thread)
    waits for the staged copies, writes the state once in ``torch.save``'s format
    (:func:`fsmtrain.training.torch_file.write_torch_file`), hashed as it is written, as
    ``epoch_<n>.pt``, points each role (``latest.pt``, ``best.pt``) at it (a hard link, or a copy
    where links are not possible, swapped in atomically) and fsyncs the folder. The log then
    commits the files: from that moment they exist for the audit and for resume. Only after the
    commit are older files removed, so the newest committed state's file never goes before a newer
    one is committed.

    What is kept on disk: :class:`fsmtrain.training.checkpoint_folder.CheckpointFolder`.
    """

    def __init__(
        self,
        directory: str | Path,
        save_every_n_epochs: int = 1,
        keep_last_k: int = 3,
        save_best: bool = True,
        monitor: str = "val_loss",
        mode: str = "min",
        save_latest: bool = True,
        background: bool = False,
    ) -> None:
        if isinstance(save_every_n_epochs, bool) or not isinstance(save_every_n_epochs, int) or save_every_n_epochs < 1:
            raise ValueError(f"save_every_n_epochs must be an integer >= 1, got {save_every_n_epochs!r}")
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 0:
            raise ValueError(f"keep_last_k must be an integer >= 0 (0 keeps all), got {keep_last_k!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        super().__init__(directory, keep_last_k)
        self.save_every_n_epochs = save_every_n_epochs
        self.save_best = save_best
        self.save_latest = save_latest
        self.monitor = monitor
        self.mode = mode
        self.background = background
        self.best_value: float | None = None
        self.best_epoch: int | None = None
        self.writer = CheckpointWriter(background)
        self.buffers = [BufferSet() for _ in range(SLOTS)]
        self._history = HistoryText()
        self._made = False  # the folder exists (made once, not at every epoch's end)

    # --- policy --------------------------------------------------------------------------------
    def improved(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        return value < self.best_value if self.mode == "min" else value > self.best_value

    def kinds_for(self, epoch: int, metrics: Mapping[str, float], final: bool, healthy: bool = True) -> list[str]:
        """``healthy=False`` (a non-finite loss this epoch) never makes ``best``: its weights may not be finite."""
        kinds: list[str] = []
        if (epoch + 1) % self.save_every_n_epochs == 0:
            kinds.append("periodic")
        if self.save_best and healthy and self.improved(metrics.get(self.monitor)):
            kinds.append("best")
        if self.save_latest or "periodic" in kinds or final:
            kinds.append("latest")
        return kinds

    def settings(self) -> dict[str, Any]:
        """The policy, as the log records it (the audit reads which epochs expect a checkpoint)."""
        return {"directory": str(self.directory), "save_every_n_epochs": self.save_every_n_epochs,
                "keep_last_k": self.keep_last_k, "save_best": self.save_best, "save_latest": self.save_latest,
                "monitor": self.monitor, "mode": self.mode}

    # --- the training thread -------------------------------------------------------------------
    def build_state(self, run: RunContext, epoch: int, metrics: Mapping[str, float] | None = None) -> dict[str, Any]:
        model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
        state: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "run_id": run.run_id,
            "epoch": epoch,
            "chain_head": getattr(run.events, "head", None),  # pins the log as it was at this commit
            "position": {
                "phase": run.phase.value,
                "epoch": epoch,
                "next_epoch": epoch + 1,  # where a resume starts; data order restarts at batch 0
                "batch": 0,
                "global_step": run.global_step,
                "max_epochs": run.max_epochs,
            },
            "metrics": {k: float(v) for k, v in (metrics or {}).items()},
            # the epochs done, this one included (its record is appended after on_epoch_end)
            "history": self._history.text(run.history, epoch, metrics or {}),
            "model": model.state_dict() if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "callbacks": _callback_states(run),
            "rng": capture_rng_state(),
            "data_order": {"seed": run.extras.get("data_seed")},
            "config_fingerprint": run.extras.get("config_fingerprint"),
            "classes": object_classes(model, optimizer, scheduler),  # what a Trainer resuming it must hold
            "best": {"monitor": self.monitor, "mode": self.mode, "value": self.best_value, "epoch": self.best_epoch},
            "extra": {},
        }
        return state

    def save(self, run: RunContext, epoch: int, metrics: Mapping[str, float], final: bool, log: CheckpointLog,
             healthy: bool = True) -> WritePlan | None:
        """This epoch's checkpoint: decided, staged and handed to the writer (written now, when not
        ``background``). Returns the plan, or None when nothing is due or the state is left out (a
        slow disk; ``log.skipped`` says so)."""
        kinds = self.kinds_for(epoch, metrics, final, healthy)
        if "best" in kinds:
            self.best_value = float(metrics[self.monitor])
            self.best_epoch = epoch
        if not kinds:
            return None
        room = self.writer.make_room(epoch, "best" in kinds, final)
        if room.dropped is not None:
            log.skipped(room.dropped, room.dropped_why, False)
        if room.slot is None:
            log.skipped(epoch, room.skipped, False)
            return None
        if not self._made:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._made = True
        state = self.build_state(run, epoch, metrics)
        run.dispatch("on_save_checkpoint", CheckpointContext(run, state, str(self.periodic_path(epoch))))
        # A foreground write is done before training goes on: it saves the live tensors, no copy needed.
        staged = (stage(state, self.buffers[room.slot]) if self.background
                  else Staged(state, staged_bytes=tensor_bytes(state)))
        plan = WritePlan(epoch, "periodic" in kinds, tuple(r for r in ("latest", "best") if r in kinds), staged,
                         state.get("chain_head"))
        self.writer.submit(Job(epoch, room.slot, plan.best, lambda: self._commit(plan, log)))
        return plan

    def drain(self) -> None:
        """Wait for every pending write and its commit; a failed write's error is raised here."""
        self.writer.drain()

    def close(self) -> None:
        """Stop the writer thread and free the staging buffers (``train_end``, after :meth:`drain`)."""
        self.writer.close()
        for buffers in self.buffers:
            buffers.release()

    def reset(self, on_dropped: Callable[[int, str], None] | None = None) -> None:
        """A fresh writer for a new run (``train_begin``): an earlier run's failure does not carry over."""
        self.writer.close()
        self.writer = CheckpointWriter(self.background, on_dropped)

    # --- the writer thread ---------------------------------------------------------------------
    def write(self, plan: WritePlan) -> Written:
        """Put ``plan`` on disk (see the class docstring); touches no run state, so any thread may run it."""
        plan.staged.wait()
        epoch_file = writing = self.periodic_path(plan.epoch)
        try:
            check_room(epoch_file, plan.staged.staged_bytes)
        except OSError as exc:
            raise CheckpointWriteError.of(exc, plan.epoch, epoch_file, plan.staged.staged_bytes) from exc
        try:
            digest = save_state(epoch_file, plan.staged.state)
            saved = [SavedCheckpoint(epoch_file, digest, plan.epoch, "periodic" if plan.periodic else "epoch")]
            for role in plan.roles:
                path = writing = self.path_for(role, plan.epoch)
                atomic_link(epoch_file, path, sync_dir=False)
                saved.append(SavedCheckpoint(path, digest, plan.epoch, role))
            writing = self.directory
            fsync_dir(self.directory)  # one fsync makes the renames above durable together
        except OSError as exc:  # named: which epoch, which file, which device and its free space
            raise CheckpointWriteError.of(exc, plan.epoch, writing) from exc
        return Written(tuple(saved), plan.chain_head)

    def _commit(self, plan: WritePlan, log: CheckpointLog) -> None:
        written = self.write(plan)
        log.committed(written)
        self.committed(plan.epoch, plan.periodic)
        self._remove(self._redundant(keep_newest=True), log, beside=True)

    def _remove(self, paths: tuple[Path, ...], log: CheckpointLog, beside: bool) -> None:
        if not paths:
            return
        log.removed(paths, beside)  # first: a file the log still commits is never missing
        for path in paths:
            path.unlink(missing_ok=True)
        fsync_dir(self.directory)

    # --- retention -------------------------------------------------------------------------------
    def finish(self, log: CheckpointLog) -> tuple[Path, ...]:
        """Once every write is committed: remove what the last commit made redundant (the newest
        epoch's own file when it is not periodic: ``latest.pt`` holds its bytes)."""
        removed = self._redundant(keep_newest=False)
        self._remove(removed, log, beside=False)
        return removed

    # --- reading -------------------------------------------------------------------------------
    def load(self, path: str | Path) -> dict[str, Any]:
        return load_checkpoint(path)

    # --- the manager's own state (best so far), for resume ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_epoch = state.get("best_epoch")
