"""Continue a run in place from the newest checkpoint its log committed.

:func:`find_resumption` reads the run's ``events.jsonl`` (a torn last line of a killed process is
cut off first), walks the committed ``checkpoint`` events newest first and takes the first whose
file is still there with the committed sha256. Files in the checkpoint folder that the log never
committed (leftovers of a write cut short by a kill: temp files, a file renamed into place whose
event never made it, a role link swapped before its event) are removed and named in the
``resume`` event.

The :class:`Resumption` then sets the run's position before ``run_start`` (so the log's new
segment says where it starts) and, in ``train_begin``, restores model, optimizer, scheduler,
every stateful callback, the RNG states and the data order, and fires ``on_load_checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.chain import KEY_ENV, Chain
from pipeline.core.context import CheckpointContext, EpochRecord, RunContext
from pipeline.core.events import EVENTS_FILE, first_run_start
from pipeline.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_history,
    sha256_of,
)
from pipeline.training.rng import restore_rng_state

__all__ = [
    "RecordedStart", "ResumeError", "Resumption", "check_log_key", "find_resumption", "read_log_tail",
    "recorded_start",
]

_OURS = re.compile(r"^(epoch_\d+\.pt|latest\.pt|best\.pt|\..+\.tmp)$")


class ResumeError(ValueError):
    """The run cannot be continued: no log, no committed checkpoint left, or a mismatch."""


@dataclass(frozen=True)
class RecordedStart:
    """What a run directory's first ``run_start`` says of how the run was trained."""

    seed: int
    world_size: int  # how many ranks trained it (1 when the log names none)


def recorded_start(run_dir: Path) -> RecordedStart:
    """The seed and world size of the run in ``run_dir``, from its log's first ``run_start``."""
    log = run_dir / EVENTS_FILE
    if not log.is_file():
        raise ResumeError(f"{run_dir} has no {EVENTS_FILE}: there is no run to resume there")
    payload = first_run_start(log) or {}
    seed, world = payload.get("seed"), payload.get("world_size")
    if type(seed) is int:
        return RecordedStart(seed, world if type(world) is int and world > 0 else 1)
    raise ResumeError(f"{log} holds no run_start event with the run's seed: it is not the log of an fsmtrain "
                      "run, or it was damaged (fsmtrain audit tells which)")


def check_log_key(run_dir: Path, key: bytes | None) -> None:
    """A resumed log goes on with the key its run was started with: lines chained with another key
    (or none) would leave a log that no one key verifies. Checked before a resume touches anything."""
    log = run_dir / EVENTS_FILE
    payload = first_run_start(log) if log.is_file() else None
    described = payload.get("chain") if payload is not None else None
    if not isinstance(described, dict):
        return  # no run_start to go on from: the resume itself says what is wrong
    recorded, given = Chain.key_id_of(described), None if key is None else Chain(key).key_id
    if recorded == given:
        return
    if recorded is None:
        why = f"is chained without a key, and a key (key id {given}) is set: unset {KEY_ENV} to resume it"
    elif given is None:
        why = f"is keyed (key id {recorded}), and no key is set: set {KEY_ENV} to the run's key to resume it"
    else:
        why = f"is keyed with key id {recorded}, and the key set has key id {given}: resume it with the run's own key"
    raise ResumeError(f"{log} {why}")


@dataclass(frozen=True)
class LogTail:
    """What a resume needs from the log it appends to."""

    next_seq: int
    run_id: str | None
    committed: tuple[tuple[str, str, int], ...]  # (shown path, sha256, epoch), in log order
    removed: frozenset[str]
    torn_bytes: int  # bytes of a torn last line cut off


def read_log_tail(run_dir: Path, name: str = EVENTS_FILE, *, repair: bool = True) -> LogTail:
    """Read ``run_dir/<name>``; cut off a torn last line (a process killed mid-write) when
    ``repair`` (a rank other than 0 reads the run's log without touching it: rank 0 appends to it)."""
    log = run_dir / name
    if not log.is_file():
        raise ResumeError(f"{run_dir} has no {name}: there is no run to resume there")
    raw = log.read_bytes()
    cut = raw.rfind(b"\n") + 1
    torn = len(raw) - cut
    if torn and repair:
        with open(log, "r+b") as fh:
            fh.truncate(cut)
            fh.flush()
            os.fsync(fh.fileno())
    committed: list[tuple[str, str, int]] = []
    removed: set[str] = set()
    next_seq, run_id = 0, None
    for line in raw[:cut].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the audit reports it; resume only needs the committed checkpoints
        if not isinstance(rec, dict):
            continue
        if isinstance(rec.get("seq"), int):
            next_seq = rec["seq"] + 1
        run_id = rec.get("run_id", run_id)
        payload = rec.get("payload") or {}
        if rec.get("event") == "checkpoint" and isinstance(payload.get("path"), str):
            committed.append((payload["path"], str(payload.get("sha256")), int(payload.get("epoch", -1))))
            removed.discard(payload["path"])
        elif rec.get("event") == "checkpoint_removed" and isinstance(payload.get("path"), str):
            removed.add(payload["path"])
    return LogTail(next_seq, run_id, tuple(committed), frozenset(removed), torn)


