"""The checkpoint folder: ``epoch_<n>.pt`` (1-based), ``best.pt`` and ``latest.pt`` (hard links to an
epoch's file). Kept: the last ``keep_last_k`` periodic files (``0``: all), the newest epoch's file, and
the newest older state besides, since one damaged file takes every name of its epoch with it. Only
files this run committed are removed; a committed file whose bytes changed is moved to ``damaged/``."""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fsmtrain.core.context import CheckpointContext, RunContext, epoch_number
from fsmtrain.core.hooks import int_at_least
from fsmtrain.core.ledger import CommittedFile
from fsmtrain.training import checkpoint_file as files
from fsmtrain.training import checkpoint_writer as writing
from fsmtrain.training.checkpoint_file import CheckpointError, CheckpointWriteError, load_checkpoint, sha256_of
from fsmtrain.training.checkpoint_writer import WritePlan, Written

__all__ = ["DAMAGED_DIR", "UNCOMMITTED_DIR", "CheckpointError", "CheckpointFolder", "CheckpointLog",
           "CheckpointManager", "CheckpointWriteError", "DamagedState", "WritePlan", "Written", "find_damaged",
           "load_checkpoint", "quarantine", "sha256_of", "shown_path"]

DAMAGED_DIR = "damaged"
UNCOMMITTED_DIR = "uncommitted"  # files in the folder the log never committed, kept as evidence
_PERIODIC = re.compile(r"^epoch_(\d+)(?:\.pt)?$")  # a sharded run's: a folder, no suffix
_STEP = re.compile(r"^step_(\d+)(?:\.pt)?$")


def shown_path(path: str | Path, run_dir: str | Path | None) -> str:
    """``path`` as the log shows it: relative to ``run_dir`` when under it, else absolute (lexically)."""
    absolute = os.path.abspath(path)
    if run_dir is not None:
        relative = os.path.relpath(absolute, os.path.abspath(run_dir))
        if not relative.startswith(os.pardir):
            return relative
    return absolute


