"""State replay: re-drive the lifecycle machine and the real callbacks from recorded or synthetic values.

Replay is one more :class:`pipeline.core.engine.Driver`. It runs the same :class:`~pipeline.core.engine.Engine`,
the same ``transitions`` machine and the same callbacks as training; only the numbers differ in
origin: each epoch's learning rate, train loss, validation loss and metrics come from a run's
``events.jsonl`` (:func:`replay_run`) or from lists (:func:`replay_losses`), never from a model.

How each callback takes part is its ``replay`` class attribute (:class:`pipeline.core.hooks.ReplaySupport`):
``FULL`` callbacks run as they ran, ``DRY`` ones run with ``run.dry_run`` set (no model, no optimizer)
and whatever they emit is kept apart as what they *would* have done, ``NONE`` is refused by name.
Slot values that only a dry callback computes (e.g. ``max_grad_norm`` from live gradients) are fed
back from the recording, just before ``on_epoch_end`` where their writers produce them.

A replay cannot invent epochs the recording does not have: when a what-if outlives the recording,
the driver raises :class:`RecordingExhausted` at the next epoch, the engine takes its ordinary fault
path, and the result says the stop is unknown beyond epoch N.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pipeline.core import BaseDriver, Engine, Interrupted, TrainResult
from pipeline.core.context import EpochContext, EpochRecord, RunContext, Slot, StepContext, epoch_number
from pipeline.core.events import EVENTS_FILE, EventLog, as_float, jsonable, read_events
from pipeline.core.hooks import ReplaySupport, TrainingCallback
from pipeline.core.lifecycle import Phase, StopReason
from pipeline.core.runner import CallbackRunner
from pipeline.tools.replay_cli import register_cli  # the CLI lives apart: registering it imports no torch
from pipeline.tools.replay_ranks import RecordedRanks, recorded_ranks

__all__ = [
    "Divergence",
    "RecordedEpoch",
    "RecordedTrial",
    "Recording",
    "RecordingExhausted",
    "ReplayBatch",
    "ReplayDriver",
    "ReplayError",
    "ReplayResult",
    "compare_traces",
    "load_recording",
    "normalize_event",
    "register_cli",
    "replay_losses",
    "replay_run",
]

# Metrics the engine collects before validation; everything else in an epoch's metrics is validation's.
_BEGIN_METRICS = ("lr",)
_TRAIN_METRICS = ("train_loss",)
_VAL_METRICS = ("val_loss",)
# What a trace comparison ignores: identity and wall-clock fields, and the run's setup (callbacks,
# config, strictness), which is the replay's input rather than something that happened.
_VOLATILE_KEYS = ("seq", "ts", "run_id", "prev")
_IGNORED_PAYLOAD: Mapping[str, tuple[str, ...]] = {
    "run_start": ("callbacks", "config", "strict", "seed", "resumed_from", "chain"),
    "callback_settings": ("settings",),  # configuration, like run_start's config: a what-if may change it
    "epoch": ("seconds", "phase_seconds", "callback_seconds"),
    "exception": ("traceback",),
}
# Events the engine and the run context write themselves; other kinds come from callbacks.
_CORE_EVENTS = frozenset({"run_start", "transition", "stop_request", "epoch", "warning", "exception", "result"})


class ReplayError(ValueError):
    """A recording or a callback set that cannot be replayed; the message says which and why."""


class RecordingExhausted(Exception):
    """The replay asked for an epoch the recording does not contain."""

    def __init__(self, epoch: int, recorded: int) -> None:
        super().__init__(f"the recording has {recorded} epochs; epoch {epoch_number(epoch)} is unknown")
        self.epoch = epoch
        self.recorded = recorded


# --- what a recording holds ---------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayBatch:
    """What a step-level callback sees as ``step.batch`` in a replay: the batch's position and the
    non-transition events the recording logged during it (only present in debug-level logs)."""

    epoch: int
    index: int
    events: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class RecordedEpoch:
    """One epoch's recorded values. ``partial`` marks an epoch the recorded run left mid-way
    (an immediate stop): its batches are known, its losses are not."""

    index: int
    metrics: Mapping[str, float]
    slots: Mapping[str, Any] = field(default_factory=dict)
    batches: int = 1
    batch_events: Mapping[int, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    partial: bool = False


@dataclass(frozen=True)
class TrialReport:
    epoch: int
    value: float
    should_prune: bool
    trial: int | None = None  # the Optuna trial number


class RecordedTrial:
    """Stands in for an ``optuna.trial.Trial`` in a replay: ``report`` is noted and
    ``should_prune`` answers with the decision the real pruner took at that epoch. Epochs the
    recording has no decision for are answered ``False`` and listed in ``unknown_steps``."""

    def __init__(self, reports: Mapping[int, TrialReport], number: int | None = None,
                 params: Mapping[str, Any] | None = None) -> None:
        self.reports = dict(reports)
        self.number = number if number is not None else -1
        self.params: dict[str, Any] = dict(params or {})
        self.user_attrs: dict[str, Any] = {}
        self.reported: dict[int, float] = {}
        self.unknown_steps: list[int] = []
        self._last_step: int | None = None

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value
        self._last_step = step

    def should_prune(self) -> bool:
        step = self._last_step
        if step is None:
            return False
        rec = self.reports.get(step)
        if rec is None:
            self.unknown_steps.append(step)
            return False
        return rec.should_prune

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

    @property
    def max_epochs(self) -> int:
        return int(self.run_start.get("max_epochs", len(self.epochs)))

    @property
    def config(self) -> Mapping[str, Any] | None:
        cfg = self.run_start.get("config")
        return cfg if isinstance(cfg, Mapping) else None

    @property
    def complete_epochs(self) -> int:
        return sum(1 for e in self.epochs if not e.partial)

    @property
    def stop_reason(self) -> StopReason | None:
        if self.result is None or "stop_reason" not in self.result:
            return None
        return StopReason(self.result["stop_reason"])

    @property
    def best_val_loss(self) -> float:
        vals = [e.metrics.get("val_loss", math.nan) for e in self.epochs if not e.partial]
        finite = [v for v in vals if math.isfinite(v)]
        return min(finite) if finite else math.inf


def load_recording(path: str | Path) -> Recording:
    """Parse a run's ``events.jsonl`` (or a run directory holding one) into a :class:`Recording`."""
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.is_file():
        raise ReplayError(f"no events log at {p}: expected a run's {EVENTS_FILE} or the run directory holding it")
    try:
        events = read_events(p)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{p} is not an events log: line {exc.lineno} is not JSON ({exc.msg})") from exc
    return recording_from_events(events, path=p)


