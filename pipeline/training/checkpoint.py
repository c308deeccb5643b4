"""The checkpoint store: what a checkpoint holds, how it is written safely and read back.

A checkpoint is one ``torch.save`` of a plain dict that ``torch.load(weights_only=True)`` accepts:
tensors, numbers, strings, lists and dicts only (RNG states are converted to tensors and lists of
ints for that reason: :mod:`pipeline.training.rng`). It holds the model, optimizer and scheduler
state, every stateful callback's ``state_dict`` (keyed by callback name), whatever callbacks add in
``on_save_checkpoint``, the RNG states, the machine position and the config fingerprint.

Files in ``directory``: ``epoch_<n>.pt`` (periodic, ``n`` the epoch number, 1-based, kept
``keep_last_k`` by epoch number), ``best.pt`` and ``latest.pt`` (other names of an epoch's file).
Every write is atomic (:mod:`pipeline.training.atomic`); a file exists for the audit and for resume
only once the log has committed it (see :class:`CheckpointManager`), and loads check the bytes
against the committed sha256. The write may run on a background thread
(:mod:`pipeline.training.checkpoint_writer`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core.context import CheckpointContext, EpochRecord, RunContext, epoch_number
from pipeline.core.events import EVENTS_FILE
from pipeline.training.atomic import atomic_link, atomic_write_bytes, fsync_dir
from pipeline.training.checkpoint_writer import PendingWrite
from pipeline.training.resume_match import object_classes
from pipeline.training.rng import capture_rng_state

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
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

FORMAT_VERSION = 1
KINDS = ("periodic", "best", "latest")
_PERIODIC = re.compile(r"^epoch_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or not an fsmtrain checkpoint."""


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    sha256: str
    epoch: int
    kind: str


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    """One epoch's checkpoint, decided and serialised on the training thread: what
    :meth:`CheckpointManager.write` puts on disk, on whichever thread runs it."""

    epoch: int
    periodic: bool
    roles: tuple[str, ...]  # "latest", "best": other names of the epoch's file
    data: bytes  # the state, serialised once for every role
    chain_head: str | None  # the log's head the state stores
    remove: tuple[Path, ...]  # files the newest committed checkpoint made redundant


@dataclass(frozen=True)
class Written:
    """What one write left on disk, durable, for the log to commit."""

    saved: tuple[SavedCheckpoint, ...]
    removed: tuple[Path, ...]
    chain_head: str | None  # the log's head the files store


