"""A run's ``events.jsonl`` parsed into a :class:`Recording` (a resumed run's as the run it continues): its
setup, each epoch's values, the pruner's decisions (:class:`RecordedTrial`), the signal that ended it and,
on one rank of several, the other ranks' part (:class:`RecordedRanks`)."""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsmtrain.core.consensus import Failure, RankFailed, proposal_of
from fsmtrain.core.context import RunContext, StopRequest
from fsmtrain.core.events import EVENTS_FILE, as_float
from fsmtrain.core.lifecycle import EPOCH_PHASES, Phase
from fsmtrain.core.log_file import parse_line, read_lines
from fsmtrain.core.stop import StopReason

__all__ = ["SEGMENT_ONLY", "Interruption", "RecordedEpoch", "RecordedRanks", "RecordedTrial", "Recording",
           "ReplayBatch", "ReplayError", "TrialReport", "interrupt_of", "load_recording", "recorded_ranks",
           "recording_from_events", "split_source"]

_ON_RANK = re.compile(r" on rank (\d+)$")
SEGMENT_ONLY = frozenset({"run_start", "resume", "restart", "transition"})
_NON_FINITE = ("NaN", "Infinity", "-Infinity")  # jsonable's spelling of non-finite floats, undone


class ReplayError(ValueError):
    """A recording or a callback set that cannot be replayed; the message says which and why."""


@dataclass(frozen=True)
class ReplayBatch:
    """``step.batch`` in a replay: its position."""

    epoch: int
    index: int


@dataclass(frozen=True)
class RecordedEpoch:
    """One epoch's recorded values. ``partial``: the run left it mid-way (its losses are unknown)."""

    index: int
    metrics: Mapping[str, float]
    slots: Mapping[str, Any] = field(default_factory=dict)
    batches: int = 1
    partial: bool = False
    cut: bool = False  # a stop after a validation inside it ended it with batches left


@dataclass(frozen=True)
class TrialReport:
    validation: int  # the run's validation count, from 1 (Optuna's ``step``)
    value: float
    should_prune: bool
    trial: int | None = None  # the Optuna trial number


@dataclass
class RecordedTrial:
    """An ``optuna.trial.Trial`` for a replay: ``should_prune`` answers what the real pruner decided there
    (``False`` where none was recorded, listed in ``unknown_steps``)."""

    reports: Mapping[int, TrialReport]
    number: int = -1
    params: dict[str, Any] = field(default_factory=dict)
    user_attrs: dict[str, Any] = field(default_factory=dict)
    reported: dict[int, float] = field(default_factory=dict)
    unknown_steps: list[int] = field(default_factory=list)
    _last_step: int | None = field(default=None, init=False)

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value
        self._last_step = step

    def should_prune(self) -> bool:
        rec = None if self._last_step is None else self.reports.get(self._last_step)
        if rec is None and self._last_step is not None:
            self.unknown_steps.append(self._last_step)
        return rec is not None and rec.should_prune

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value


@dataclass(frozen=True)
class Interruption:
    """Where a recorded signal ended the run: the phase the engine left, at which global step."""

    signum: int
    phase: str
    epoch: int
    global_step: int
    rank: int | None = None  # the rank it was sent to, in a multi-process run


@dataclass
class Recording:
    """A parsed ``events.jsonl``: the setup of the run and its per-epoch values."""

    path: Path | None
    run_id: str
    run_start: Mapping[str, Any]
    epochs: list[RecordedEpoch]
    trial_reports: dict[int, TrialReport]
    events: list[dict[str, Any]]
    level: str
    result: Mapping[str, Any] | None
    interrupt: Interruption | None = None
    segments: int = 1
    validations: dict[int, dict[str, float]] = field(default_factory=dict)  # by global step (val_every_n_steps)

    @property
    def config(self) -> Mapping[str, Any] | None:
        return cfg if isinstance(cfg := self.run_start.get("config"), Mapping) else None

    @property
    def complete_epochs(self) -> int:
        return sum(1 for e in self.epochs if not e.partial)

    @property
    def stop_reason(self) -> StopReason | None:
        reason = None if self.result is None else self.result.get("stop_reason")
        return None if reason is None else StopReason(reason)

    @property
    def best_val_loss(self) -> float:
        vals = (e.metrics.get("val_loss", math.nan) for e in self.epochs if not e.partial)
        return min((v for v in vals if math.isfinite(v)), default=math.inf)


