"""Structured run logs: ``events.jsonl`` (one strict-JSON object a line, keys :data:`EVENT_KEYS`; ``seq`` has
no gaps, ``ts`` never decreases; non-finite floats are written as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
``prev`` and ``seal`` chain the file) and a readable console. ``fsync="commits"`` syncs after each
``checkpoint`` line and the ``result``, so a checkpoint on disk never loses the line that commits it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

from fsmtrain.core.chain import Chain, last_line
from fsmtrain.core.log_file import LogFile, LogWriteError

LEVELS: Mapping[str, int] = {"debug": 10, "info": 20, "warning": 30, "error": 40}
EVENT_KEYS: tuple[str, ...] = ("seq", "ts", "run_id", "event", "level", "phase", "from", "to", "trigger", "epoch",
                               "global_step", "payload", "prev", "seal")
EVENTS_FILE = "events.jsonl"
# Events whose ``message`` is all the console shows of them (a person reads it; the log keeps the rest).
_MESSAGE_ON_CONSOLE: frozenset[str] = frozenset({"checkpoint_damaged", "restart"})
FSYNC_POLICIES: tuple[str, ...] = ("commits", "every", "never")
DURABLE_EVENTS: frozenset[str] = frozenset({"checkpoint", "result"})


def jsonable(value: Any) -> Any:
    """Make ``value`` strict-JSON safe: non-finite floats to strings, tensors and paths to plain values."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # the common cases first
        return value
    if kind is float and value - value == 0.0:  # finite (inf - inf and NaN - NaN are NaN)
        return value
    if isinstance(value, float):
        number = float(value)
        if math.isfinite(number):
            return number
        return "NaN" if math.isnan(number) else ("Infinity" if number > 0 else "-Infinity")
    if isinstance(value, Enum):
        return jsonable(value.value)
    if isinstance(value, (str, int)):
        return value
    if isinstance(value, Mapping):
        return {k if type(k) is str else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return jsonable(value.item())
        except (ValueError, RuntimeError):
            pass
    return str(value)


def as_float(value: Any) -> float:
    """Read a number written by :func:`jsonable` (``"NaN"`` etc. included); None gives NaN."""
    return math.nan if value is None else float(value)


def check_levels(**levels: str) -> None:
    """Each named level is one of :data:`LEVELS` (checked before a log is opened)."""
    for name, lvl in levels.items():
        if lvl not in LEVELS:
            raise ValueError(f"{name} must be one of {sorted(LEVELS)}, got {lvl!r}")


class EventLog:
    """Writes a run's events to ``path``, the console (structlog) and, with ``keep``, ``records``; ``config``
    is what the first line chains to, ``key`` makes the chain HMAC-SHA256."""

    def __init__(self, path: Path | str | None, run_id: str, *, level: str = "info",
                 console: TextIO | None = sys.stderr, console_level: str = "warning", keep: bool = False,
                 start_seq: int = 0, config: Any = None, key: bytes | None = None, fsync: str = "commits") -> None:
        check_levels(level=level, console_level=console_level)
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.fsync = fsync
        self.run_id = run_id
        self.path = Path(path) if path is not None else None
        self.level = LEVELS[level]
        self.console_level = LEVELS[console_level]
        self.records: list[dict[str, Any]] | None = [] if keep else None
        self.chain = Chain(key)
        self._seq = start_seq
        self._last_ts = 0.0
        self._lock = threading.Lock()  # the checkpoint writer logs from its own thread
        self._position: tuple[str | None, int | None, int | None] = (None, None, None)  # of the last line
        self._head = self.chain.genesis(run_id, jsonable(config))
        self._file: LogFile | None = None
        # A log that can no longer be written fails once; later lines that do not fit are counted.
        self._failed: LogWriteError | None = None
        self._dropped = 0
        self._stream = console
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tail = last_line(self.path)
            self._file = LogFile(self.path)
            if tail is not None:
                self._continue_from(tail)
        self._console: Any = None
        if console is not None:
            import structlog  # here: a command that prints no run (audit, report...) starts 0.1 s sooner

            self._console = structlog.wrap_logger(
                structlog.PrintLogger(console),
                processors=[self._to_console, structlog.dev.ConsoleRenderer(colors=console.isatty())])

    def _continue_from(self, tail: bytes) -> None:
        """Appending to a log: chain to its last line, and keep ``ts`` from going back before it."""
        assert self._file is not None
        if not tail.endswith(b"\n"):  # a line cut by a killed process: end it, it stays evidence
            self._file.write(b"\n")
            tail += b"\n"
        self._head = self.chain.digest(tail)
        try:
            ts = json.loads(tail)["ts"]
        except (ValueError, TypeError, KeyError):
            return
        if type(ts) is float or type(ts) is int:
            self._last_ts = float(ts)

    @property
    def head(self) -> str:
        """The digest the next line will carry in ``prev``; a checkpoint pins the log with it."""
        return self._head

    def enabled_for(self, level: str) -> bool:
        return LEVELS[level] >= min(self.level, self.console_level if self._console is not None else 99)

    def emit(self, event: str, *, level: str = "info", phase: str | None = None, epoch: int | None = None,
             global_step: int | None = None, payload: Mapping[str, Any] | None = None, at_last_line: bool = False,
             defer_sync: bool = False, **transition: Any) -> bool:
        """``at_last_line``: the line takes the position of the line before (from another thread).
        ``defer_sync``: a durable line is not synced here; True when the caller must :meth:`sync` later."""
        with self._lock:
            if at_last_line:
                phase, epoch, global_step = self._position
            written = self._emit(event, level, phase, epoch, global_step, payload, transition)
        if not written or self.fsync == "never":
            return False
        if self.fsync == "every" or (event in DURABLE_EVENTS and not defer_sync):
            self.sync()  # outside the lock: a line from the other thread never waits for the disk
            return False
        return event in DURABLE_EVENTS  # ``commits``, deferred: the caller syncs after its last line

    def sync(self) -> None:
        """Make every line written so far durable (fsync). A closed log has nothing left to sync."""
        file = self._file
        # ValueError: closed by the other thread meanwhile (a write is never buffered).
        with contextlib.suppress(ValueError):
            if file is not None:
                os.fsync(file.fileno())

    def _emit(self, event: str, level: str, phase: str | None, epoch: int | None, global_step: int | None,
              payload: Mapping[str, Any] | None, transition: Mapping[str, Any]) -> bool:
        """Whether a line went to the file."""
        lvl = LEVELS[level]
        chained = self._file is not None
        to_file = lvl >= self.level and (chained or self.records is not None)
        to_console = self._console is not None and lvl >= self.console_level
        if not (to_file or to_console):
            return False
        self._position = (phase, epoch, global_step)
        now = self._last_ts = max(time.time(), self._last_ts)  # ts never goes back
        body = jsonable(payload) if payload else {}
        if event == "run_start" and chained:
            body["chain"] = self.chain.describe()
        record: dict[str, Any] = {
            "seq": self._seq,
            "ts": now,
            "run_id": self.run_id,
            "event": event,
            "level": level,
            "phase": phase,
            "from": transition.get("from_phase"),
            "to": transition.get("to_phase"),
            "trigger": transition.get("trigger"),
            "epoch": epoch,
            "global_step": global_step,
            "payload": body,
            "prev": self._head if chained else None,
        }
        if to_file:
            if self.records is not None:
                self.records.append(record)
            if chained:
                self._write(record)
            else:
                record["seal"] = None
                self._seq += 1
        if to_console:
            getattr(self._console, level)(event, record=record)
        return to_file and chained

    def _write(self, record: dict[str, Any]) -> None:
        """One line, sealed and written whole (or not at all), then counted and made the chain head."""
        data, seal, digest = self.chain.seal(_ENCODE(record).encode("ascii"))
        file = self._file
        assert file is not None
        try:
            full = file.write(data)
        except LogWriteError as exc:
            if self._failed is None:
                self._failed = exc
                raise
            self._dropped += 1  # the run is already ending for this; the console shows the line
            return
        self._head = digest
        self._seq += 1
        record["seal"] = seal
        if full is not None and self._failed is None:  # written into the room kept for the end
            self._failed = full
            raise full

    @property
    def failed(self) -> LogWriteError | None:
        """Why the log could not be written, once it could not."""
        return self._failed

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if self._dropped and self._stream is not None:
                print(f"error: {self._failed}; {self._dropped} later line(s) did not fit either: "
                      f"{EVENTS_FILE if self.path is None else self.path.name} ends at seq {self._seq - 1}, "
                      "its last whole line", file=self._stream, flush=True)

    @staticmethod
    def _to_console(_: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
        r = event_dict["record"]
        if r["event"] == "exception" and r["payload"].get("interrupt"):
            import structlog  # loaded by the constructor that made the console

            raise structlog.DropEvent  # a requested stop, not a fault: the run's summary names it
        out: dict[str, Any] = {"event": r["event"], "level": "warning" if method_name == "warn" else method_name}
        if r["event"] == "transition":
            out["move"] = f"{r['from']} -> {r['to']} ({r['trigger']})"
        out["epoch"] = r["epoch"]
        payload = r["payload"]
        if r["event"] in _MESSAGE_ON_CONSOLE and "message" in payload:
            out["message"] = payload["message"]  # it says it all; the details stay in events.jsonl
            return out
        out.update(payload)
        if "traceback" in out:  # the full traceback stays in events.jsonl; the console gets one line
            del out["traceback"]
            out["traceback_in"] = EVENTS_FILE
        out.pop("symptom", None)  # the console names the failing rank, not what this rank met
        return out


# Compact, strict, ASCII-only JSON: a line of the log.
_ENCODE = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


def read_events(path: Path | str) -> list[dict[str, Any]]:
    """All events of a log, in file order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def first_run_start(path: Path | str) -> dict[str, Any] | None:
    """The payload of a log's first ``run_start``, or None; unreadable lines are the audit's to report."""
    with open(path, "rb") as fh:
        for line in fh:
            try:
                rec = json.loads(line)  # bytes that are not UTF-8 raise a ValueError too
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "run_start":
                payload = rec.get("payload")
                return payload if isinstance(payload, dict) else {}
    return None
