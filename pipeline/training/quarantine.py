"""Damaged checkpoints: found by their bytes, moved aside, never deleted.

A committed checkpoint file whose bytes are no longer the ones its log committed (truncated, a
flipped byte, another file copied over it) is damaged. ``latest.pt``, ``best.pt`` and
``epoch_<n>.pt`` of one epoch are hard links to one file, so one damage shows under every name of
that state: :func:`find_damaged` groups the names by the state they committed. :func:`quarantine`
moves a damaged state's files into ``damaged/`` beside them (a name already there gets a number),
so the evidence stays and no later write replaces it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fsmtrain.core.ledger import CommittedFile
from fsmtrain.training.atomic import fsync_dir
from fsmtrain.training.checkpoint_files import sha256_of

__all__ = ["DAMAGED_DIR", "DamagedState", "find_damaged", "quarantine"]

DAMAGED_DIR = "damaged"


@dataclass(frozen=True)
class DamagedState:
    """The committed files of one checkpointed state whose bytes changed."""

    epoch: int | None
    committed_sha256: str
    paths: tuple[str, ...]  # as the log shows them
    found_sha256: tuple[str, ...]  # what each file hashes to now


def find_damaged(run_dir: Path, live: Mapping[str, CommittedFile]) -> tuple[set[str], list[DamagedState]]:
    """Hash every committed file still there (each inode once): the paths whose bytes are the
    committed ones, and the damaged states. A committed file that is gone is in neither."""
    seen: dict[tuple[int, int, int, int], str] = {}
    intact: set[str] = set()
    groups: dict[str, list[tuple[str, str, CommittedFile]]] = {}
    for shown, done in live.items():
        path = run_dir / shown
        try:
            st = path.stat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        found = seen.get(key)
        if found is None:
            found = seen[key] = sha256_of(path)
        if found == done.sha256:
            intact.add(shown)
        else:
            groups.setdefault(done.sha256, []).append((shown, found, done))
    states = [DamagedState(files[0][2].epoch, sha, tuple(f[0] for f in files), tuple(f[1] for f in files))
              for sha, files in groups.items()]
    states.sort(key=lambda d: -1 if d.epoch is None else d.epoch, reverse=True)
    return intact, states


def quarantine(run_dir: Path, state: DamagedState) -> tuple[str, ...]:
    """Move ``state``'s files to ``damaged/`` beside them; returns where each went, as the log
    shows paths (relative to ``run_dir`` when under it)."""
    moved: list[str] = []
    folders: set[Path] = set()
    for shown in state.paths:
        source = run_dir / shown
        target_dir = source.parent / DAMAGED_DIR
        target_dir.mkdir(exist_ok=True)
        target = _free_name(target_dir, source.name)
        os.replace(source, target)
        folders.update((source.parent, target_dir))
        relative = os.path.relpath(target, run_dir)
        moved.append(str(target) if relative.startswith(os.pardir) else relative)
    for folder in folders:
        fsync_dir(folder)
    return tuple(moved)


def _free_name(folder: Path, name: str) -> Path:
    target = folder / name
    n = 2
    stem, dot, suffix = name.rpartition(".")
    while target.exists():
        target = folder / (f"{stem}.{n}{dot}{suffix}" if dot else f"{name}.{n}")
        n += 1
    return target
