"""Where an Optuna study lives and how to open it: a SQLite file for one process, a journal file for
``--workers K`` on one machine, an RDB URL with heartbeats for many machines. Torch-free."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    from fsmtrain.app.config import OptimizeConfig

__all__ = [
    "DB_FILE", "JOURNAL_FILE", "RUN_DIRS_ATTR", "WORKER_ATTR", "StorageError", "StorageKind",
    "StorageSpec", "default_storage", "existing_directions", "open_storage", "parse_storage", "pick_study",
    "release_dead_holders_lock", "retry_callback",
]

DB_FILE = "study.db"
JOURNAL_FILE = "study.journal"
RUN_DIRS_ATTR = "run_dirs"
"""Trial user attribute ``{seed: run dir}``; a retry inherits its original's (Optuna copies them)."""
WORKER_ATTR = "worker"
"""Trial user attribute: which process runs the trial (:func:`fsmtrain.app.hpo.recovery.worker_identity`)."""
_SQLITE_HEADER = b"SQLite format 3\x00"


class StorageError(Exception):
    """A storage cannot be used: where it was named, what was expected, what was found (one line)."""

    def __init__(self, source: str, expected: str, found: str) -> None:
        super().__init__(f"{source}: expected {expected}; found {found}")
        self.source, self.expected, self.found = source, expected, found


class StorageKind(Enum):
    """What a storage is, in the words its description uses."""

    SQLITE = "SQLite file (one process)"
    JOURNAL = "Optuna journal file (several worker processes)"
    RDB = "RDB database (workers on many machines, heartbeats on)"


def _masked(url: str) -> str:
    """The URL with its password replaced, for anything printed or logged."""
    return re.sub(r"^([\w+.-]+://[^:/@]*:)[^@]*@", r"\1***@", url)


@dataclass(frozen=True)
class StorageSpec:
    """A storage: ``url`` is an SQLAlchemy URL, or the journal file's path."""

    kind: StorageKind
    url: str
    source: str = "default"  # where it was named: "--storage", "optimize.storage" or "default"

    @property
    def shown(self) -> str:
        return _masked(self.url)

    @property
    def path(self) -> Path | None:
        """The file of a SQLite or journal storage."""
        return None if self.kind is StorageKind.RDB else Path(self.url.removeprefix("sqlite:///"))

    def open_hints(self, study: str) -> list[str]:
        """Commands that open the study (the password, if any, left for the reader to fill in)."""
        arg = self.shown
        api = (f"optuna.load_study(study_name={study!r}, storage=JournalStorage(JournalFileBackend({arg!r})))"
               if self.kind is StorageKind.JOURNAL else f"optuna.load_study(study_name={study!r}, storage={arg!r})")
        return [f"optuna-dashboard {arg}", api, f"fsmtrain hpo-report {arg} --study {study}"]


def parse_storage(text: str, source: str) -> StorageSpec:
    """``sqlite:///f.db`` and ``*.db`` files are SQLite; other ``scheme://`` URLs are RDB databases;
    any other path is a journal file."""
    text = text.strip()
    if not text:
        raise StorageError(source, "a storage URL or file", "an empty string")
    if "://" in text:
        scheme = text.split("://", 1)[0].split("+", 1)[0]
        if scheme == "sqlite":
            if not text.startswith("sqlite:///") or text == "sqlite:///":
                raise StorageError(source, "sqlite:///PATH to a database file", repr(text))
            return StorageSpec(StorageKind.SQLITE, text, source)
        if scheme in ("redis", "rediss"):
            raise StorageError(source, "an RDB URL, a .db file or a journal file (Redis journals are not supported)",
                               repr(_masked(text)))
        return StorageSpec(StorageKind.RDB, text, source)
    path = Path(text)
    header = b""
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        header = fh.read(len(_SQLITE_HEADER))
    if path.suffix in (".db", ".sqlite", ".sqlite3") or header == _SQLITE_HEADER:
        return StorageSpec(StorageKind.SQLITE, f"sqlite:///{path}", source)
    return StorageSpec(StorageKind.JOURNAL, str(path), source)


def default_storage(study_dir: Path, workers: int) -> StorageSpec:
    """The study folder's journal file for several workers or when it holds one and no SQLite file;
    else its SQLite file."""
    if workers > 1 or ((study_dir / JOURNAL_FILE).is_file() and not (study_dir / DB_FILE).is_file()):
        return StorageSpec(StorageKind.JOURNAL, str(study_dir / JOURNAL_FILE), "optimize.storage")
    return StorageSpec(StorageKind.SQLITE, f"sqlite:///{study_dir / DB_FILE}", "optimize.storage")


def retry_callback(max_retry: int | None) -> Callable[[optuna.study.Study, FrozenTrial], None]:
    """Optuna's retry of stale trials, keeping the validations the pruner saw, and the user attributes
    but :data:`WORKER_ATTR`."""
    import copy

    from optuna import storages
    cls = getattr(storages, "RetryHeartbeatStaleTrialCallback", None) or storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ExperimentalWarning
        retry = cls(max_retry=max_retry, inherit_intermediate_values=True)

    def enqueue_retry(study: optuna.study.Study, trial: FrozenTrial) -> None:
        if WORKER_ATTR in trial.user_attrs:
            trial = copy.copy(trial)
            trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != WORKER_ATTR}
        retry(study, trial)
    return enqueue_retry


