"""One run, one directory: run directories are claimed atomically and locked for the run's life.

A new run claims its folder with an exclusive ``mkdir`` (two processes can never both succeed), so
four identical ``fsmtrain train`` commands started together get ``name``, ``name-2``, ``name-3``
and ``name-4`` without a race. Every claim, new or resumed, then holds an exclusive ``flock`` on
``<run>/.lock`` until the run ends, so a second process cannot append to a run that is still
going. Errors say which folder and why, never with a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.events import EVENTS_FILE

__all__ = ["LOCK_FILE", "RunDirClaim", "RunDirError", "claim_existing", "claim_new", "claim_next_free"]

LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """A run directory cannot be used: taken, locked, not a folder, or not writable."""


@dataclass
class RunDirClaim:
    """A claimed run directory; ``release()`` (or the end of the process) lets it go."""

    path: Path
    fd: int | None = field(default=None, repr=False)
    made: tuple[Path, ...] = ()  # parent folders this claim created, innermost first

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            self.fd = None

    def abandon(self) -> None:
        """Release, and remove the folder again if the run never wrote anything into it."""
        self.release()
        if self.path.is_dir() and all(p.name == LOCK_FILE for p in self.path.iterdir()):
            with contextlib.suppress(OSError):
                (self.path / LOCK_FILE).unlink(missing_ok=True)
                self.path.rmdir()
                for parent in self.made:
                    parent.rmdir()  # only while empty: OSError stops at the first folder in use

    @property
    def held(self) -> bool:
        return self.fd is not None


def _lock(path: Path) -> RunDirClaim:
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(f"run directory {path} is not writable: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirError(f"run directory {path} is in use by another running process") from None
        raise RunDirError(f"cannot lock run directory {path}: {exc.strerror or exc}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunDirClaim(path, fd)


def _make_parent(path: Path) -> tuple[Path, ...]:
    """Create ``path``'s parent folders; returns those it created, innermost first."""
    parent = path.parent
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    if parent.exists() and not parent.is_dir():
        raise RunDirError(f"cannot create run directory {path}: {parent} is a file, not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"cannot create run directory {path}: a part of {parent} is a file") from None
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {path}: {exc.strerror or exc} ({parent})") from None
    return tuple(missing)


def claim_new(path: str | Path) -> RunDirClaim:
    """Claim ``path`` for a new run: it must not exist yet, or be an empty folder."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise RunDirError(f"run directory {path} is a dangling symbolic link (to {os.readlink(path)})")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file, not a folder")
    made = _make_parent(path)
    try:
        os.mkdir(path)
    except FileExistsError:
        if (path / EVENTS_FILE).exists():
            raise RunDirError(f"run directory {path} already holds a run ({EVENTS_FILE}); continue it with "
                              "resume_from='latest' (CLI: fsmtrain resume), or choose a new folder") from None
        if any(p.name != LOCK_FILE for p in path.iterdir()):
            raise RunDirError(f"run directory {path} exists and is not empty; choose a new folder") from None
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {path}: {exc.strerror or exc}") from None
    claim = _lock(path)
    claim.made = made
    if (path / EVENTS_FILE).exists():  # another process claimed the empty folder first and started
        claim.release()
        raise RunDirError(f"run directory {path} already holds a run ({EVENTS_FILE}); choose a new folder")
    return claim


def claim_next_free(root: str | Path, name: str) -> RunDirClaim:
    """Claim ``root/name``, or ``name-2``, ``name-3``… when taken; atomic under concurrency."""
    root = Path(root)
    made = _make_parent(root / name)
    n = 1
    while True:
        candidate = root / (name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            n += 1
            continue
        except OSError as exc:
            raise RunDirError(f"cannot create run directory {candidate}: {exc.strerror or exc}") from None
        claim = _lock(candidate)
        claim.made = made
        return claim


def claim_existing(path: str | Path) -> RunDirClaim:
    """Claim the folder of a run to continue it (``fsmtrain resume``)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} does not exist or is not a folder")
    if not (path / EVENTS_FILE).is_file():
        raise RunDirError(f"{path} holds no {EVENTS_FILE}: it is not a run directory")
    return _lock(path)
