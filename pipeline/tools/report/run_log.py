"""A run's ``events.jsonl`` read for its report (:func:`read_run`): per-epoch numbers by column, the run's
path, checkpoints and settings. Missing stays distinct from NaN."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

from fsmtrain.core.drawing import DiagramError
from fsmtrain.core.log_file import by_name, collector_paused
from fsmtrain.core.log_file import log_number as as_float
from fsmtrain.core.run_path import PathCounter
from fsmtrain.tools.audit import AuditReadError, AuditReport
from fsmtrain.tools.audit.auditor import read_log

__all__ = ["EpochTable", "ReportError", "RunData", "as_float", "read_run"]


class EpochTable:
    """Rows by 0-based epoch (an epoch logged twice, by a resume, keeps its last record); columns by kind and
    name, in the order their first number appears. A record's values are taken as it is read (whole epochs read
    together, a column at a time), so a long log's records are not kept."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self.columns: dict[str, dict[str, list[float | None]]] = {}  # kind -> name -> a value per row
        self._epochs: list[int] = []  # each record's epoch, in the log's order
        self._held: dict[str, dict[str, list[Any]]] = {kind: {} for kind, _ in _KINDS}  # a value per record
        self._seconds: list[float | None] = []  # typed as a column; a missing one is 0, never None

    def __len__(self) -> int:
        return len(self.index or set(self._epochs))  # (the records are let go when the table is finished)

    def add(self, epochs: list[int], payloads: Sequence[Mapping[str, Any]],
            columns: Mapping[str, Mapping[str, list[Any]]] | None = None) -> None:
        """The records of ``epochs``, one each (``payloads``, also by column where the audit has them: ``columns``),
        in the log's order."""
        before, size, columns = len(self._epochs), len(payloads), columns or {}
        self._epochs += epochs
        for kind, key in _KINDS:
            cols = columns.get(key)
            if cols is None or (kind == "slot" and any(dict in set(map(type, col)) for col in cols.values())):
                cols = by_name(list(map(_slots if kind == "slot" else operator.methodcaller("get", key), payloads)))
            if not _take(self._held[kind], cols, before, size):  # records that differ: one at a time
                for i, p in enumerate(payloads):
                    values = _slots(p) if kind == "slot" else p.get(key)
                    _take(self._held[kind], {k: [v] for k, v in values.items()} if type(values) is dict else {},
                          before + i, 1)
        seconds = columns["seconds"]["seconds"] if "seconds" in columns else [p.get("seconds") for p in payloads]
        if set(map(type, seconds)) == {float} and 0.0 not in seconds:  # as they are
            self._seconds += seconds
        else:
            self._seconds += [as_float(s) or 0.0 for s in seconds]

    def finish(self) -> None:
        last = dict(zip(self._epochs, range(len(self._epochs)), strict=True))  # each epoch's last record
        self.index = sorted(last)
        rows = [last[e] for e in self.index]
        pick = None if rows == list(range(len(self._epochs))) else rows  # None: each epoch once, in order
        for kind, held in self._held.items():
            self.columns[kind] = {name: _numbers(col if pick is None else [col[i] for i in pick])
                                  for name, col in held.items()}
        self.columns["time"] = {"epoch": self._seconds if pick is None else [self._seconds[i] for i in pick]}
        self._held, self._seconds, self._epochs = {}, [], []

    def values(self, kind: str, name: str) -> list[float | None]:
        return self.columns.get(kind, {}).get(name) or [None] * len(self.index)

    def totals(self, kind: str) -> dict[str, float]:
        return {name: _sum(c) for name, c in self.columns.get(kind, {}).items()}


def _sum(values: list[float | None]) -> float:
    """The sum of the numbers of ``values`` (None: no number that epoch)."""
    try:
        return sum(values)  # type: ignore[arg-type]  # (the common column has no None: one pass)
    except TypeError:
        return sum(v for v in values if v is not None)


def _take(table: dict[str, list[Any]], cols: Mapping[str, list[Any]] | None, before: int, size: int) -> bool:
    """``cols`` (records ``before``... by name, ``size`` values each) added to ``table``: a name is added where a
    number first appears under it; False, with nothing changed, where that order is not the names' order in the
    first record (read the records one at a time then)."""
    if cols is None:
        return False
    firsts = {name: next((i for i, v in enumerate(col) if as_float(v) is not None), None)
              for name, col in cols.items() if name not in table}
    if any(firsts.values()):  # a new name's first number is past the first record
        return False
    for name, first in firsts.items():
        if first is not None:
            table[name] = [None] * before
    for name, col in table.items():
        col.extend(cols.get(name) or repeat(None, size))
    return True