def recording_from_events(events: list[dict[str, Any]], *, path: Path | None = None) -> Recording:
    where = str(path) if path is not None else "the events"
    starts = [i for i, e in enumerate(events) if e.get("event") == "run_start"]
    if not starts:
        raise ReplayError(f"{where} has no run_start event: not an fsmtrain events log")
    for i in starts[1:]:
        if not (events[i].get("payload") or {}).get("resumed_from"):
            raise ReplayError(f"{where} holds two runs (a second run_start at seq {events[i].get('seq')} that is "
                              "not a resume); replay needs the log of one run")
    start = events[starts[0]]
    segments = len(starts)
    original = events
    if segments > 1:
        events = _stitched(events, starts)
    epochs: list[RecordedEpoch] = []
    reports: dict[int, TrialReport] = {}
    result: Mapping[str, Any] | None = None
    step_events: dict[int, list[Mapping[str, Any]]] = {}
    step_at_epoch_start = 0
    last_step = 0
    ended_mid_epoch = False
    for e in events[starts[0] + 1:]:
        kind = e.get("event")
        payload: Mapping[str, Any] = e.get("payload") or {}
        gs = e.get("global_step")
        if isinstance(gs, int):
            last_step = gs
        if kind == "epoch":
            metrics = {str(k): as_float(v) for k, v in (payload.get("metrics") or {}).items()}
            batches = int(payload.get("batches", 0))
            first = step_at_epoch_start
            batch_events = {i: tuple(step_events.pop(first + i + 1, ())) for i in range(batches)}
            slots = {str(k): _number_or_value(v) for k, v in (payload.get("slots") or {}).items()}
            epochs.append(RecordedEpoch(len(epochs), metrics, slots, batches,
                                        {i: ev for i, ev in batch_events.items() if ev}))
            step_at_epoch_start = int(e.get("global_step") or first + batches)
            step_events.clear()
        elif kind == "trial_report":
            ep = int(payload["epoch"])
            reports[ep] = TrialReport(ep, as_float(payload.get("value")), bool(payload.get("should_prune")),
                                      payload.get("trial") if isinstance(payload.get("trial"), int) else None)
        elif kind == "result":
            result = payload
        elif kind == "transition" and e.get("to") == Phase.TRAIN_END.value:
            ended_mid_epoch = e.get("from") in (Phase.EPOCH_BEGIN.value, Phase.TRAIN_STEP.value, Phase.VAL.value)
        elif kind != "transition" and e.get("phase") == Phase.TRAIN_STEP.value and isinstance(gs, int):
            step_events.setdefault(gs, []).append(e)
    if segments > 1:
        last = [e for e in original[starts[-1]:]
                if e.get("event") == "transition" and e.get("to") == Phase.TRAIN_END.value]
        ended_mid_epoch = bool(last) and last[-1].get("from") in (
            Phase.EPOCH_BEGIN.value, Phase.TRAIN_STEP.value, Phase.VAL.value)
    interruption = _interruption(original[starts[-1]:])
    if ended_mid_epoch:
        # An immediate stop or a signal left this epoch mid-way: its batches are known, and what it had
        # measured when it was cut (the exception carries it), not the rest.
        cut = {str(k): as_float(v) for k, v in _cut_metrics(original[starts[-1]:]).items()}
        epochs.append(RecordedEpoch(len(epochs), cut, {}, last_step - step_at_epoch_start, partial=True))
    level = "debug" if any(e.get("level") == "debug" for e in events) else "info"
    run_start = dict(start.get("payload") or {})
    last_start = original[starts[-1]].get("payload") or {}
    for key in ("max_epochs", "config"):  # a resume may extend the run: its own budget counts
        if key in last_start:
            run_start[key] = last_start[key]
    return Recording(path, str(start.get("run_id") or "replay"), run_start, epochs, reports, events, level,
                     result, interruption, segments)