class CheckpointManager:
    """Decides which checkpoints an epoch gets, and writes them so that a kill at any moment leaves a
    committed checkpoint that loads.

    Policy (:meth:`plan`): a periodic file when ``(epoch + 1) % save_every_n_epochs == 0``, ``best``
    when the monitored value strictly improves (``mode`` "min" or "max") on a healthy epoch, and
    ``latest`` at every epoch end (``save_latest``; else with each periodic file and on the run's last
    epoch). ``keep_last_k=0`` keeps every periodic file.

    Protocol: :meth:`plan` captures the state and serialises it once, on the training thread.
    :meth:`write` (run by :meth:`submit`, on the writer thread when ``background``) writes those
    bytes once, atomically, as ``epoch_<n>.pt``, points each role (``latest.pt``, ``best.pt``) at it (a hard link,
    or a copy where links are not possible, swapped in atomically), removes the files the newest
    *committed* checkpoint made redundant, and fsyncs the folder once. The ``commit`` given to
    :meth:`submit` then logs the result (:class:`Written`) as soon as it is durable: from that moment
    the files exist for the audit and for resume. The newest committed epoch's own file stays on disk
    until a newer one is committed, so while a write rewrites ``latest.pt`` a kill still leaves that
    file to resume from; a periodic file past ``keep_last_k`` goes the same way, one write late.
    :meth:`finish` removes what the last commit made redundant. Removal only touches files this run
    committed, never whatever else is in the folder.
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
        self.directory = Path(directory)
        self.save_every_n_epochs = save_every_n_epochs
        self.keep_last_k = keep_last_k
        self.save_best = save_best
        self.save_latest = save_latest
        self.monitor = monitor
        self.mode = mode
        self.best_value: float | None = None
        self.best_epoch: int | None = None
        self.periodic: list[int] = []  # epochs whose periodic file this run wrote and still keeps, oldest first
        self.transient: list[int] = []  # epochs whose non-periodic epoch file is still on disk
        self.pending: PendingWrite[Written] = PendingWrite(background)
        self._history = HistoryText()
        self._made = False  # the folder exists (made once, not at every epoch's end)

    # --- paths ---------------------------------------------------------------------------------
    def name_for(self, kind: str, epoch: int) -> str:
        """The file name of ``kind`` (``periodic``, ``best``, ``latest``) for ``epoch``, in the folder."""
        if kind == "periodic":
            return f"epoch_{epoch_number(epoch)}.pt"
        if kind == "best":
            return "best.pt"
        if kind == "latest":
            return "latest.pt"
        raise ValueError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")

    def path_for(self, kind: str, epoch: int) -> Path:
        return self.directory / self.name_for(kind, epoch)

    def periodic_path(self, epoch: int) -> Path:
        return self.path_for("periodic", epoch)

    @property
    def best_path(self) -> Path:
        return self.path_for("best", 0)

    @property
    def latest_path(self) -> Path:
        return self.path_for("latest", 0)

    def list_periodic(self) -> list[Path]:
        """Periodic checkpoint files in the folder, oldest epoch first (by epoch number, not by name)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _PERIODIC.match(p.name))]
        return [p for _, p in sorted(found)]

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

    # --- writing -------------------------------------------------------------------------------
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

    def plan(self, run: RunContext, epoch: int, metrics: Mapping[str, float], final: bool,
             healthy: bool = True) -> WritePlan | None:
        """What this epoch's policy asks for, with the state captured and serialised on this thread;
        None when nothing is due. Call it once every earlier plan's write is committed.

        Serialising here, not on the writer thread: ``torch.save`` is Python work that holds the GIL,
        so on a writer thread it only contends with training (the training thread then waits out the
        interpreter's switch interval for the GIL); the write, fsync and hashing release the GIL and
        do overlap with training."""
        kinds = self.kinds_for(epoch, metrics, final, healthy)
        if "best" in kinds:
            self.best_value = float(metrics[self.monitor])
            self.best_epoch = epoch
        if not kinds:
            return None
        remove = self._redundant(keep_newest=True)
        periodic = "periodic" in kinds
        (self.periodic if periodic else self.transient).append(epoch)  # the state's own lists include it
        if not self._made:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._made = True
        state = self.build_state(run, epoch, metrics)
        run.dispatch("on_save_checkpoint", CheckpointContext(run, state, str(self.periodic_path(epoch))))
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return WritePlan(epoch, periodic, tuple(r for r in ("latest", "best") if r in kinds), buffer.getvalue(),
                         state.get("chain_head"), remove)

    def write(self, plan: WritePlan) -> Written:
        """Put ``plan`` on disk (see the class docstring); touches no run state, so any thread may run it."""
        data = plan.data
        digest = hashlib.sha256(data).hexdigest()
        epoch_file = self.periodic_path(plan.epoch)
        atomic_write_bytes(epoch_file, data, sync_dir=False)
        saved = [SavedCheckpoint(epoch_file, digest, plan.epoch, "periodic" if plan.periodic else "epoch")]
        for role in plan.roles:
            path = self.path_for(role, plan.epoch)
            atomic_link(epoch_file, path, data, sync_dir=False)
            saved.append(SavedCheckpoint(path, digest, plan.epoch, role))
        for path in plan.remove:
            path.unlink(missing_ok=True)
        fsync_dir(self.directory)  # one fsync makes the renames and removals above durable together
        return Written(tuple(saved), plan.remove, plan.chain_head)

    def submit(self, plan: WritePlan, commit: Callable[[Written], None]) -> None:
        """Write ``plan``, then ``commit`` (log) what is durable: on the writer thread when
        ``background``, else now. Collect it before the next plan."""

        def job() -> Written:
            written = self.write(plan)
            commit(written)
            return written

        self.pending.submit(job)

    def collect(self) -> Written | None:
        """Wait for the submitted write and its commit (None when there is none); its error is raised here."""
        return self.pending.wait()

    def finish(self) -> tuple[Path, ...]:
        """Once the last write is committed: remove what it made redundant; returns the files removed."""
        removed = self._redundant(keep_newest=False)
        for path in removed:
            path.unlink(missing_ok=True)
        if removed:
            fsync_dir(self.directory)
        return removed

    def _redundant(self, *, keep_newest: bool) -> tuple[Path, ...]:
        """Forget and return the files no committed role needs: non-periodic epoch files (a role
        holds their bytes) and periodic files past ``keep_last_k``; ``keep_newest`` spares the newest
        committed epoch's own file, the fallback while the next write rewrites ``latest.pt``."""
        newest = max([*self.periodic, *self.transient], default=None) if keep_newest else None
        transient = [e for e in self.transient if e != newest]
        self.transient = [e for e in self.transient if e == newest]
        periodic: list[int] = []
        if self.keep_last_k and len(self.periodic) > self.keep_last_k:
            periodic, self.periodic = self.periodic[: -self.keep_last_k], self.periodic[-self.keep_last_k:]
        return tuple(self.periodic_path(e) for e in sorted(transient + periodic))

    # --- reading -------------------------------------------------------------------------------
    def load(self, path: str | Path) -> dict[str, Any]:
        return load_checkpoint(path)

    # --- the manager's own state (best so far, its periodic files), for resume --------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_epoch": self.best_epoch, "periodic": list(self.periodic),
                "transient": list(self.transient)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_epoch = state.get("best_epoch")
        self.periodic = [int(e) for e in state.get("periodic", [])]
        self.transient = [int(e) for e in state.get("transient", [])]