class CheckpointLog:
    """Where the store reports what it did: the run's log, from the writer thread (``beside``) or the
    training thread."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.skips = 0

    def _emit(self, beside: bool, event: str, level: str = "info", **payload: Any) -> None:
        (self.run.emit_at_log_position if beside else self.run.emit)(event, level=level, **payload)

    def syncs_each_line(self) -> bool:
        """Whether the log makes each line durable as it is written (``log: {fsync: every}``)."""
        return self.run.events.fsync == "every"

    def committed(self, written: Written) -> None:
        run = self.run
        unsynced = False  # one fsync of the log for the commit's lines, after the last
        for ck in written.saved:
            intent: dict[str, Any] = {"roles": list(ck.roles)} if ck.roles else {}  # the names it gets next
            if ck.step is not None:
                intent["step"] = ck.step
            if ck.shards is not None:  # a sharded checkpoint's folder: each of its files
                intent["shards"] = dict(ck.shards)
            unsynced |= run.emit_at_log_position(
                "checkpoint", path=shown_path(ck.path, run.run_dir), sha256=ck.sha256, epoch=ck.epoch, kind=ck.kind,
                chain_head=written.chain_head, defer_sync=True, **intent)
        if unsynced and not any(ck.roles for ck in written.saved):  # the roles' lines follow: one fsync for all
            run.events.sync()

    def removed(self, paths: tuple[Path, ...], beside: bool) -> None:
        for path in paths:
            self._emit(beside, "checkpoint_removed", path=shown_path(path, self.run.run_dir))

    def skipped(self, epoch: int, why: str, beside: bool, step: int | None = None) -> None:
        self.skips += 1
        first = self.skips == 1
        extra: dict[str, Any] = {"note": "later skips are in events.jsonl only"} if first else {}
        if step is not None:
            extra["step"] = step
        hpo = self.run.extras.get("hpo")
        if isinstance(hpo, dict) and hpo.get("trial") is not None:  # which trial's run, in a study
            why, extra["trial"] = f"trial {hpo['trial']}: {why}", hpo["trial"]
        self._emit(beside, "checkpoint_skipped", level="warning" if first else "info", epoch=epoch, reason=why,
                   **extra)


class CheckpointFolder:
    """File names in ``directory`` and the epochs whose files this run committed and keeps there (recorded
    by the writer thread; the training thread reads them only when no write is pending)."""

    def __init__(self, directory: str | Path, keep_last_k: int) -> None:
        self.directory = Path(directory)
        self.keep_last_k = keep_last_k
        self.periodic: list[int] = []  # epochs whose periodic file is kept, oldest first
        self.transient: list[int] = []  # epochs whose non-periodic epoch file is kept
        self.newest: int | None = None  # the newest epoch committed
        self.steps: list[int] = []  # global steps whose step_<n>.pt is kept, oldest first
        self.sharded = False  # FSDP: each checkpoint a folder of every rank's shards (DCP), written by every rank
        self.rank = 0  # a sharded run's rank: only rank 0 commits, links and removes
        self.group: Any = None  # a sharded run's: the writers' process group (sharding.writers_group)

    @property
    def suffix(self) -> str:
        return "" if self.sharded else ".pt"

    def name_for(self, kind: str, epoch: int) -> str:
        """The file name of ``kind`` (``periodic``, ``best``, ``latest``) for ``epoch``."""
        return f"epoch_{epoch_number(epoch)}{self.suffix}" if kind == "periodic" else f"{kind}{self.suffix}"

    def periodic_path(self, epoch: int) -> Path:
        return self.directory / self.name_for("periodic", epoch)

    def step_path(self, step: int) -> Path:
        return self.directory / f"step_{step}{self.suffix}"

    def _redundant_steps(self) -> tuple[Path, ...]:
        """Forget and return the step files beyond the newest ``keep_last_k`` (never the newest two)."""
        keep = max(self.keep_last_k, 2) if self.keep_last_k else len(self.steps)
        gone, self.steps = self.steps[:-keep], self.steps[-keep:]
        return tuple(self.step_path(s) for s in gone)

    def list_periodic(self) -> list[Path]:
        """Periodic checkpoint files in the folder, oldest epoch first (by number, not by name)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _PERIODIC.match(p.name))]
        return [p for _, p in sorted(found)]

    def committed(self, epoch: int, periodic: bool) -> None:
        """The log committed ``epoch``'s files: it is the newest state on disk."""
        self.newest = epoch
        self.periodic = sorted(e for e in {*self.periodic, epoch} if periodic or e != epoch)
        self.transient = sorted(e for e in {*self.transient, epoch} if not periodic or e != epoch)

    def _redundant(self, *, keep_newest: bool) -> tuple[Path, ...]:
        """Forget and return the epoch files no longer kept; ``keep_newest`` spares the newest epoch's file."""
        on_disk = sorted({*self.periodic, *self.transient})
        if not on_disk:
            return ()
        newest = self.newest if self.newest is not None else on_disk[-1]
        keep = set(self.periodic[-self.keep_last_k:] if self.keep_last_k else self.periodic)
        if keep_newest:
            keep.add(newest)
        older = [e for e in on_disk if e < newest]
        if older:
            keep.add(older[-1])  # the state a resume falls back to when the newest one is damaged
        self.periodic = [e for e in self.periodic if e in keep]
        self.transient = [e for e in self.transient if e in keep]
        return tuple(self.periodic_path(e) for e in on_disk if e not in keep)

    def adopt(self, committed: Mapping[str, CommittedFile], run_dir: Path | None) -> None:
        """A resumed run: what is on disk, from the files its log commits (the checkpoint cannot know)."""
        self.periodic, self.transient, self.newest, self.steps = [], [], None, []
        folder = self.directory.resolve()
        for shown, done in committed.items():
            if done.epoch is None:
                continue
            path = Path(shown) if Path(shown).is_absolute() or run_dir is None else run_dir / shown
            here = path.parent.resolve() == folder and path.exists()
            if (step := _STEP.match(path.name)) and here:
                self.steps.append(int(step.group(1)))
                continue
            self.newest = max(done.epoch, self.newest if self.newest is not None else done.epoch)
            if _PERIODIC.match(path.name) and here:
                (self.periodic if done.kind == "periodic" else self.transient).append(done.epoch)
        self.periodic, self.transient, self.steps = sorted(self.periodic), sorted(self.transient), sorted(self.steps)