def _interruption(events: Sequence[Mapping[str, Any]]) -> Interruption | None:
    """The signal that ended the (last segment of the) run, if one did."""
    for e in events:
        payload = e.get("payload") or {}
        if e.get("event") == "exception" and payload.get("interrupt") and str(payload.get("source", "")).startswith(
                "signal "):
            words = str(payload["source"]).split()
            try:
                signum = int(signal.Signals[words[1]])
            except (KeyError, IndexError):
                return None
            rank = int(words[-1]) if len(words) == 5 and words[2:4] == ["on", "rank"] and words[-1].isdigit() else None
            return Interruption(signum, str(e.get("phase")), int(e.get("epoch") or 0), int(e.get("global_step") or 0),
                                rank)
    return None


def _cut_metrics(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """What the epoch a fault cut short had measured, from the fault's ``exception`` event."""
    for e in events:
        metrics = (e.get("payload") or {}).get("epoch_metrics") if e.get("event") == "exception" else None
        if isinstance(metrics, dict):
            return metrics
    return {}


_SEGMENT_ONLY = frozenset({"run_start", "resume", "transition"})


def _stitched(events: list[dict[str, Any]], starts: list[int]) -> list[dict[str, Any]]:
    """A resumed run's log as the uninterrupted run it continues: from each segment, what happened
    in the epochs the next segment did not redo; none of the per-process bookkeeping (run_start,
    resume, transitions, the teardown of a segment that was cut short)."""
    out: list[dict[str, Any]] = []
    bounds = [*starts, len(events)]
    for k in range(len(starts)):
        seg = events[bounds[k]:bounds[k + 1]]
        final = k == len(starts) - 1
        redo_from = None if final else int((events[bounds[k + 1]].get("payload") or {}).get("start_epoch", 0))
        for e in seg:
            if e.get("event") in _SEGMENT_ONLY:
                continue
            if k > 0 and e.get("phase") == Phase.TRAIN_BEGIN.value:
                continue  # a resumed process sets itself up again
            epoch = e.get("epoch")
            if redo_from is not None and (not isinstance(epoch, int) or epoch >= redo_from
                                          or e.get("phase") == Phase.TRAIN_END.value):
                continue
            out.append(e)
    return out


def _number_or_value(value: Any) -> Any:
    """Undo :func:`pipeline.core.events.jsonable`'s spelling of non-finite floats."""
    return as_float(value) if value in ("NaN", "Infinity", "-Infinity") else value


# --- the driver ---------------------------------------------------------------------------------
class ReplayDriver(BaseDriver):
    """Feeds recorded epochs to the engine in place of training.

    ``fed_slots`` are the slots whose recorded values are put back each epoch because no callback
    of the replay computes them (their writers need a live model, or are absent)."""

    def __init__(self, run: RunContext, epochs: Sequence[RecordedEpoch], fed_slots: Mapping[str, Slot[Any]],
                 interrupt: Interruption | None = None) -> None:
        self.run = run
        self.epochs = list(epochs)
        self.fed_slots = dict(fed_slots)
        self.interrupt = interrupt

    def _signal_in(self, phase: Phase, epoch: int) -> None:
        """Deliver a recorded signal where it arrived, so the guards end the replay at the same move."""
        i = self.interrupt
        if i is None or i.phase != phase.value or i.epoch != epoch:
            return
        if phase is Phase.TRAIN_STEP and self.run.global_step + 1 != i.global_step:
            return
        self.run.pending_signal = i.signum

    def forward(self, step: StepContext) -> None:
        self._signal_in(Phase.TRAIN_STEP, step.epoch.index)

    def _recorded(self, index: int, *, need: tuple[str, ...] = ()) -> RecordedEpoch:
        """Epoch ``index``; ``need``: metrics it must hold if the recorded run cut it short."""
        rec = self.epochs[index] if index < len(self.epochs) else None
        if rec is None or (need and rec.partial and not any(k in rec.metrics for k in need)):
            raise RecordingExhausted(index, sum(1 for e in self.epochs if not e.partial))
        return rec

    def current_lr(self) -> float | None:
        # A cut epoch's lr is known only if its exception carried it: else None, as for no optimizer.
        return self._recorded(self.run.epoch).metrics.get("lr")

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        self._signal_in(Phase.EPOCH_BEGIN, epoch.index)
        rec = self._recorded(epoch.index)
        return (ReplayBatch(epoch.index, i, rec.batch_events.get(i, ())) for i in range(rec.batches))

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        rec = self._recorded(epoch.index, need=_TRAIN_METRICS)
        return {k: v for k, v in rec.metrics.items() if k in _TRAIN_METRICS}

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        self._signal_in(Phase.VAL, epoch.index)
        rec = self._recorded(epoch.index, need=_VAL_METRICS)
        return {k: v for k, v in rec.metrics.items() if k not in _BEGIN_METRICS and k not in _TRAIN_METRICS}

    def step_scheduler(self, epoch: EpochContext) -> None:
        # Runs right before on_epoch_end, where the built-in writers of model-derived slots write.
        # the engine acts on a signal after epoch_end's handlers, when the epoch counter has moved on
        self._signal_in(Phase.EPOCH_END, epoch.index + 1)
        if not self.fed_slots:
            return
        slots = self._recorded(epoch.index).slots
        for name, slot in self.fed_slots.items():
            if name in slots:
                self.run.set(slot, slots[name])



class _AttributingSink:
    """Keeps every event in memory and, for each, the callback that emitted it (None: the engine)."""

    def __init__(self, log: EventLog, runner_ref: list[CallbackRunner]) -> None:
        self.log = log
        self.owners: list[TrainingCallback | None] = []
        self._runner_ref = runner_ref

    def emit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        records = self.log.records
        assert records is not None
        before = len(records)
        self.log.emit(event, level=level, **fields)
        if len(records) > before:
            self.owners.append(self._runner_ref[0].current if self._runner_ref else None)

    def enabled_for(self, level: str) -> bool:
        return self.log.enabled_for(level)


# --- results ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Divergence:
    """The first event where two traces differ. ``expected``/``found`` are the normalized events
    (``None`` when that trace has already ended); ``seq`` is the recorded line's own ``seq``."""

    index: int
    expected: Mapping[str, Any] | None
    found: Mapping[str, Any] | None
    seq: int | None = None

    def describe(self) -> str:
        def show(e: Mapping[str, Any] | None) -> str:
            return "end of trace" if e is None else json.dumps(e, sort_keys=True)

        at = f"event #{self.index}" + (f" (seq {self.seq})" if self.seq is not None else "")
        return f"first difference at {at}:\n  expected: {show(self.expected)}\n  found:    {show(self.found)}"


@dataclass
class ReplayResult:
    """What a replay did. ``stop_reason`` and ``stop_epoch`` are ``None`` when the replay outlived
    its data (``exhausted_after`` epochs) without stopping: what it would have done is unknown."""

    trace: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_epoch: int | None
    history: list[EpochRecord]
    result: TrainResult | None
    exhausted_after: int | None = None
    divergence: Divergence | None = None
    dry_events: list[dict[str, Any]] = field(default_factory=list)
    recorded_epochs: int | None = None
    recorded_stop_reason: StopReason | None = None
    recorded_best_val_loss: float | None = None
    overrides: tuple[str, ...] = ()
    unknown_prune_steps: tuple[int, ...] = ()
    error: Exception | None = None  # what a replayed callback raised (the run then ends with ERROR)

    @property
    def slots(self) -> list[dict[str, Any]]:
        """Slot values at the end of each replayed epoch."""
        return [dict(r.slots) for r in self.history]

    @property
    def epochs_completed(self) -> int:
        return len(self.history)

    @property
    def best_val_loss(self) -> float:
        finite = [r.val_loss for r in self.history if math.isfinite(r.val_loss)]
        return min(finite) if finite else math.inf

    @property
    def stopped_by(self) -> str | None:
        return self.result.stop.source if self.result is not None and self.result.stop is not None else None

    @property
    def matches(self) -> bool:
        return self.divergence is None

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.trace if e["event"] == kind]

    def warnings(self, source: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events("warning") if source is None or e["payload"].get("source") == source]

    def what_if(self) -> str:
        """One sentence: what this replay says the run would have done."""
        setting = _describe_overrides(self.overrides)
        prefix = f"with {setting} this run" if setting else "this run"
        if self.stop_reason is None:
            return (f"{prefix} would not have stopped within the {self.exhausted_after} recorded epochs; "
                    f"its stop reason is unknown beyond epoch {self.exhausted_after}, where the recording ends")
        assert self.stop_epoch is not None
        sentence = f"{prefix} would have stopped at epoch {self.stop_epoch} with {self.stop_reason.name}"
        if self.recorded_epochs is not None:
            delta = self.recorded_epochs - self.stop_epoch
            if delta > 0:
                sentence += f", saving {delta} epoch{'s' if delta != 1 else ''}"
            elif delta < 0:
                sentence += f", running {-delta} more epoch{'s' if delta != -1 else ''}"
            else:
                sentence += ", the same number of epochs as recorded"
            if self.recorded_stop_reason is not None:
                sentence += f" (recorded: {self.recorded_epochs} epochs, {self.recorded_stop_reason.name})"
        return sentence

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "overrides": list(self.overrides),
            "stop_reason": self.stop_reason.value if self.stop_reason else None,
            "stop_epoch": self.stop_epoch,
            "stopped_by": self.stopped_by,
            "exhausted_after": self.exhausted_after,
            "epochs_completed": self.epochs_completed,
            "best_val_loss": self.best_val_loss,
            "recorded_epochs": self.recorded_epochs,
            "recorded_stop_reason": self.recorded_stop_reason.value if self.recorded_stop_reason else None,
            "recorded_best_val_loss": self.recorded_best_val_loss,
            "matches_recording": self.matches,
            "divergence": None if self.divergence is None else {
                "index": self.divergence.index, "seq": self.divergence.seq,
                "expected": self.divergence.expected, "found": self.divergence.found,
            },
            "what_if": self.what_if(),
            "slots": self.slots,
            "unknown_prune_steps": list(self.unknown_prune_steps),
        }
        return dict(jsonable(out))


