"""The checkpoint files a run's log committed, read from its ``checkpoint*`` lines, and the sha256 each
line records of its file (:func:`sha256_of`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_NAME", "CheckpointLedger", "CommittedFile", "committed_checkpoints", "committed_sha256",
           "folder_digest", "folder_files", "read_ledger", "sha256_of"]

# A checkpoint's name in its folder: a file (``.pt``), or a sharded checkpoint's folder (no suffix).
CHECKPOINT_NAME = re.compile(r"^(epoch_\d+|step_\d+|latest|best)(\.pt)?$")


@dataclasses.dataclass(frozen=True)
class CommittedFile:
    """A checkpoint file as the log last committed it."""

    path: str  # as the log shows it: relative to the run directory, or absolute
    sha256: str
    epoch: int | None
    kind: str | None  # "periodic", "epoch", "latest", "best"
    seq: int | None  # the committing line's seq
    roles: tuple[str, ...] = ()  # an epoch file's other names, committed in lines after it ("latest", "best")
    step: int | None = None  # a checkpoint at a step: its global step

    @property
    def newness(self) -> tuple[int, bool, int, int]:
        """Orders states oldest first: by epoch, a step before its epoch's end, then by commit."""
        return (-1 if self.epoch is None else self.epoch, self.step is None, self.step or 0, self.seq or 0)


class CheckpointLedger:
    """The checkpoint files a log committed and still stands by, fed one parsed line at a time."""

    def __init__(self) -> None:
        self.last: dict[str, CommittedFile] = {}  # path -> its last commit, withdrawn or not
        self.live: dict[str, CommittedFile] = {}  # path -> its last commit, while it stands

    def feed(self, rec: Mapping[str, Any]) -> None:
        event, payload = rec.get("event"), rec.get("payload")
        if event not in ("checkpoint", "checkpoint_removed", "checkpoint_damaged") or not isinstance(payload, dict):
            return
        if event != "checkpoint":  # withdrawn: one file removed, or several found damaged
            for path in (payload.get("paths") or ()) if event == "checkpoint_damaged" else [payload.get("path")]:
                if isinstance(path, str):
                    self.live.pop(path, None)
            return
        path, kind, roles = payload.get("path"), payload.get("kind"), payload.get("roles")
        if not isinstance(path, str):
            return
        done = CommittedFile(path, str(payload.get("sha256")), _int(payload.get("epoch")),
                             kind if isinstance(kind, str) else None, _int(rec.get("seq")),
                             tuple(r for r in roles if isinstance(r, str)) if isinstance(roles, list) else (),
                             _int(payload.get("step")))
        self.last[path] = done
        self.live[path] = done


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def read_ledger(path: Path | str) -> CheckpointLedger:
    """The :class:`CheckpointLedger` of the log at ``path``; unreadable lines are the audit's to report."""
    ledger = CheckpointLedger()
    with open(path, "rb") as fh:
        for line in fh:
            if b'"checkpoint' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                ledger.feed(rec)
    return ledger


def committed_checkpoints(path: Path | str) -> dict[str, CommittedFile]:
    """The checkpoint files the log at ``path`` committed and still stands by, by the path it shows."""
    return read_ledger(path).live


def committed_sha256(log: Path | str, target: Path | str) -> str | None:
    """The sha256 the log at ``log`` last committed for the file ``target``, or None."""
    log = Path(log)
    wanted = os.path.abspath(target)
    for shown, done in read_ledger(log).last.items():
        if os.path.abspath(os.path.join(log.parent, shown)) == wanted:
            return done.sha256
    return None


def sha256_of(path: str | Path) -> str:
    """A file's sha256; a sharded checkpoint folder's: the sha256 of its files' (:func:`folder_files`)."""
    if os.path.isdir(path):
        return folder_digest(folder_files(Path(path)))
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(folder: Path) -> dict[str, str]:
    """Each file of a sharded checkpoint folder (DCP's ``.metadata`` and shards, each rank's state), its sha256."""
    return {f.name: sha256_of(f) for f in sorted(folder.iterdir()) if f.is_file()}


def folder_digest(found: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(sorted(found.items()))).encode()).hexdigest()