@dataclass(frozen=True)
class DamagedState:
    """The committed files of one checkpointed state whose bytes changed."""

    epoch: int | None
    committed_sha256: str
    paths: tuple[str, ...]  # as the log shows them
    found_sha256: tuple[str, ...]  # what each file hashes to now


def find_damaged(run_dir: Path, live: Mapping[str, CommittedFile]) -> tuple[set[str], list[DamagedState]]:
    """Hash every committed file still there (each inode once): the intact paths, and the damaged states,
    newest first, each with every name it has. A committed file that is gone is in neither."""
    seen: dict[tuple[int, int, int, int], str] = {}
    intact: set[str] = set()
    groups: dict[str, list[tuple[str, str, CommittedFile]]] = {}
    for shown, done in live.items():
        try:
            st = (run_dir / shown).stat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        found = seen.get(key) or seen.setdefault(key, sha256_of(run_dir / shown))
        if found == done.sha256:
            intact.add(shown)
        else:
            groups.setdefault(done.sha256, []).append((shown, found, done))
    states = [DamagedState(files[0][2].epoch, sha, tuple(f[0] for f in files), tuple(f[1] for f in files))
              for sha, files in groups.items()]
    return intact, sorted(states, key=lambda d: -1 if d.epoch is None else d.epoch, reverse=True)


def quarantine(run_dir: Path, state: DamagedState, folder: str = DAMAGED_DIR) -> tuple[str, ...]:
    """Move ``state``'s files into ``folder`` beside them (a name already there gets a number), so the
    evidence stays and no later write replaces it; returns where each went, as the log shows paths."""
    moved: list[str] = []
    folders: set[Path] = set()
    for shown in state.paths:
        source = run_dir / shown
        target_dir = source.parent / folder
        target_dir.mkdir(exist_ok=True)
        stem, dot, suffix = source.name.rpartition(".")
        target, n = target_dir / source.name, 2
        while target.exists():
            target, n = target_dir / (f"{stem}.{n}{dot}{suffix}" if dot else f"{source.name}.{n}"), n + 1
        os.replace(source, target)
        folders.update((source.parent, target_dir))
        moved.append(shown_path(target, run_dir))
    for changed in folders:
        files.fsync_dir(changed)
    return tuple(moved)