def _describe_overrides(overrides: Sequence[str]) -> str:
    parts = []
    for ov in overrides:
        key, _, value = ov.partition("=")
        parts.append(f"{key.rsplit('.', 1)[-1].replace('_', ' ')} {value}")
    return ", ".join(parts)


# --- trace comparison ---------------------------------------------------------------------------
def normalize_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """An event without what legitimately differs between two runs of the same decisions."""
    out = {k: v for k, v in event.items() if k not in _VOLATILE_KEYS}
    ignored = _IGNORED_PAYLOAD.get(str(event.get("event")), ())
    payload = event.get("payload")
    if ignored and isinstance(payload, Mapping):
        out["payload"] = {k: v for k, v in payload.items() if k not in ignored}
    return out


def compare_traces(expected: Sequence[Mapping[str, Any]], found: Sequence[Mapping[str, Any]]) -> Divergence | None:
    """The first index where the normalized traces differ, or ``None`` when they are the same."""
    for i in range(max(len(expected), len(found))):
        exp = normalize_event(expected[i]) if i < len(expected) else None
        got = normalize_event(found[i]) if i < len(found) else None
        if exp != got:
            seq = expected[i].get("seq") if i < len(expected) else None
            return Divergence(i, exp, got, seq if isinstance(seq, int) else None)
    return None


