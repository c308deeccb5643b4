"""Atomic file writes: a reader (the audit, a resume) sees the old file or the whole new one, never a
part.

Every write goes to a temp file in the same folder, is fsync'd, and replaces the target with
``os.replace``; then the folder is fsync'd, so the rename itself survives a crash. Checkpoints
(:mod:`fsmtrain.training.checkpoint`), a run's config and its final model are written this way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["atomic_copy", "atomic_link", "atomic_write_bytes", "fsync_dir"]


def fsync_dir(directory: Path) -> None:
    """Make the renames and removals in ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one, never a part.
    ``sync_dir=False`` leaves the folder's fsync to the caller, who makes several renames durable at once."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def atomic_copy(source: Path, path: Path, *, sync_dir: bool = True) -> None:
    """Copy ``source`` to ``path`` so a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh, open(source, "rb") as src:
            shutil.copyfileobj(src, fh, 1 << 20)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def atomic_link(source: Path, path: Path, *, sync_dir: bool = True) -> None:
    """Make ``path`` another name of ``source``, atomically: a hard link under a temp name renamed
    over ``path``; a copy where the file system has no hard links."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(source, tmp)
    except OSError:
        atomic_copy(source, path, sync_dir=sync_dir)
        return
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)