def committed_sha256(path: str | Path) -> str | None:
    """The sha256 the run's log last committed for ``path`` (a file under ``<run>/checkpoints/``),
    or None when there is no such log or record."""
    p = Path(path)
    log = p.parent.parent / EVENTS_FILE
    if not log.is_file():
        return None
    digest: str | None = None
    target = os.path.abspath(p)
    with open(log, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if '"checkpoint"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed run
            payload = rec.get("payload") if isinstance(rec, dict) else None
            if rec.get("event") != "checkpoint" or not isinstance(payload, dict):
                continue
            shown = payload.get("path")
            if isinstance(shown, str) and os.path.abspath(os.path.join(log.parent, shown)) == target:
                digest = payload.get("sha256")
    return digest


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, expected_sha256: str | None = None
) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``, after checking its bytes against the sha256 the
    run's log committed for it (or ``expected_sha256``). Damage, a digest mismatch, or a pickle
    payload with code in it raise :class:`CheckpointError` naming the file; nothing is loaded."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p} does not exist")
    expected = expected_sha256 if expected_sha256 is not None else committed_sha256(p)
    data = p.read_bytes()
    if expected is not None:
        found = hashlib.sha256(data).hexdigest()
        if found != expected:
            raise CheckpointError(
                f"checkpoint {p} does not match its committed sha256: the log recorded {expected}, "
                f"the file has {found} ({len(data)} bytes); it was changed or damaged after it was written"
            )
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            what = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln), "a pickled object")
            raise CheckpointError(
                f"checkpoint {p} contains code, not only tensors and plain values ({what}); "
                "it was not loaded. fsmtrain never unpickles code from a checkpoint"
            ) from None
        raise CheckpointError(f"checkpoint {p} is corrupt or truncated ({len(data)} bytes): {str(exc)[:200]}") from None
    except Exception as exc:  # every other reader failure means the same thing here
        raise CheckpointError(
            f"checkpoint {p} is corrupt or truncated ({len(data)} bytes): {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"checkpoint {p} is not an fsmtrain checkpoint (no 'format' key)")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {p} has format {state['format']!r}; this fsmtrain reads {FORMAT_VERSION}")
    return state