def _comparable_recorded(events: Sequence[Mapping[str, Any]], dry: Sequence[TrainingCallback],
                         emitted_kinds: set[str]) -> list[Mapping[str, Any]]:
    """The recorded events a replay can reproduce: the engine's, and the kinds the replayed
    (non-dry) callbacks write; not those of dry callbacks (found by the source they name), nor
    callback event kinds nothing in the replay writes (a dry callback's side effects)."""
    dry_names = {cb.name for cb in dry}
    keep = []
    for e in events:
        kind = str(e.get("event"))
        payload = e.get("payload") or {}
        if isinstance(payload, Mapping) and payload.get("source") in dry_names:
            continue
        if kind in _CORE_EVENTS or kind in emitted_kinds:
            keep.append(e)
    return keep


# --- running a replay ---------------------------------------------------------------------------
def check_replayable(callbacks: Sequence[TrainingCallback]) -> None:
    refused = [cb for cb in callbacks if ReplaySupport(cb.replay) is ReplaySupport.NONE]
    if refused:
        names = ", ".join(f"{cb.name} (priority {cb.priority})" for cb in refused)
        raise ReplayError(
            f"cannot replay {names}: replay = ReplaySupport.NONE; leave it out of the replay's callbacks "
            "or give it replay = ReplaySupport.FULL (it decides from contexts and slots alone) or "
            "ReplaySupport.DRY (it needs a live model and only records intent when run.dry_run is set)"
        )