def load_recording(path: str | Path) -> Recording:
    """Parse a run's ``events.jsonl`` (or a run directory holding one) into a :class:`Recording`."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.is_file():
        raise ReplayError(f"no events log at {p}: expected a run's {EVENTS_FILE} or the run directory holding it")
    events = []
    for n, raw in enumerate(read_lines(p, ReplayError), 1):
        try:
            if raw.strip():
                events.append(parse_line(raw))
        except ValueError as exc:
            raise ReplayError(f"{p} is not an events log: line {n} is not JSON ({exc})") from exc
    return recording_from_events(events, path=p)


def _floats(values: Any) -> dict[str, float]:
    return {str(k): as_float(v) for k, v in (values or {}).items()}


def recording_from_events(events: list[dict[str, Any]], *, path: Path | None = None) -> Recording:
    """A :class:`Recording` of a parsed log (one run, or one run and its resumes)."""
    where = str(path) if path is not None else "the events"
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start"]
    if not starts:
        raise ReplayError(f"{where} has no run_start event: not an fsmtrain events log")
    for i, end in zip(starts[1:], [*starts[2:], len(events)], strict=False):
        restarted = any(e.get("event") == "restart" for e in events[i:end])  # started over in place: from epoch 0
        if not (events[i].get("payload") or {}).get("resumed_from") and not restarted:
            raise ReplayError(f"{where} holds two runs (a second run_start at seq {events[i].get('seq')} that is "
                              "not a resume); replay needs the log of one run")
    start, original = events[starts[0]], events
    if len(starts) > 1:
        events = _stitched(events, starts)
    epochs: list[RecordedEpoch] = []
    reports: dict[int, TrialReport] = {}
    result: Mapping[str, Any] | None = None
    step_at_epoch_start = last_step = 0
    for e in events[starts[0] + 1:]:
        kind, payload = e.get("event"), e.get("payload") or {}
        if isinstance(gs := e.get("global_step"), int):
            last_step = gs
        if kind == "epoch":
            batches = int(payload.get("batches", 0))
            slots = {str(k): as_float(v) if v in _NON_FINITE else v for k, v in (payload.get("slots") or {}).items()}
            epochs.append(RecordedEpoch(len(epochs), _floats(payload.get("metrics")), slots, batches,
                                        cut=payload.get("cut") is True))
            step_at_epoch_start = int(e.get("global_step") or step_at_epoch_start + batches)
        elif kind == "trial_report":
            # an older log: one validation an epoch, named by its 0-based epoch
            n = int(payload["validation"]) if "validation" in payload else int(payload["epoch"]) + 1
            reports[n] = TrialReport(n, as_float(payload.get("value")), bool(payload.get("should_prune")),
                                     payload.get("trial") if isinstance(payload.get("trial"), int) else None)
        elif kind == "result":
            result = payload
    last_segment = original[starts[-1]:]
    ends = [e for e in last_segment if e.get("event") == "transition" and e.get("to") == Phase.TRAIN_END.value]
    left = ends[-1].get("from") if ends else None
    measured = next((m for e in last_segment if e.get("event") == "exception"
                     and isinstance(m := (e.get("payload") or {}).get("epoch_metrics"), dict)), None)
    if left in {p.value for p in EPOCH_PHASES} and (left != Phase.EPOCH_END.value or measured is not None):
        # An immediate stop or a signal left this epoch without its ``epoch`` line (from epoch_end: the fault
        # carried its metrics): its batches are known, and what it had measured when it was cut, not the rest.
        epochs.append(RecordedEpoch(len(epochs), _floats(measured), {}, last_step - step_at_epoch_start, partial=True))
    level = "debug" if any(e.get("level") == "debug" for e in events) else "info"
    run_start = dict(start.get("payload") or {})
    last_start = last_segment[0].get("payload") or {}
    run_start.pop("max_steps", None)  # a resume may extend the run: its own budget counts
    run_start.update({k: last_start[k] for k in ("max_epochs", "max_steps", "val_every_n_steps", "config")
                      if k in last_start})
    # every segment's, a resumed epoch's first part too (the stitched log leaves it out)
    validations = {int(e["global_step"]): _floats(e["payload"].get("metrics"))
                   for e in original if e.get("event") == "validation" and isinstance(e.get("global_step"), int)}
    interrupt = next((Interruption(sig[0], *_where(e), sig[1]) for e in last_segment
                      if (sig := interrupt_of(e)) is not None), None)
    return Recording(path, str(start.get("run_id") or "replay"), run_start, epochs, reports, events, level,
                     result, interrupt, len(starts), validations)


def split_source(source: str) -> tuple[str, int | None]:
    """A logged ``source`` without its `` on rank N``, and that rank (None: it names none)."""
    m = _ON_RANK.search(source)
    return (source[: m.start()], int(m.group(1))) if m else (source, None)


def interrupt_of(event: Mapping[str, Any]) -> tuple[int, int | None] | None:
    """The signal number and rank of an ``exception`` line a signal (``signal SIGTERM``) caused."""
    payload = event.get("payload") or {}
    if event.get("event") != "exception" or not payload.get("interrupt"):
        return None
    source, rank = split_source(str(payload.get("source", "")))
    name = source.removeprefix("signal ")
    return (int(signal.Signals[name]), rank) if name != source and name in signal.Signals.__members__ else None


def _where(event: Mapping[str, Any]) -> tuple[str, int, int]:
    """Where a log line was written: its phase, epoch and global step."""
    return str(event.get("phase")), int(event.get("epoch") or 0), int(event.get("global_step") or 0)


def _stitched(events: list[dict[str, Any]], starts: list[int]) -> list[dict[str, Any]]:
    """A resumed run's log as the run it continues: of each segment, the epochs the next one did not
    redo, without what each process logs of itself (run_start, resume, transitions, teardown)."""
    out: list[dict[str, Any]] = []
    firsts = [int((events[i].get("payload") or {}).get("start_epoch", 0)) for i in starts]  # 0: the first, a restart
    for k, (begin, end) in enumerate(zip(starts, [*starts[1:], len(events)], strict=True)):
        redo_from = firsts[k + 1] if k + 1 < len(starts) else None
        for e in events[begin:end]:
            epoch, phase = e.get("epoch"), e.get("phase")
            if e.get("event") in SEGMENT_ONLY or (firsts[k] and phase == Phase.TRAIN_BEGIN.value):
                continue  # a resumed process sets itself up again
            if redo_from is None or (isinstance(epoch, int) and epoch < redo_from and phase != Phase.TRAIN_END.value):
                out.append(e)
    return out


@dataclass(frozen=True)
class _Contribution:
    where: tuple[str, int, int]  # where the ranks agreed (the log line's phase, epoch and global step)
    rank: int
    row: list[int]
    said: tuple[str, str] | None  # the winner's source and message


@dataclass(frozen=True)
class PeerFailure:
    """Where another rank's failure ended this rank's run, as its log recorded it."""

    failure: Failure
    symptom: str | None  # what broke here (a collective's error); None: seen at an agreement point
    where: tuple[str, int, int]  # the phase, epoch and global step


class RecordedRanks:
    """The other ranks of a recorded multi-process run, for the replay of one of them."""

    def __init__(self, rank: int, world_size: int, contributions: Sequence[_Contribution],
                 peer_failure: PeerFailure | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self._todo = list(contributions)
        self._said: dict[int, tuple[str, str]] = {}
        self.peer_failure = peer_failure
        self.run: RunContext | None = None  # set by the replay before it runs

    def post_failure(self, failure: Failure) -> Failure:
        return self.posted_failure() or failure

    def posted_failure(self) -> Failure | None:
        return None if self.peer_failure is None else self.peer_failure.failure

    def breaks_in(self, phase: Phase, epoch: int) -> bool:
        """Whether another rank's failure broke this rank's collective in that phase of that epoch."""
        f = self.peer_failure
        return f is not None and f.symptom is not None and f.where[:2] == (phase.value, epoch)

    def symptom_at(self, phase: Phase, epoch: int) -> str | None:
        """The collective's error this rank met here, when another rank's failure broke it here."""
        f, run = self.peer_failure, self.run
        if f is None or run is None or not self.breaks_in(phase, epoch) or run.global_step != f.where[2]:
            return None
        return f.symptom

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        assert self.run is not None
        rows = [[0] * len(values) for _ in range(self.world_size)]
        rows[self.rank] = list(values)
        here = (self.run.phase.value, self.run.epoch, self.run.global_step)
        f = self.peer_failure
        if f is not None and f.symptom is None and f.where == here:
            raise RankFailed(f.failure)  # seen on the board while this rank waited here
        for c in [c for c in self._todo if c.where == here]:
            self._todo.remove(c)
            rows[c.rank] = [max(a, b) for a, b in zip(rows[c.rank], c.row, strict=True)]  # all >= 0
            if c.said is not None:
                self._said[c.rank] = c.said
        return rows

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj if src == self.rank else self._said.get(src)


def recorded_ranks(run_start: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> RecordedRanks | None:
    """The other ranks of the run whose ``events`` these are; None for a one-process run."""
    world, rank = run_start.get("world_size"), run_start.get("rank")
    if not isinstance(world, int) or world < 2 or not isinstance(rank, int):
        return None
    out: list[_Contribution] = []
    failed = None  # the RankFailed of the log's last segment: the failing rank, its source and exception
    for e in events:
        payload = e.get("payload") or {}
        where = _where(e)
        if e.get("event") == "stop_request" and isinstance(payload.get("rank"), int) and payload["rank"] != rank:
            source, _ = split_source(str(payload.get("source", "")))
            request = StopRequest(StopReason(payload["reason"]), source, str(payload.get("message", "")),
                                  bool(payload.get("immediate")), int(payload.get("requested_epoch", where[1])), 0,
                                  Phase(payload.get("requested_phase", where[0])))
            out.append(_Contribution(where, payload["rank"], proposal_of(request, None), (source, request.message)))
        elif (sig := interrupt_of(e)) is not None and isinstance(origin := sig[1], int) and origin != rank:
            out.append(_Contribution(where, origin, proposal_of(None, sig[0]), None))
        if e.get("event") == "run_start":
            failed = None
        elif e.get("event") == "exception" and isinstance(payload.get("failed_rank"), int):
            source, origin = split_source(str(payload.get("source", "")))
            said = str(payload.get("message", "")).removeprefix(f"rank {origin} failed in {source}: ")
            symptom = payload.get("symptom")
            failed = PeerFailure(Failure(payload["failed_rank"], source, said),
                                 symptom if isinstance(symptom, str) else None, where)
    return RecordedRanks(rank, world, out, failed)