def _engine_kwargs(url: str, *, create: bool = True) -> dict[str, Any]:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        if not create:  # reading only: leave the file's journal mode as it is
            return {"connect_args": {"timeout": 60}}

        def connect() -> Any:  # WAL, synchronous=NORMAL: no fsync per commit, readers never block the writer
            conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=60, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            return conn
        return {"creator": connect}
    if url.startswith(("postgresql", "postgres")):
        return {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    return {"pool_pre_ping": True}


def _one_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc.__cause__ or exc
    return " ".join(f"{type(orig).__name__}: {orig}".split())


def _lost_creation_race(exc: BaseException, creating: bool = True) -> bool:
    """Whether ``exc`` says another process was creating the same tables at the same time."""
    name = type(exc).__name__
    if name == "IntegrityError" or (name == "ProgrammingError" and creating):  # PostgreSQL
        return True
    # SQLite: the tables appeared meanwhile, or the other opener held the lock (refused at once)
    return name == "OperationalError" and ("already exists" in str(exc) or "database is locked" in str(exc))


def open_storage(spec: StorageSpec, heartbeat: OptimizeConfig | None = None, *, create: bool = True) -> BaseStorage:
    """Open ``spec`` (``create=False``: a missing file or database is an error); RDB storages beat as
    ``heartbeat`` says. An open that lost a set-up race is tried again, with a warning on stderr."""
    import optuna
    path = spec.path
    if not create and path is not None and not path.is_file():
        raise StorageError(spec.source, "an existing study storage", f"no file at {str(path)!r}")
    journal = spec.kind is StorageKind.JOURNAL
    try:
        if path is not None and create:
            path.parent.mkdir(parents=True, exist_ok=True)
        if journal:  # absolute: the lock symlinks to it, and a relative target would dangle
            from optuna.storages.journal import JournalFileBackend, JournalStorage
            return JournalStorage(JournalFileBackend(os.path.abspath(str(path))))
    except Exception as exc:
        raise StorageError(spec.source, f"a {'journal file' if journal else 'database'} that can be opened",
                           f"{spec.shown!r}: {_one_line(exc)}") from None
    kwargs: dict[str, Any] = {}
    if heartbeat is not None:
        kwargs = {"heartbeat_interval": heartbeat.heartbeat_interval, "grace_period": heartbeat.grace_period,
                  "heartbeat_stale_trial_callback": retry_callback(heartbeat.max_retry)}
    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # heartbeat_interval is an ExperimentalWarning
                return optuna.storages.RDBStorage(
                    spec.url, engine_kwargs=_engine_kwargs(spec.url, create=create), skip_table_creation=not create,
                    **kwargs)
        except Exception as exc:
            # create=False races too: Optuna stamps the schema version of tables just made.
            if attempt == 4 or not _lost_creation_race(exc, creating=create):
                raise StorageError(spec.source, "a database that can be opened",
                                   f"{spec.shown!r}: {_one_line(exc)}") from None
            delay = 0.2 + 0.3 * attempt
            print(f"warning: {spec.shown}: another process was setting up this database at the same time "
                  f"({_one_line(exc)}); opening it again in {delay:.1f} s (attempt {attempt + 2} of 5)",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
    raise AssertionError("unreachable")


def existing_directions(spec: StorageSpec, study: str) -> list[str] | None:
    """The directions of study ``study`` if ``spec`` holds it, else None; creates nothing."""
    path = spec.path
    if path is not None and not path.is_file():
        return None  # a new file: nothing to compare with
    if spec.kind is StorageKind.RDB:
        import sqlalchemy
        try:
            engine = sqlalchemy.create_engine(spec.url, **_engine_kwargs(spec.url))
            with engine.connect():
                has_tables = sqlalchemy.inspect(engine).has_table("studies")
            engine.dispose()
        except Exception as exc:
            raise StorageError(spec.source, "a reachable database", f"{spec.shown!r}: {_one_line(exc)}") from None
        if not has_tables:
            return None
    storage = open_storage(spec, create=False)
    try:
        study_id = storage.get_study_id_from_name(study)
        return [d.name.lower() for d in storage.get_study_directions(study_id)]
    except KeyError:
        return None
    finally:
        opened = getattr(storage, "engine", None)
        if opened is not None:
            opened.dispose()  # close the file: a SQLite file keeps no -wal/-shm files beside it


def pick_study(storage: BaseStorage, name: str | None, shown: str) -> str:
    """``name``, checked to exist in ``storage``; without a name, the storage's only study."""
    names = [s.study_name for s in storage.get_all_studies()]
    if name is not None:
        if name not in names:
            raise StorageError("--study", f"one of the studies in {shown} ({', '.join(names) or 'none'})", repr(name))
        return name
    if len(names) != 1:
        raise StorageError("--study", f"a study name: {shown} holds {len(names)} ({', '.join(names) or 'none'})",
                           "none given")
    return names[0]


def release_dead_holders_lock(spec: StorageSpec, hold: float = 2.0) -> bool:
    """After a worker of this host died: remove the journal's lock if it stays held for ``hold``
    seconds (Optuna holds it for one append, and breaks a dead holder's only after 30 s)."""
    if spec.kind is not StorageKind.JOURNAL:
        return False
    lock = Path(os.path.abspath(spec.url) + ".lock")  # Optuna's JournalFileSymlinkLock

    def identity() -> tuple[int, int] | None:
        with contextlib.suppress(FileNotFoundError):
            st = lock.lstat()
            return st.st_ino, st.st_mtime_ns
        return None
    first = identity()
    if first is None:
        return False
    end = time.monotonic() + hold
    while time.monotonic() < end:
        time.sleep(0.05)
        if identity() != first:
            return False  # released (or taken anew): a live worker's
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
        return True
    return False