@dataclass
class _Outcome:
    run: RunContext
    trace: list[dict[str, Any]]
    owners: list[TrainingCallback | None]
    result: TrainResult | None
    exhausted: RecordingExhausted | None
    dry: tuple[TrainingCallback, ...]
    error: Exception | None = None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the engine replays. A replay's only lasting
    allocations are its trace (hundreds of thousands of small dicts, acyclic) and an epoch makes no
    cyclic garbage, so the collector's full passes over the growing trace find nothing; they were a
    tenth of a 10,000-epoch replay. Reference counting still frees everything as usual; the
    collector's state is restored on the way out, whatever happens."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _execute(epochs: Sequence[RecordedEpoch], callbacks: Sequence[TrainingCallback], *, max_epochs: int,
             run_id: str, level: str, extras: Mapping[str, Any], strict: bool | None,
             interrupt: Interruption | None = None, ranks: RecordedRanks | None = None) -> _Outcome:
    ref: list[CallbackRunner] = []
    log = EventLog(None, run_id, level=level, console=None, keep=True)
    sink = _AttributingSink(log, ref)
    if ranks is not None and ranks.rank > 0:  # as the Trainer does on that rank
        callbacks = [cb for cb in callbacks if not cb.rank_zero_only]
    runner = CallbackRunner(callbacks)
    ref.append(runner)
    check_replayable(runner.callbacks)
    full = [cb for cb in runner.callbacks if ReplaySupport(cb.replay) is ReplaySupport.FULL]
    dry = tuple(cb for cb in runner.callbacks if ReplaySupport(cb.replay) is ReplaySupport.DRY)
    computed = {s.name for cb in full for s in cb.writes}
    fed: dict[str, Slot[Any]] = {}
    for e in epochs:
        for name in e.slots:
            if name not in computed and name not in fed:
                declared = [s for cb in dry for s in cb.writes if s.name == name]
                fed[name] = declared[0] if declared else Slot(name)
    run = RunContext(run_id, max_epochs, sink, model=None, optimizer=None, run_dir=None, dry_run=True)
    run.extras.update(extras)
    if ranks is not None:
        ranks.run = run
        run.extras.update(rank=ranks.rank, world_size=ranks.world_size)
    driver = ReplayDriver(run, epochs, fed, interrupt)
    engine = Engine(driver, runner, run, strict=strict, collective=ranks)
    exhausted: RecordingExhausted | None = None
    error: Exception | None = None
    try:
        with _collector_paused():
            engine.execute()
    except RecordingExhausted as exc:
        exhausted = exc
    except Interrupted:
        pass  # the recorded signal, delivered again: the run ended INTERRUPTED as it did
    except Exception as exc:  # a replayed callback failed: the engine logged it and ended the run (ERROR)
        if engine.result is None:
            raise
        error = exc
    assert log.records is not None
    return _Outcome(run, log.records, sink.owners, engine.result, exhausted, dry, error)


