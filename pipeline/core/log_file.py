"""The file under a run log, append-only, whole lines or nothing (a failed write cuts it back and raises
:class:`LogWriteError`). A run whose log cannot grow must still say why it ended, so :data:`ROOM` bytes
stay allocated past the end (``FALLOC_FL_KEEP_SIZE``) for the last lines; ``close`` gives them back."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["EMPTY_PAYLOAD", "ROOM", "FileWriteError", "LogFile", "LogLine", "LogWriteError", "by_name",
           "describe_device", "log_number", "parse_line", "read_blocks", "read_lines", "typed_lines", "write_failure"]

ROOM = 64 * 1024  # what the end of a run writes (an exception with its traceback, the teardown, the result)
_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_WHAT = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large"}


class FileWriteError(OSError):
    """A file of a run could not be written; ``strerror`` says what, which file and which device."""

    @property
    def disk_full(self) -> bool:
        """Freeing space (or quota) lets the run go on: ``fsmtrain resume`` continues it."""
        return self.errno in _FULL


class LogWriteError(FileWriteError):
    """A line of a run log could not be written; the file still ends at its last whole line."""


def write_failure(exc: OSError, name: str, path: Path) -> str:
    """``no space left writing <name> (device ...)``: what failed, on which file, on which device."""
    what = _WHAT.get(exc.errno or 0, (exc.strerror or str(exc)).lower())
    return f"{what} writing {name} ({describe_device(path)})"


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not Linux (or no libc symbol): nothing is reserved
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate()


def describe_device(path: Path) -> str:
    """The file system ``path`` is on: its source, type, mount point and free space."""
    try:
        here = path.parent.resolve()
        dev = os.stat(here).st_dev
        mount = here
        while mount != mount.parent and os.stat(mount.parent).st_dev == dev:
            mount = mount.parent
        source, kind = "?", "?"
        with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 3 and fields[1].encode().decode("unicode_escape") == str(mount):
                    source, kind = fields[0], fields[2]
        vfs = os.statvfs(mount)
        return (f"device {source} ({kind}) mounted at {mount}, {vfs.f_bavail * vfs.f_frsize} of "
                f"{vfs.f_blocks * vfs.f_frsize} bytes free")
    except OSError as exc:
        return f"device unknown: {exc.strerror or exc}"


class LogFile:
    """``path`` opened for appending whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self._fd).st_size  # the end of the last whole line
        self._room_end = self.size  # allocated up to here
        try:
            self._block = max(os.fstatvfs(self._fd).f_frsize, 512)
        except OSError:
            self._block = 4096
        self._reserving = _FALLOCATE is not None
        self.full: LogWriteError | None = None  # the file can no longer grow: lines go into the room kept
        self._keep_room(0)

    def write(self, line: bytes) -> LogWriteError | None:
        """Append ``line`` whole, or raise :class:`LogWriteError`; the error when it went into the room kept."""
        fd = self._fd
        assert fd is not None, "the log file is closed"
        size = len(line)
        found_full = None
        if self.full is None and self.size + size + ROOM > self._room_end:
            found_full = self._keep_room(size)
        try:
            view = memoryview(line)
            while view:  # a partial write (a signal, a pipe): the rest, in as many as it takes
                view = view[os.write(fd, view):]
        except BaseException as exc:
            self._cut_back()
            if isinstance(exc, OSError):
                raise self._error(exc) from exc
            raise
        self.size += size
        return found_full

    def _keep_room(self, need: int) -> LogWriteError | None:
        fd = self._fd
        end = self.size + need + ROOM
        if not self._reserving or _FALLOCATE is None or fd is None or end <= self._room_end:
            return None
        end = -(-end // self._block) * self._block  # whole blocks: one call per block of log, not per line
        if _FALLOCATE(fd, _KEEP_SIZE, self._room_end, end - self._room_end) == 0:
            self._room_end = end
            return None
        err = ctypes.get_errno()
        if err in _FULL:
            self.full = self._error(OSError(err, os.strerror(err)))
            return self.full
        self._reserving = False  # EOPNOTSUPP, ENOSYS...: this file system keeps no room
        return None

    def _cut_back(self) -> None:
        """Back to the last whole line (a write cut short by a full disk leaves part of a line)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            self._room_end = self.size  # the truncation may have given the room back

    def _error(self, exc: OSError) -> LogWriteError:
        return LogWriteError(exc.errno, write_failure(exc, self.path.name, self.path))

    def fileno(self) -> int:
        if self._fd is None:  # as a closed io file says it (a sync from another thread may race close)
            raise ValueError(f"{self.path.name} is closed")
        return self._fd

    def close(self) -> None:
        """Give back the room kept past the end, and close."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._room_end > self.size:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self.size)
        os.close(fd)


_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def parse_line(raw: bytes) -> Any:
    """``json.loads`` of one log line: msgspec reads it (integers of any size, as json), unless it refuses it
    (NaN, lone surrogates, a number out of range...): then ``json`` reads it, as ``fsmtrain`` wrote it."""
    try:
        return _DECODE_ANY(raw)
    except msgspec.DecodeError:
        return json.loads(raw.decode("utf-8"))  # a UnicodeDecodeError is a ValueError


class LogLine(msgspec.Struct, rename={"from_": "from"}, gc=False):
    """A line that holds every field but its seal with the type the writer gives it (``payload`` left unread); a
    reader of long logs takes such lines from :func:`typed_lines` in bulk and parses any other (:func:`parse_line`)."""

    seq: int
    ts: int | float
    run_id: str
    event: str
    level: str
    phase: str
    from_: str | None
    to: str | None
    trigger: str | None
    epoch: int
    global_step: int
    payload: msgspec.Raw
    prev: str  # (its seal is not read here: a seal is checked from the line's bytes, where no link covers it)


EMPTY_PAYLOAD = msgspec.Raw(b"{}")
_DECODE = msgspec.json.Decoder(LogLine).decode
_DECODE_ANY = msgspec.json.Decoder().decode


def _typed(raw: bytes) -> LogLine | None:
    try:
        return _DECODE(raw)
    except msgspec.DecodeError:
        return None


def typed_lines(lines: list[bytes]) -> list[LogLine | None]:
    """Each line as a :class:`LogLine`, or None where it is none (any JSON error, a missing field, another type:
    such a line is for :func:`parse_line`). Values are json's: the last of a repeated key, integers of any size."""
    try:
        return list(map(_DECODE, lines))  # one call for a block whose lines all decode
    except msgspec.DecodeError:
        return list(map(_typed, lines))


def read_lines(path: Path, fail: Callable[[str], Exception]) -> Iterator[bytes]:
    """The lines of the log at ``path``, as written; ``fail(message)`` is raised if it cannot be read."""
    for block in read_blocks(path, fail):
        yield from block


def read_blocks(path: Path, fail: Callable[[str], Exception], size: int = 1 << 22) -> Iterator[list[bytes]]:
    """The lines of the log at ``path``, as written, some ``size`` bytes of them at a time (a reader that
    takes many lines in one step); ``fail(message)`` is raised if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            while block := fh.readlines(size):
                yield block
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc.strerror or exc}") from exc


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a long log is read and tabulated: that makes millions of small objects
    and no cycles among them, and the collector's passes over what is kept (a number per epoch, a move per
    line) cost a quarter of the time, and find nothing."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def by_name(held: list[Any]) -> dict[str, list[Any]] | None:
    """The values of mappings read from a run of log lines (``held``: one per line, as each holds it), by name:
    when every one is a dict with the same names (in the first one's order), or none is a dict (``{}``); else
    None (then read them one at a time)."""
    if not held:
        return {}
    first = held[0]
    if type(first) is not dict:
        return {} if dict not in set(map(type, held)) else None
    names = first.keys()
    if [h for h in held if type(h) is not dict or h.keys() != names]:
        return None
    return {name: [h[name] for h in held] for name in names}


def log_number(value: Any) -> float | None:
    """A number as a log writes it (non-finite ones as the strings NaN, Infinity, -Infinity), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return _NONFINITE.get(value) if isinstance(value, str) else None