def _slots(payload: Mapping[str, Any]) -> Any:
    """The slots of an epoch, those that hold a mapping (``loss_prediction``) flattened: ``name.key``."""
    slots = payload.get("slots")
    if type(slots) is not dict or dict not in map(type, slots.values()):
        return slots
    nested = {f"{name}.{k}": v for name, inner in slots.items() if type(inner) is dict for k, v in inner.items()}
    return {**slots, **nested}


def _numbers(values: list[Any]) -> list[float | None]:
    """``values`` as numbers (:func:`as_float`); a column of floats, the common one, as it is, and one that is
    missing in most epochs (None there: a slot set now and then) as it is too."""
    types = set(map(type, values))
    if types <= _FLOATS:
        return values
    if types <= _PLAIN:
        return [v if v is None else float(v) for v in values]
    return [v if v.__class__ is float else as_float(v) for v in values]


_FLOATS, _PLAIN = {float, type(None)}, {int, float, type(None)}  # (a bool is its own type: not a number here)


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
    strategy: str | None = None  # the newest segment's: ddp, or fsdp and what it sharded
    x: list[int] = field(default_factory=list)  # each row's epoch, from 1
    again: tuple[str, ...] = ()  # the last internal move's words (phase, from, to, trigger), and its repeats
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
            self.move(n, (dst, src, dst, trig), rec.get("global_step"), rec.get("epoch"), 1, rec.get("payload"))
            return
        try:
            self.path.record(rec, f"line {n}")
        except DiagramError as exc:
            self.path_problem = self.path_problem or str(exc)
        _read_event(self, rec)

    def move(self, n: int, words: tuple[str, ...], step: Any, epoch: Any, times: int = 1, payload: Any = None) -> None:
        """A move (its phase, from, to and trigger) made ``times`` times in a row; the audit gives a per-batch
        line's words as one tuple."""
        if words is self.again:  # that internal move again
            self.repeats += times
            return
        _, src, dst, trig = words
        self.path.transition(src, dst, trig, step, epoch, payload)
        if src == dst:
            self._count_repeats()
            self.again, self.repeats = words, times - 1

    def epochs(self, n: int, words: Sequence[tuple[str, ...]], steps: list[list[int]], epochs: range,
               payloads: Sequence[Mapping[str, Any]], columns: dict[str, dict[str, list[Any]]]) -> None:
        """Whole epochs (their moves' words, each move's global step in each epoch, the epochs and their records,
        also by column), as :meth:`move` and :meth:`read` of each line would take them."""
        self.path.epochs([(src, dst, trig) for _, src, dst, trig in words], steps, len(payloads))
        self.path.run.epochs_done += len(payloads)
        self.table.add(list(epochs), payloads, columns)

    def _count_repeats(self) -> None:
        if self.repeats:
            self.path.run.counts[(self.again[1], self.again[2], self.again[3])] += self.repeats
            self.repeats = 0

    def finish(self, lines: int) -> RunData:
        self._count_repeats()
        self.lines = lines
        if lines == 0 or (not len(self.table) and self.run_id == "?"):
            raise ReportError(f"{self.events_path}: no fsmtrain events in it; is this a run's events.jsonl?")
        with collector_paused():
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
        auditor = read_log(events_path, reader=data.read, mover=data.move, cycler=data.epochs)
    except AuditReadError as exc:
        raise ReportError(str(exc)) from exc
    unparsed = next((f for f in auditor.findings if f.check == "json"), None)
    if unparsed is not None:  # the diagram is not drawn
        data.path_problem = f"line {unparsed.line}: {unparsed.message}; run `fsmtrain audit`"
    return data.finish(auditor.lines), auditor.finish()


def _read_event(data: RunData, rec: Mapping[str, Any]) -> None:
    event, payload = rec.get("event"), rec.get("payload")
    payload = payload if isinstance(payload, Mapping) else {}
    if event == "run_start":
        data.run_id = str(rec.get("run_id", data.run_id))
        if isinstance(payload.get("config"), Mapping):
            data.config = dict(payload["config"])
        batch = payload.get("global_batch")
        data.global_batch = dict(batch) if isinstance(batch, Mapping) else None
        units, world = (payload.get("sharding") or {}).get("units"), payload.get("world_size", 1)
        data.strategy = (f"fsdp (FSDP2 over {world} ranks, {len(units)} unit(s) sharded; checkpoints: DCP folders)"
                         if isinstance(units, list) else None if payload.get("strategy") is None
                         else str(payload["strategy"]))
    elif event == "epoch" and isinstance(rec.get("epoch"), int):
        data.table.add([rec["epoch"]], [payload])
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


_KINDS = (("metric", "metrics"), ("phase", "phase_seconds"), ("callback", "callback_seconds"), ("slot", "slots"))