def _to_result(out: _Outcome, *, recorded: Recording | None, overrides: Sequence[str],
               compare: bool, trial: RecordedTrial | None) -> ReplayResult:
    dry_ids = {id(cb) for cb in out.dry}
    trace = [e for e, o in zip(out.trace, out.owners, strict=True) if o is None or id(o) not in dry_ids]
    dry_events = [e for e, o in zip(out.trace, out.owners, strict=True) if o is not None and id(o) in dry_ids]
    exhausted_after = out.exhausted.recorded if out.exhausted is not None else None
    res = out.result
    stop_reason = None if out.exhausted is not None or res is None else res.stop_reason
    stop_epoch = None if stop_reason is None or res is None else res.epochs_completed
    replay = ReplayResult(trace, stop_reason, stop_epoch, list(out.run.history), res, exhausted_after,
                          dry_events=dry_events, overrides=tuple(overrides), error=out.error,
                          unknown_prune_steps=tuple(trial.unknown_steps) if trial else ())
    if recorded is not None:
        replay.recorded_epochs = recorded.complete_epochs
        replay.recorded_stop_reason = recorded.stop_reason
        replay.recorded_best_val_loss = recorded.best_val_loss
        if compare:
            if recorded.segments > 1:  # the recording was stitched: compare what is not per process
                trace = [e for e in trace if e.get("event") not in _SEGMENT_ONLY]
            kinds = {str(e["event"]) for e in trace}
            replay.divergence = compare_traces(_comparable_recorded(recorded.events, out.dry, kinds), trace)
    return replay


def replay_run(events_path: str | Path, callbacks: Sequence[TrainingCallback] | None = None,
               overrides: Sequence[str] | None = None, *, strict: bool | None = None) -> ReplayResult:
    """Replay a recorded run from its ``events.jsonl`` (or run directory).

    Without ``callbacks`` the run's callbacks are rebuilt from the resolved config recorded in its
    ``run_start`` event, with ``overrides`` (``"early_stopping.patience=5"``) applied; pruning
    re-plays the recorded ``trial_report`` decisions. ``result.divergence`` names the first event
    where the replay departs from the recording (``None``: it reproduces it).
    """
    rec = load_recording(events_path)
    overrides = tuple(overrides or ())
    trial = None
    if rec.trial_reports:
        numbers = {r.trial for r in rec.trial_reports.values() if r.trial is not None}
        trial = RecordedTrial(rec.trial_reports, number=numbers.pop() if len(numbers) == 1 else None)
    max_epochs = rec.max_epochs
    if callbacks is None or overrides:
        cfg_data = rec.config
        if cfg_data is None:
            raise ReplayError(
                f"{rec.path}: its run_start event records no config, so the run's callbacks and settings "
                "cannot be rebuilt; pass callbacks=[...] (and no overrides) to replay it"
            )
        from pipeline.app import config as config_mod

        cfg = config_mod.config_from_dict(config_mod.apply_overrides(dict(cfg_data), overrides))
        if callbacks is None:
            # RecordedTrial answers the two calls PrunerCallback makes on an optuna Trial.
            callbacks = config_mod.build_callbacks(cfg, run_dir=None, trial=cast(Any, trial))
        max_epochs = _config_max_epochs(cfg, max_epochs)
    extras: dict[str, Any] = {k: rec.run_start[k] for k in ("config", "seed", "hpo") if k in rec.run_start}
    if trial is not None:
        extras["trial"] = trial
    # One rank of a multi-process run: the other ranks' part in the agreements, as its log recorded it.
    ranks = recorded_ranks(rec.run_start, rec.events)
    interrupt = rec.interrupt
    if ranks is not None and interrupt is not None and interrupt.rank not in (None, ranks.rank):
        interrupt = None  # sent to another rank: it comes back through the agreement
    out = _execute(rec.epochs, callbacks, max_epochs=max_epochs, run_id=rec.run_id, level=rec.level,
                   extras=extras, strict=strict, interrupt=interrupt, ranks=ranks)
    return _to_result(out, recorded=rec, overrides=overrides, compare=True, trial=trial)