class CheckpointManager(CheckpointFolder):
    """Decides which checkpoints an epoch gets and writes them so that a kill at any moment leaves a
    committed checkpoint that loads. :meth:`save` (training thread) stages the state; :meth:`write`
    (writer thread) writes ``epoch_<n>.pt``; the log commits it with its roles, only then is each role
    linked and committed, and only after that are older files removed."""

    def __init__(self, directory: str | Path, save_every_n_epochs: int = 1, keep_last_k: int = 3,
                 save_best: bool = True, monitor: str = "val_loss", mode: str = "min", save_latest: bool = True,
                 background: bool = False) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        super().__init__(directory, int_at_least("keep_last_k (0 keeps all)", keep_last_k, 0))
        self.save_every_n_epochs = int_at_least("save_every_n_epochs", save_every_n_epochs, 1)
        self.save_best, self.save_latest, self.background = save_best, save_latest, background
        self.monitor, self.mode = monitor, mode
        self.best_value: float | None = None
        self.best_epoch: int | None = None
        self.writer = writing.CheckpointWriter(background)
        self.buffers = [writing.BufferSet() for _ in range(writing.SLOTS)]
        self.history_texts: files.HistoryTexts = {}
        self.serialized_at_most: int | None = writing.SERIALIZED_AT_MOST  # None: every state is staged
        self.removals_unsynced = False  # files removed since the folder's last fsync (see _remove)

    def improved(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return self.best_value is None or (value < self.best_value if self.mode == "min" else value > self.best_value)

    def decide(self, epoch: int, metrics: Mapping[str, float], final: bool, healthy: bool = True) -> list[str]:
        """The kinds of file ``epoch`` gets: ``periodic`` every ``save_every_n_epochs``; ``best`` when the
        monitored value strictly improves on a ``healthy`` epoch; ``latest`` at every epoch end (without
        ``save_latest``: with ``periodic`` and when ``final``)."""
        kinds: list[str] = []
        if (epoch + 1) % self.save_every_n_epochs == 0:
            kinds.append("periodic")
        if self.save_best and healthy and self.improved(metrics.get(self.monitor)):
            kinds.append("best")
            self.best_value = float(metrics[self.monitor])
            self.best_epoch = epoch
        if self.save_latest or "periodic" in kinds or final:
            kinds.append("latest")
        return kinds

    def settings(self) -> dict[str, Any]:
        """The policy, as the log records it (the audit reads which epochs expect a checkpoint)."""
        return {"directory": str(self.directory), "save_every_n_epochs": self.save_every_n_epochs,
                "keep_last_k": self.keep_last_k, "save_best": self.save_best, "save_latest": self.save_latest,
                "monitor": self.monitor, "mode": self.mode}

    # --- the training thread -------------------------------------------------------------------
    def save(self, run: RunContext, epoch: int, metrics: Mapping[str, float], final: bool, log: CheckpointLog,
             healthy: bool = True) -> WritePlan | None:
        """This epoch's checkpoint, decided, staged and handed to the writer; None when nothing is due or
        the state is left out (``log.skipped`` says so)."""
        kinds = self.decide(epoch, metrics, final, healthy)
        return self._stage(run, epoch, metrics, kinds, final, log, None) if kinds else None

    def save_step(self, run: RunContext, step: int, batch: int, log: CheckpointLog,
                  best: bool = False) -> WritePlan | None:
        """A checkpoint inside epoch ``run.epoch`` after global step ``step`` (its ``batch``-th batch):
        ``step_<step>.pt`` and ``latest``, and ``best`` after an improving validation inside the epoch."""
        return self._stage(run, run.epoch, {}, ["step", "latest", *(["best"] if best else [])], False, log,
                           (step, batch))

    def _stage(self, run: RunContext, epoch: int, metrics: Mapping[str, float], kinds: list[str], final: bool,
               log: CheckpointLog, at: tuple[int, int] | None) -> WritePlan | None:
        step = None if at is None else at[0]
        if self.sharded:  # every rank writes each state, in order: none is dropped or left out on one rank only
            self.writer.wait_idle()
        slot, left_out = self.writer.claim_slot(epoch, "best" in kinds, final, step)
        if left_out is not None:
            log.skipped(left_out[0], left_out[1], False, left_out[2])
        if slot is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        best = {"monitor": self.monitor, "mode": self.mode, "value": self.best_value, "epoch": self.best_epoch}
        state = files.run_state(run, epoch, metrics, best, at, self.history_texts)
        path = self.periodic_path(epoch) if step is None else self.step_path(step)
        run.dispatch("on_save_checkpoint", CheckpointContext(run, state, str(path)))
        # A foreground write is done before training goes on: it saves the live tensors, no copy needed.
        staged = (writing.stage(state, self.buffers[slot], None if self.sharded else self.serialized_at_most)
                  if self.background
                  else writing.Staged(state, staged_bytes=writing.tensor_bytes(state)))
        plan = WritePlan(epoch, "periodic" in kinds, tuple(r for r in ("latest", "best") if r in kinds), staged,
                         state.get("chain_head"), path, step)
        self.writer.submit(writing.Job(epoch, slot, "best" in kinds, lambda: self._commit(plan, log), step))
        return plan

    def close(self, timeout: float | None = None) -> bool:
        """Stop the writer thread and free the staging buffers; False: still writing after ``timeout``."""
        stopped = self.writer.close(timeout)
        self.group = None  # the process group ends with the run
        for buffers in self.buffers:
            buffers.release()
        return stopped

    def reset(self, on_dropped: Callable[[int, str, int | None], None] | None = None) -> None:
        """A fresh writer for a new run (``train_begin``): an earlier run's failure does not carry over."""
        self.writer.close()
        self.writer = writing.CheckpointWriter(self.background, on_dropped)

    # --- the writer thread ---------------------------------------------------------------------
    def write(self, plan: WritePlan) -> Written:
        """``plan``'s epoch file, its bytes durable (its name once the folder is fsync'd: :meth:`_commit`), with
        the roles it is to get (:meth:`link_roles`, once committed)."""
        plan.staged.wait()
        epoch_file = plan.path
        try:
            files.check_free_space(epoch_file, plan.staged.staged_bytes)
        except OSError as exc:
            raise CheckpointWriteError.of(exc, plan.epoch, epoch_file, plan.staged.staged_bytes) from exc
        shards: dict[str, str] | None = None
        try:
            if self.sharded:  # on a rank other than 0 nothing to commit: rank 0 commits every rank's files
                digest, shards = files.save_folder(epoch_file, plan.staged.state, self.group) or ("", None)
            else:
                digest = files.save_state(epoch_file, plan.staged.state, plan.staged.data)
        except OSError as exc:  # named: which epoch, which file, which device and its free space
            raise CheckpointWriteError.of(exc, plan.epoch, epoch_file) from exc
        kind = "step" if plan.step is not None else "periodic" if plan.periodic else "epoch"
        return Written((files.SavedCheckpoint(epoch_file, digest, plan.epoch, kind, plan.roles, plan.step, shards),),
                       plan.chain_head)

    def link_roles(self, epoch_file: files.SavedCheckpoint, chain_head: str | None) -> Written:
        """Point each role of the committed ``epoch_file`` at it, one fsync for all (a kill before: resume finishes)."""
        saved, writing = [], self.directory
        try:
            for role in epoch_file.roles:
                writing = self.directory / self.name_for(role, epoch_file.epoch)
                files.atomic_link(epoch_file.path, writing, sync_dir=False)
                saved.append(replace(epoch_file, path=writing, kind=role, roles=()))
            writing = self.directory
            files.fsync_dir(self.directory)
        except OSError as exc:
            raise CheckpointWriteError.of(exc, epoch_file.epoch, writing) from exc
        return Written(tuple(saved), chain_head)

    def _commit(self, plan: WritePlan, log: CheckpointLog) -> None:
        # No log line may become durable before the name it commits. The epoch file's line is written unsynced
        # when roles follow, and the folder's fsync after the links comes before the log's: that one fsync makes
        # the rename durable too. Not so when nothing is linked, on a rank that only writes, or when the log
        # syncs each line as it is written.
        written = self.write(plan)
        if not plan.roles or self.rank != 0 or log.syncs_each_line():
            try:
                files.fsync_dir(self.directory)
            except OSError as exc:
                raise CheckpointWriteError.of(exc, plan.epoch, plan.path) from exc
        if self.rank:  # a sharded run's other ranks: rank 0 commits, links and removes
            return
        log.committed(written)  # first the epoch file, with the roles it is to get
        if plan.roles:
            log.committed(self.link_roles(written.saved[0], written.chain_head))
        if plan.step is not None:
            self.steps.append(plan.step)
            self._remove(self._redundant_steps(), log, beside=True)
            return
        self.committed(plan.epoch, plan.periodic)
        self._remove(self._redundant(keep_newest=True), log, beside=True)

    def _remove(self, paths: tuple[Path, ...], log: CheckpointLog, beside: bool) -> None:
        if self.rank:
            return
        if paths:
            log.removed(paths, beside)  # first: a file the log still commits is never missing
            for path in paths:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            self.removals_unsynced = True
        # A removal need not be durable before the next write: that write's fsync of the folder makes it so, and
        # the log's removal line is synced after it. The run's last removals are made durable here, once.
        if not beside and self.removals_unsynced:
            files.fsync_dir(self.directory)
            self.removals_unsynced = False

    def finish(self, log: CheckpointLog) -> None:
        """Once every write is committed: remove what the last commit made redundant, durably."""
        self._remove(self._redundant(keep_newest=False), log, beside=False)

    def state_dict(self) -> dict[str, Any]:  # the best so far, for resume
        return {"best_value": self.best_value, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_value, self.best_epoch = state.get("best_value"), state.get("best_epoch")