@dataclass
class Resumption:
    """A verified checkpoint to continue from, and what the resume cleaned up."""

    run_dir: Path
    path: Path
    shown: str  # as the log names it
    sha256: str
    state: dict[str, Any]
    tail: LogTail
    removed: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # what the resume event says besides (world sizes...)

    @property
    def next_epoch(self) -> int:
        return int(self.state["position"]["next_epoch"])

    @property
    def global_step(self) -> int:
        return int(self.state["position"]["global_step"])

    def prepare(self, run: RunContext) -> None:
        """Before ``run_start``: the position and the history of the epochs already done."""
        run.epoch = self.next_epoch
        run.global_step = self.global_step
        run.history = [EpochRecord(int(h["epoch"]), {k: float(v) for k, v in h["metrics"].items()})
                       for h in read_history(self.state.get("history"))]
        run.extras["resumed_from"] = self.shown

    def restore(self, run: RunContext) -> None:
        """In ``train_begin``: every piece of state, then ``on_load_checkpoint``, then the log's
        ``resume`` event."""
        state = self.state
        if run.model is not None and state.get("model") is not None:
            run.model.load_state_dict(state["model"])
        if run.optimizer is not None and state.get("optimizer") is not None:
            run.optimizer.load_state_dict(state["optimizer"])
        scheduler = run.scheduler
        if scheduler is not None and state.get("scheduler") is not None and hasattr(scheduler, "load_state_dict"):
            scheduler.load_state_dict(state["scheduler"])
        if run.scaler is not None and state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
        _load_callback_states(run, state.get("callbacks") or {})
        seed = (state.get("data_order") or {}).get("seed")
        if seed is not None:
            run.extras["data_seed"] = int(seed)
        run.dispatch("on_load_checkpoint", CheckpointContext(run, state, str(self.path)))
        run.emit(
            "resume", checkpoint=self.shown, sha256=self.sha256, checkpoint_epoch=int(state["epoch"]),
            next_epoch=self.next_epoch, global_step=self.global_step, removed=self.removed,
            torn_line_bytes=self.tail.torn_bytes, **self.notes,
        )
        # Last, after every callback's own set-up: the random streams continue exactly where they were.
        restore_rng_state(state["rng"])


def _load_callback_states(run: RunContext, states: Mapping[str, Any]) -> None:
    seen: set[str] = set()
    for i, cb in enumerate(run.callbacks):
        if not getattr(cb, "stateful", False):
            continue
        key = cb.name if cb.name not in seen else f"{cb.name}#{i}"
        seen.add(cb.name)
        if key in states:
            cb.load_state_dict(states[key])


def find_resumption(run_dir: str | Path, which: str | Path = "latest", *, own_log: str | None = None) -> Resumption:
    """The checkpoint to continue ``run_dir`` from: ``"latest"`` (the newest committed one that is
    intact) or a path (which must be one the log committed).

    ``own_log``: a rank other than 0 of a multi-process run, which continues its own log (that
    name) from the checkpoint rank 0 chose; it reads the run's log and files and changes neither."""
    run_dir = Path(run_dir)
    tail = read_log_tail(run_dir, repair=own_log is None)
    latest_sha: dict[str, str] = {}
    for shown, sha, _ in tail.committed:
        latest_sha[shown] = sha
    live = [(shown, sha, epoch) for shown, sha, epoch in tail.committed
            if shown not in tail.removed and latest_sha[shown] == sha]
    if not live:
        raise ResumeError(f"{run_dir}: the log committed no checkpoint that is still there; nothing to resume from "
                          "(start the run again instead)")
    if which != "latest":
        wanted = os.path.abspath(which)
        live = [c for c in live if os.path.abspath(run_dir / c[0]) == wanted]
        if not live:
            raise ResumeError(f"{which} is not a checkpoint the log of {run_dir} committed")
    problems: list[str] = []
    for shown, sha, _epoch in sorted(live, key=lambda c: c[2], reverse=True):
        path = run_dir / shown
        if not path.is_file():
            problems.append(f"{shown}: missing")
            continue
        try:
            state = load_checkpoint(path, expected_sha256=sha)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if own_log is not None:
            return Resumption(run_dir, path, shown, sha, state, _own_tail(run_dir, own_log))
        res = Resumption(run_dir, path, shown, sha, state, tail)
        res.removed = _remove_uncommitted(run_dir, path.parent, latest_sha, tail.removed)
        return res
    raise ResumeError(f"{run_dir}: no committed checkpoint could be loaded: " + "; ".join(problems))


def _own_tail(run_dir: Path, name: str) -> LogTail:
    """A rank's own log, repaired; a rank killed before it wrote a line starts a fresh one."""
    if not (run_dir / name).is_file():
        return LogTail(0, None, (), frozenset(), 0)
    return read_log_tail(run_dir, name)


def _remove_uncommitted(
    run_dir: Path, folder: Path, committed: Mapping[str, str], removed: frozenset[str]
) -> list[str]:
    """Delete the files of ours in ``folder`` whose current bytes the log never committed."""
    out: list[str] = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.is_file() or not _OURS.match(path.name):
            continue
        shown = os.path.relpath(path, run_dir)
        if shown in committed and shown not in removed and committed[shown] == sha256_of(path):
            continue
        path.unlink()
        out.append(shown)
    return out
