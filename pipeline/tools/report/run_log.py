"""A run's ``events.jsonl`` read for its report (:func:`read_run`): per-epoch numbers in a table by
column (one typed array a value, so a 200,000-epoch log costs a few MB), the run's path, checkpoints
and settings. Missing stays distinct from NaN; an epoch logged twice (a resume) keeps its last record."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsmtrain.core.drawing import DiagramError
from fsmtrain.core.log_file import log_number as as_float
from fsmtrain.core.run_path import PathCounter
from fsmtrain.tools.audit import AuditReadError, AuditReport
from fsmtrain.tools.audit.auditor import read_log

__all__ = ["Column", "EpochTable", "ReportError", "RunData", "as_float", "read_run"]


class Column:
    """One float64 per row and whether the row has one; spare room past the table's rows is ignored."""

    __slots__ = ("present", "values")

    def __init__(self, capacity: int) -> None:
        self.values = array("d", bytes(8 * capacity))
        self.present = bytearray(capacity)


class EpochTable:
    """Rows by 0-based epoch; columns by kind (metric, slot, time, phase, callback) and name."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self._row_of: dict[int, int] = {}
        self._all: list[Column] = []
        self._capacity = 1024
        self.columns: dict[str, dict[str, Column]] = {}  # kind -> name -> column

    def __len__(self) -> int:
        return len(self.index)

    def row(self, epoch: int) -> int:
        """The row of ``epoch``, emptied for its (new or repeated) record."""
        row = self._row_of.get(epoch)
        if row is None:
            row = self._row_of[epoch] = len(self.index)
            self.index.append(epoch)
            if row == self._capacity:  # room doubles: a row costs no work per column
                for column in self._all:
                    column.values.extend(array("d", bytes(8 * row)))
                    column.present.extend(bytes(row))
                self._capacity *= 2
        else:
            for column in self._all:
                column.present[row] = 0
        return row

    def add(self, columns: dict[str, Column], name: str) -> Column:
        """A new, empty column ``name`` in ``columns`` (one kind's)."""
        column = columns[name] = Column(self._capacity)
        self._all.append(column)
        return column

    def finish(self) -> None:
        """Rows in epoch order (a log writes them so, unless a resume re-ran some), no spare room."""
        rows = len(self.index)
        order = sorted(range(rows), key=self.index.__getitem__) if any(
            a > b for a, b in itertools.pairwise(self.index)) else None
        if order is not None:
            self.index = [self.index[i] for i in order]
        for c in self._all:
            if order is None:
                c.values, c.present = c.values[:rows], c.present[:rows]
            else:
                c.values = array("d", map(c.values.__getitem__, order))
                c.present = bytearray(map(c.present.__getitem__, order))

    def values(self, kind: str, name: str) -> list[float | None]:
        c = self.columns.get(kind, {}).get(name)
        if c is None:
            return [None] * len(self.index)
        if c.present.count(0) == 0:
            return [*c.values]
        return [v if p else None for v, p in zip(c.values, c.present, strict=True)]

    def totals(self, kind: str) -> dict[str, float]:
        return {name: sum(itertools.compress(c.values, c.present)) for name, c in self.columns.get(kind, {}).items()}


class ReportError(ValueError):
    """Input a report cannot be made from (no log, not a log, no such study); the message says which."""


@dataclass
class RunData:
    events_path: Path
    run_id: str = "?"
    config: dict[str, Any] = field(default_factory=dict)
    table: EpochTable = field(default_factory=EpochTable)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    lines: int = 0
    path: PathCounter = field(default_factory=PathCounter)
    path_problem: str | None = None  # why the path diagram cannot be drawn
    global_batch: dict[str, Any] | None = None  # the newest segment's (per rank x ranks x accumulation)
    x: list[int] = field(default_factory=list)  # each row's epoch, from 1
    again: Any = None  # the last internal move's words, its key and how often it came again
    again_key: tuple[str, str, str] = ("", "", "")
    repeats: int = 0

    def setting(self, source: str, key: str, *config_path: str) -> float | None:
        """A callback's setting from its ``callback_settings`` event, else from the run's config."""
        value = self.settings.get(source, {}).get(key)
        if value is None:
            node: Any = self.config
            for part in config_path:
                node = node.get(part) if isinstance(node, Mapping) else None
            value = node
        return as_float(value)

    def read(self, n: int, rec: dict[str, Any]) -> None:
        """One line that is a JSON object (line ``n``); a resumed run's re-run epochs count once (the last)."""
        if rec.get("event") == "transition" and (
                type(src := rec.get("from")) is type(dst := rec.get("to")) is type(trig := rec.get("trigger")) is str):
            # the common line, past the checks of ``record``
            self.move(n, (dst, src, dst, trig), rec.get("global_step"), rec.get("epoch"), rec.get("payload"))
            return
        try:
            self.path.record(rec, f"line {n}")
        except DiagramError as exc:
            self.path_problem = self.path_problem or str(exc)
        _read_event(self, rec)

    def move(self, n: int, words: tuple[str, ...], step: Any, epoch: Any, payload: Any = None) -> None:
        """A move (its phase, from, to and trigger); the audit gives a per-batch line's words as one tuple."""
        if words is self.again:  # that internal move again
            self.repeats += 1
            return
        _, src, dst, trig = words
        self.path.transition(src, dst, trig, step, epoch, payload)
        if src == dst:
            self._count_repeats()
            self.again, self.again_key = words, (src, dst, trig)

    def _count_repeats(self) -> None:
        if self.repeats:
            self.path.run.counts[self.again_key] += self.repeats
            self.repeats = 0

    def finish(self, lines: int) -> RunData:
        self._count_repeats()
        self.lines = lines
        if lines == 0 or (not len(self.table) and self.run_id == "?"):
            raise ReportError(f"{self.events_path}: no fsmtrain events in it; is this a run's events.jsonl?")
        self.table.finish()
        self.x = [e + 1 for e in self.table.index]  # the epochs as the console counts them
        return self

    def metric(self, name: str) -> list[float | None]:
        return self.table.values("metric", name)

    def slot(self, name: str, key: str | None = None) -> list[float | None]:
        """A numeric slot per epoch; ``key`` picks one value of a mapping slot (``loss_prediction``)."""
        return self.table.values("slot", name if key is None else f"{name}.{key}")


def read_run(events_path: Path) -> tuple[RunData, AuditReport]:
    """Everything the page draws, and the audit, from one pass over the log."""
    data = RunData(events_path)
    try:
        auditor = read_log(events_path, reader=data.read, mover=data.move)
    except AuditReadError as exc:
        raise ReportError(str(exc)) from exc
    unparsed = next((f for f in auditor.findings if f.check == "json"), None)
    if unparsed is not None:  # the diagram is not drawn
        data.path_problem = f"line {unparsed.line}: {unparsed.message}; run `fsmtrain audit`"
    return data.finish(auditor.lines), auditor.finish()


def _read_event(data: RunData, rec: Mapping[str, Any]) -> None:
    if (event := rec.get("event")) == "transition":
        return
    payload = rec.get("payload")
    payload = payload if isinstance(payload, Mapping) else {}
    if event == "run_start":
        data.run_id = str(rec.get("run_id", data.run_id))
        if isinstance(payload.get("config"), Mapping):
            data.config = dict(payload["config"])
        batch = payload.get("global_batch")
        data.global_batch = dict(batch) if isinstance(batch, Mapping) else None
    elif event == "epoch" and isinstance(rec.get("epoch"), int):
        _read_epoch(data.table, rec["epoch"], payload)
    elif event == "callback_settings" and isinstance(payload.get("settings"), Mapping):
        data.settings[str(payload.get("source"))] = dict(payload["settings"])
    elif event == "checkpoint":
        data.checkpoints.append(dict(payload))
    elif event == "checkpoint_removed":
        for ck in data.checkpoints:
            if ck.get("path") == payload.get("path"):
                ck["removed"] = True
    elif event == "result":
        data.result = dict(payload)


def _put_values(table: EpochTable, kind: str, row: int, values: Mapping[str, Any]) -> None:
    columns = table.columns.setdefault(kind, {})
    for name, value in values.items():
        cls = value.__class__
        if cls is not float:
            if cls is int:
                value = float(value)
            elif (value := as_float(value)) is None:
                continue
        column = columns.get(name) or table.add(columns, str(name))
        column.values[row] = value
        column.present[row] = 1


_KINDS = (("metric", "metrics"), ("phase", "phase_seconds"), ("callback", "callback_seconds"), ("slot", "slots"))


def _read_epoch(table: EpochTable, epoch: int, payload: Mapping[str, Any]) -> None:
    # the hot path of a long log: one call per epoch, a few dozen values each (JSON gives dicts)
    row = table.row(epoch)
    for kind, key in _KINDS:
        if isinstance(values := payload.get(key), dict):
            _put_values(table, kind, row, values)
    _put_values(table, "time", row, {"epoch": as_float(payload.get("seconds")) or 0.0})
    slots = payload.get("slots")
    for name, value in (slots.items() if isinstance(slots, dict) else ()):
        if isinstance(value, dict):
            _put_values(table, "slot", row, {f"{name}.{key}": inner for key, inner in value.items()})
