"""One run, one directory: claimed with an exclusive ``mkdir`` and held by a ``flock`` on
``<run>/.lock`` for the run's life. A run that never wrote ``run_start`` leaves nothing behind, and
such a folder a killed process left is reused by the next claim of that name."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fsmtrain.core.events import EVENTS_FILE, first_run_start

__all__ = [
    "LOCK_FILE", "PRESTART_FILES", "RunDirClaim", "RunDirError", "claim_existing", "claim_new", "claim_next_free",
    "in_use", "next_free", "run_started",
]

LOCK_FILE = ".lock"
# What a claim writes before ``run_start``: the lock, the config (and its temp file), the ranks' logs
PRESTART_FILES = frozenset({LOCK_FILE, "config.yaml", EVENTS_FILE})
_PRESTART_PATTERN = re.compile(r"^(events-rank\d+\.jsonl|\.config\.yaml\..+\.tmp)$")


class RunDirError(ValueError):
    """A run directory cannot be used: taken, locked, not a folder, or not writable."""


def run_started(path: Path) -> bool:
    """The run directory's log holds a ``run_start``: a run began there (and its files are evidence)."""
    log = path / EVENTS_FILE
    try:
        return log.is_file() and first_run_start(log) is not None
    except OSError:
        return True  # unreadable: not ours to judge, so never reused or removed


def _prestart(entry: Path) -> bool:
    return entry.is_file() and (entry.name in PRESTART_FILES or _PRESTART_PATTERN.match(entry.name) is not None)


def _never_started(path: Path) -> bool:
    """A folder a claim made for a run that never wrote ``run_start``: only pre-start files in it."""
    try:
        return all(_prestart(p) for p in path.iterdir()) and not run_started(path)
    except OSError:
        return False


@dataclass
class RunDirClaim:
    """A claimed run directory. ``created``: the folder is this claim's (made or reused);
    ``resumed``: the claim continues a run."""

    path: Path
    fd: int | None = field(default=None, repr=False)
    made: tuple[Path, ...] = ()  # parent folders this claim created, innermost first
    created: bool = False
    resumed: bool = False
    cleared: tuple[str, ...] = ()  # files a run that never started had left, removed to reuse its folder

    def release(self) -> None:
        """Let the folder go: ``.lock`` is removed while the lock is still held, then unlocked."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.path / LOCK_FILE, self.fd):
                (self.path / LOCK_FILE).unlink()
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None

    def let_go(self) -> None:
        """Release the folder; if its run never started, remove what the claim left in it."""
        unstarted = not self.resumed and self.path.is_dir() and _never_started(self.path)
        if unstarted:
            with contextlib.suppress(OSError):
                for entry in self.path.iterdir():
                    if entry.name != LOCK_FILE and _prestart(entry):
                        entry.unlink()
        self.release()
        if unstarted and self.created:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only while empty
                for parent in self.made:
                    parent.rmdir()  # only while empty: OSError stops at the first folder in use


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock(path: Path, made: tuple[Path, ...] = (), created: bool = False) -> RunDirClaim:
    while True:
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
        if _same_file(path / LOCK_FILE, fd):
            break
        os.close(fd)  # the claim that held it removed it as it let go: lock the folder's new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunDirClaim(path, fd, made, created)


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


def _left_by_a_claim(path: Path) -> bool:
    """``path/.lock`` holds a pid: a claim locked it (a folder just made and not yet locked is not)."""
    try:
        return (path / LOCK_FILE).read_bytes().strip().isdigit()
    except OSError:
        return False


def _reuse(path: Path, *, only_locked_before: bool = False) -> RunDirClaim | None:
    """Claim ``path``, a folder left by a run that never started; None when it is not one or is held.
    ``only_locked_before``: only a folder whose claim had locked it."""
    if not _never_started(path) or (only_locked_before and not _left_by_a_claim(path)):
        return None
    try:
        claim = _lock(path)
    except RunDirError:
        return None
    if not _never_started(path):  # it started while this process took the lock
        claim.release()
        return None
    cleared = []
    for entry in sorted(path.iterdir()):
        if entry.name != LOCK_FILE:
            entry.unlink()
            cleared.append(entry.name)
    claim.created, claim.cleared = True, tuple(cleared)
    return claim


def _holds_a_run(path: Path) -> RunDirError:
    return RunDirError(f"run directory {path} already holds a run ({EVENTS_FILE}); continue it with "
                       "resume_from='latest' (CLI: fsmtrain resume), or choose a new folder")


def claim_new(path: str | Path) -> RunDirClaim:
    """Claim ``path`` for a new run: a new or empty folder, or one a run that never started left."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise RunDirError(f"run directory {path} is a dangling symbolic link (to {os.readlink(path)})")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run directory {path} is a file, not a folder")
    made = _make_parent(path)
    created = True
    try:
        os.mkdir(path)
    except FileExistsError:
        created = False
        if run_started(path):
            raise _holds_a_run(path) from None
        if any(not _prestart(p) for p in path.iterdir()):
            raise RunDirError(f"run directory {path} exists and is not empty; choose a new folder") from None
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {path}: {exc.strerror or exc}") from None
    if not created and any(path.iterdir()):
        reused = _reuse(path)
        if reused is None:  # a live claim holds it (a Trainer built on it, a run starting)
            busy = RunDirError(f"run directory {path} is in use by another running process")
            raise _holds_a_run(path) if (path / EVENTS_FILE).exists() else busy
        reused.made = made
        return reused
    claim = _lock(path, made, created)
    if run_started(path):  # another process claimed the empty folder first and started
        claim.release()
        raise RunDirError(f"run directory {path} already holds a run ({EVENTS_FILE}); choose a new folder")
    return claim


def claim_next_free(root: str | Path, name: str) -> RunDirClaim:
    """Claim ``root/name``, or ``name-2``, ``name-3``… when taken; a folder left by a run that never
    started is reused."""
    root = Path(root)
    made = _make_parent(root / name)
    n = 1
    while True:
        candidate = root / (name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            reused = _reuse(candidate, only_locked_before=True) if candidate.is_dir() else None
            if reused is not None:
                reused.made = made
                return reused
            n += 1
            continue
        except OSError as exc:
            raise RunDirError(f"cannot create run directory {candidate}: {exc.strerror or exc}") from None
        return _lock(candidate, made, created=True)


def next_free(path: str | Path) -> Path:
    """``path``, or the first of ``path-2``, ``path-3``… that a new run can claim (not claiming it)."""
    path = Path(path)
    names = itertools.chain([path], (path.with_name(f"{path.name}-{n}") for n in itertools.count(2)))
    return next(c for c in names if not c.exists() or (c.is_dir() and _never_started(c) and not in_use(c)))


def in_use(path: str | Path) -> bool:
    """A live process holds ``path``'s claim now (probed with a shared lock held for an instant)."""
    try:
        fd = os.open(Path(path) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False  # no .lock: every claim removes it as it lets go
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


def claim_existing(path: str | Path) -> RunDirClaim:
    """Claim the folder of a run to continue it (``fsmtrain resume``)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} does not exist or is not a folder")
    if not (path / EVENTS_FILE).is_file():
        raise RunDirError(f"{path} holds no {EVENTS_FILE}: it is not a run directory")
    claim = _lock(path)
    claim.resumed = True
    return claim
