"""One checkpoint file: written once, atomically, hashed as it is written; read back only as the
run's log committed it.

:func:`save_state` writes a state in ``torch.save``'s format (byte for byte, by
:func:`fsmtrain.training.torch_file.write_torch_file`) straight into a temp file beside the target while
hashing the bytes as they go out (one pass: no serialised copy of the whole state in memory),
fsyncs it and renames it into place. :func:`load_checkpoint` checks a file's bytes against the
sha256 the run's log committed for it (read by :func:`fsmtrain.core.ledger.committed_sha256`, the
log's own reader) and loads it with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from fsmtrain.core.context import epoch_number
from fsmtrain.core.events import EVENTS_FILE
from fsmtrain.core.ledger import committed_sha256 as logged_sha256
from fsmtrain.core.log_file import FileWriteError, write_failure
from fsmtrain.training.torch_file import write_torch_file

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointWriteError",
    "SavedCheckpoint",
    "check_room",
    "committed_sha256",
    "load_checkpoint",
    "save_state",
    "sha256_of",
]

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or not an fsmtrain checkpoint."""


class CheckpointWriteError(FileWriteError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error). Nothing committed
    before it changed: its temp file is gone and no name was moved to it."""

    @classmethod
    def of(cls, exc: OSError, epoch: int, path: Path, needs: int | None = None) -> CheckpointWriteError:
        """The error of writing ``path`` (the epoch's file, or one of its names) for ``epoch``;
        ``needs``: the bytes the file needs at least, when that is why it was not begun."""
        need = f"; it needs at least {needs} bytes" if needs is not None else ""
        return cls(exc.errno, f"the checkpoint of epoch {epoch_number(epoch)} could not be written: "
                              f"{write_failure(exc, str(path), path)}{need}; the checkpoints committed before it "
                              "are unchanged")


def check_room(path: Path, needs: int) -> None:
    """Raise ``OSError(ENOSPC)`` when the file system of ``path`` has fewer free blocks than ``needs``
    bytes, root's reserve included: a file that cannot fit is not begun. Begun, it would fill the
    disk to its last block before failing, and for that moment starve every other writer of the run
    (the log, W&B) of the space they had."""
    try:
        vfs = os.statvfs(path.parent)
    except OSError:
        return  # the write itself will say what is wrong
    if needs > vfs.f_bfree * vfs.f_frsize:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


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


class _Hashing:
    """A write-only file that hashes what passes through it. The zip writer sends each record as
    several small writes (header, name, padding) and each tensor's bytes as one: small ones are
    gathered into one buffer of up to ``GATHER`` bytes, so hashing and writing (which both release
    the GIL for large data) run once per buffer or tensor, not once per header."""

    GATHER = 1 << 16

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.digest = hashlib.sha256()
        self._pending = bytearray()

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if len(self._pending) + size > self.GATHER:
            self._put_pending()
        if size > self.GATHER:
            self._put(data)
        else:
            self._pending += data
        return size

    def _put(self, data: Any) -> None:
        self.digest.update(data)
        self.out.write(data)

    def _put_pending(self) -> None:
        if self._pending:
            self._put(self._pending)
            self._pending = bytearray()

    def flush(self) -> None:
        self._put_pending()
        self.out.flush()


def save_state(path: Path, state: Any) -> str:
    """Write ``state`` to ``path`` atomically and durably; returns the sha256 of the bytes written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            hashing = _Hashing(fh)
            write_torch_file(state, cast(IO[bytes], hashing))  # flushes ``hashing``, so ``fh`` too
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return hashing.digest.hexdigest()


def committed_sha256(path: str | Path) -> str | None:
    """The sha256 the run's log last committed for ``path`` (a file under ``<run>/checkpoints/``),
    or None when there is no such log or record."""
    p = Path(path)
    log = p.parent.parent / EVENTS_FILE
    return logged_sha256(log, p) if log.is_file() else None


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