def _config_max_epochs(cfg: Any, default: int) -> int:
    """The epoch budget of a (possibly overridden) config, wherever the config keeps it."""
    for path in (("max_epochs",), ("epochs",), ("training", "max_epochs"), ("training", "epochs"),
                 ("trainer", "max_epochs"), ("train", "max_epochs")):
        value: Any = cfg
        for part in path:
            value = getattr(value, part, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _series(name: str, values: Sequence[float] | None, n: int) -> list[float] | None:
    if values is None:
        return None
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ReplayError(f"{name}[{i}] must be a number, got {type(v).__name__} {v!r}")
        out.append(float(v))
    if len(out) != n:
        raise ReplayError(f"{name} has {len(out)} values but train has {n}; give one value per epoch")
    return out


def replay_losses(train: Sequence[float], val: Sequence[float] | None = None,
                  callbacks: Sequence[TrainingCallback] = (), max_epochs: int | None = None, *,
                  metrics: Mapping[str, Sequence[float]] | None = None, lrs: Sequence[float] | None = None,
                  slots: Mapping[str, Sequence[Any]] | None = None, batches: int = 1,
                  strict: bool | None = None) -> ReplayResult:
    """Drive ``callbacks`` through the real machine with the given per-epoch values, no model.

    ``train``/``val`` are per-epoch losses (``float("nan")`` allowed), ``metrics`` further per-epoch
    validation metrics, ``lrs`` the learning rate per epoch, ``slots`` per-epoch values for slots no
    given callback computes (e.g. ``{"max_grad_norm": [...]}``). ``max_epochs`` defaults to the
    number of values; a larger budget the callbacks do not stop within ends as "unknown".
    """
    n = len(train)
    train_v = _series("train", train, n) or []
    val_v = _series("val", val, n) if val is not None else None
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise ReplayError(f"batches must be an integer >= 0, got {batches!r}")
    if max_epochs is None:
        max_epochs = n
    if isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 0:
        raise ReplayError(f"max_epochs must be an integer >= 0, got {max_epochs!r}")
    columns: dict[str, list[float]] = {}
    if lrs is not None:
        columns["lr"] = _series("lrs", lrs, n) or []
    columns["train_loss"] = train_v
    if val_v is not None:
        columns["val_loss"] = val_v
    for name, series in (metrics or {}).items():
        columns[name] = _series(f"metrics[{name!r}]", series, n) or []
    slot_cols = {name: list(vs) for name, vs in (slots or {}).items()}
    for name, vs in slot_cols.items():
        if len(vs) != n:
            raise ReplayError(f"slots[{name!r}] has {len(vs)} values but train has {n}; give one value per epoch")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, TrainingCallback):
            raise ReplayError(f"callbacks[{i}] must be a TrainingCallback, got {type(cb).__name__}")
    epochs = [
        RecordedEpoch(i, {k: col[i] for k, col in columns.items()},
                      {k: col[i] for k, col in slot_cols.items() if col[i] is not None}, batches)
        for i in range(n)
    ]
    out = _execute(epochs, callbacks, max_epochs=max_epochs, run_id="replay", level="info", extras={},
                   strict=strict)
    return _to_result(out, recorded=None, overrides=(), compare=False, trial=None)
