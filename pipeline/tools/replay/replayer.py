"""Replay: recorded numbers (a run's log, :func:`replay_run`, or lists, :func:`replay_losses`) fed to the
real engine, machine and callbacks, each taking part as its ``replay`` (``FULL``, ``DRY``, ``NONE``) says."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from fsmtrain.core.consensus import RankFailed
from fsmtrain.core.context import EpochContext, RunContext, Slot, StepContext, epoch_number
from fsmtrain.core.driver import BaseDriver
from fsmtrain.core.engine import Engine, Interrupted
from fsmtrain.core.events import EventLog
from fsmtrain.core.hooks import ReplaySupport, TrainingCallback
from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.tools.replay.recording import (
    SEGMENT_ONLY,
    Interruption,
    RecordedEpoch,
    RecordedRanks,
    RecordedTrial,
    Recording,
    ReplayBatch,
    ReplayError,
    load_recording,
    recorded_ranks,
)
from fsmtrain.tools.replay.result import ReplayResult, comparable_recorded, compare_traces

__all__ = ["RecordingExhausted", "ReplayDriver", "check_replayable", "replay_losses", "replay_run"]

# Metrics the engine collects before validation; everything else in an epoch's metrics is validation's.
_BEFORE_VALIDATION = ("lr", "train_loss")


class RecordingExhausted(Exception):
    """The replay asked for an epoch the recording does not contain."""

    def __init__(self, epoch: int, recorded: int, why: str | None = None) -> None:
        super().__init__(why or f"the recording has {recorded} epochs; epoch {epoch_number(epoch)} is unknown")
        self.recorded = recorded
        self.why = why  # what else the replay needed and the recording lacks


class ReplayDriver(BaseDriver):
    """Feeds recorded epochs to the engine in place of training; ``fed_slots``: the slots whose recorded
    values are put back each epoch because no callback of the replay computes them."""

    def __init__(self, run: RunContext, epochs: Sequence[RecordedEpoch], fed_slots: Mapping[str, Slot[Any]],
                 interrupt: Interruption | None = None, ranks: RecordedRanks | None = None,
                 validations: Mapping[int, Mapping[str, float]] | None = None) -> None:
        self.run, self.epochs, self.fed_slots, self.interrupt, self.ranks = run, epochs, fed_slots, interrupt, ranks
        self.validations = validations or {}  # inside epochs, by global step
        self.complete = sum(1 for e in epochs if not e.partial)
        self._epoch_end = 0  # the global step at which the epoch in progress ends

    def _signal_in(self, phase: Phase, epoch: int) -> None:
        """Deliver a recorded signal where it arrived, so the replay ends at the same move."""
        i = self.interrupt
        if i is not None and (i.phase, i.epoch) == (phase.value, epoch) and (
                phase is not Phase.TRAIN_STEP or self.run.global_step + 1 == i.global_step):
            self.run.pending_signal = i.signum

    def _broken_in(self, phase: Phase, epoch: int) -> None:
        """Raise the collective's error a rank met where another rank's failure broke it."""
        symptom = self.ranks.symptom_at(phase, epoch) if self.ranks is not None else None
        if symptom is not None:
            raise RuntimeError(symptom.partition(": ")[2] or symptom)

    def forward(self, step: StepContext) -> None:
        rec = self.epochs[step.epoch.index]
        if rec.cut and step.batch_index >= rec.batches:  # a what-if trains on past where the run cut the epoch
            raise RecordingExhausted(step.epoch.index, self.complete, f"the recorded run stopped epoch "
                                     f"{step.epoch.number} after its batch {rec.batches}; what followed is unknown")
        self._broken_in(Phase.TRAIN_STEP, step.epoch.index)
        self._signal_in(Phase.TRAIN_STEP, step.epoch.index)

    def _recorded(self, index: int, need: str = "") -> RecordedEpoch:
        """Epoch ``index``; ``need``: a metric it must hold if the recorded run cut it short."""
        rec = self.epochs[index] if index < len(self.epochs) else None
        if rec is None or (need and rec.partial and need not in rec.metrics):
            raise RecordingExhausted(index, self.complete)
        return rec

    def current_lr(self) -> float | None:
        # A cut epoch's lr is known only if its exception carried it: else None, as for no optimizer.
        return self._recorded(self.run.epoch).metrics.get("lr")

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        self._signal_in(Phase.EPOCH_BEGIN, epoch.index)
        rec = self._recorded(epoch.index)
        # A batch cut short by another rank's failure is no recorded batch; the replay goes into it again.
        cut = self.ranks is not None and self.ranks.breaks_in(Phase.TRAIN_STEP, epoch.index)
        self._epoch_end = self.run.global_step + rec.batches
        # rec.cut: the epoch had batches left where a stop cut it: so has the replay's
        return (ReplayBatch(epoch.index, i) for i in range(rec.batches + cut + rec.cut))

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        return {k: v for k, v in self._recorded(epoch.index, "train_loss").metrics.items() if k == "train_loss"}

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        self._broken_in(Phase.VAL, epoch.index)
        self._signal_in(Phase.VAL, epoch.index)
        step, steps = self.run.global_step, self.run.max_steps
        if step < self._epoch_end and (steps is None or step < steps):  # a validation inside the epoch
            if step not in self.validations:
                raise RecordingExhausted(epoch.index, self.complete, f"the recording has no validation at global "
                                         f"step {step} (epoch {epoch.number}); a what-if on val_every_n_steps can "
                                         "validate only where the run did")
            return dict(self.validations[step])
        rec = self._recorded(epoch.index, "val_loss")
        return {k: v for k, v in rec.metrics.items() if k not in _BEFORE_VALIDATION}

    def step_scheduler(self, epoch: EpochContext) -> None:
        # Runs just before on_epoch_end, where model-derived slots are written; the engine acts on a
        # signal after epoch_end's handlers, when the epoch counter has moved on.
        self._signal_in(Phase.EPOCH_END, epoch.index + 1)
        slots = self._recorded(epoch.index).slots if self.fed_slots else {}
        for name, slot in self.fed_slots.items():
            if name in slots:
                self.run.set(slot, slots[name])


class _AttributingLog(EventLog):
    """An in-memory event log that keeps, for each event, the callback that emitted it (None: the engine)."""

    def __init__(self, run_id: str, level: str, runner: CallbackRunner) -> None:
        super().__init__(None, run_id, level=level, console=None, keep=True)
        self.owners: list[TrainingCallback | None] = []
        self._runner = runner

    def emit(self, event: str, **fields: Any) -> bool:
        assert self.records is not None
        before = len(self.records)
        sync_owed = super().emit(event, **fields)
        if len(self.records) > before:
            self.owners.append(self._runner.current)
        return sync_owed


def check_replayable(callbacks: Sequence[TrainingCallback]) -> None:
    """Refuse, by name, the callbacks whose ``replay`` is ``ReplaySupport.NONE``."""
    refused = [cb for cb in callbacks if ReplaySupport(cb.replay) is ReplaySupport.NONE]
    if refused:
        names = ", ".join(f"{cb.name} (priority {cb.priority})" for cb in refused)
        raise ReplayError(f"cannot replay {names}: replay = ReplaySupport.NONE; leave it out of the replay's "
                          "callbacks or give it replay = ReplaySupport.FULL (it decides from contexts and slots "
                          "alone) or ReplaySupport.DRY (it needs a live model and only records intent when "
                          "run.dry_run is set)")


def _execute(epochs: Sequence[RecordedEpoch], callbacks: Sequence[TrainingCallback], *, max_epochs: int,
             max_steps: int | None = None, val_every_n_steps: int | None = None, run_id: str, level: str,
             extras: Mapping[str, Any], strict: bool | None, interrupt: Interruption | None = None,
             ranks: RecordedRanks | None = None, recorded: Recording | None = None, overrides: Sequence[str] = (),
             trial: RecordedTrial | None = None) -> ReplayResult:
    """Run the engine on ``epochs``; with ``recorded``, compare the trace with the recording's."""
    if ranks is not None and ranks.rank > 0:  # as the Trainer does on that rank
        callbacks = [cb for cb in callbacks if not cb.rank_zero_only]
    runner = CallbackRunner(callbacks)
    log = _AttributingLog(run_id, level, runner)
    check_replayable(runner.callbacks)
    full = [cb for cb in runner.callbacks if ReplaySupport(cb.replay) is ReplaySupport.FULL]
    dry = tuple(cb for cb in runner.callbacks if ReplaySupport(cb.replay) is ReplaySupport.DRY)
    computed = {s.name for cb in full for s in cb.writes}
    declared = {s.name: s for cb in reversed(dry) for s in reversed(cb.writes)}  # the first declaration wins
    fed = {name: declared.get(name) or Slot(name) for e in epochs for name in e.slots if name not in computed}
    run = RunContext(run_id, max_epochs, log, model=None, optimizer=None, run_dir=None, dry_run=True,
                     max_steps=max_steps, val_every_n_steps=val_every_n_steps)
    run.extras.update(extras)
    if ranks is not None:
        ranks.run = run
        run.extras.update(rank=ranks.rank, world_size=ranks.world_size)
    driver = ReplayDriver(run, epochs, fed, interrupt, ranks, recorded.validations if recorded else None)
    engine = Engine(driver, runner, run, strict=strict, collective=ranks)
    exhausted: RecordingExhausted | None = None
    error: Exception | None = None
    collecting = gc.isenabled()
    gc.disable()  # a replay keeps only its acyclic trace: the collector's passes over it find nothing
    try:
        engine.execute()
    except RecordingExhausted as exc:
        exhausted = exc
    except (Interrupted, RankFailed):
        pass  # the recorded signal, or another rank's failure, delivered again: the run ended as it did
    except Exception as exc:  # a replayed callback failed: the engine logged it and ended the run (ERROR)
        if engine.result is None:
            raise
        error = exc
    finally:
        if collecting:
            gc.enable()
    assert log.records is not None
    dry_ids = {id(cb) for cb in dry}
    owned = list(zip(log.records, log.owners, strict=True))
    trace = [e for e, o in owned if o is None or id(o) not in dry_ids]
    res = engine.result
    stop_reason = None if exhausted is not None or res is None else res.stop_reason
    replay = ReplayResult(trace, stop_reason, None if stop_reason is None or res is None else res.epochs_completed,
                          list(run.history), res, exhausted.recorded if exhausted is not None else None,
                          dry_events=[e for e, o in owned if o is not None and id(o) in dry_ids],
                          overrides=tuple(overrides), error=error, unknown_why=exhausted.why if exhausted else None,
                          unknown_prune_steps=tuple(trial.unknown_steps) if trial else ())
    if recorded is not None:
        replay.recorded_epochs = recorded.complete_epochs
        replay.recorded_stop_reason = recorded.stop_reason
        replay.recorded_best_val_loss = recorded.best_val_loss
        if recorded.segments > 1:  # the recording was stitched: compare what is not per process
            trace = [e for e in trace if e.get("event") not in SEGMENT_ONLY]
        kinds = {str(e["event"]) for e in trace}
        replay.divergence = compare_traces(comparable_recorded(recorded.events, dry, kinds), trace)
    return replay


def replay_run(events_path: str | Path, callbacks: Sequence[TrainingCallback] | None = None,
               overrides: Sequence[str] | None = None, *, strict: bool | None = None) -> ReplayResult:
    """Replay a recorded run from its ``events.jsonl`` (or run directory). Without ``callbacks`` they are
    rebuilt from the config its ``run_start`` recorded, with ``overrides`` (``"early_stopping.patience=5"``)
    applied; pruning re-plays the recorded decisions. ``result.divergence``: the first event that departs."""
    rec = load_recording(events_path)
    overrides = tuple(overrides or ())
    trial = None
    if rec.trial_reports:
        numbers = {r.trial for r in rec.trial_reports.values() if r.trial is not None}
        trial = RecordedTrial(rec.trial_reports, number=numbers.pop() if len(numbers) == 1 else -1)
    start = rec.run_start
    max_epochs = int(start.get("max_epochs", len(rec.epochs)))
    max_steps, every = (n if type(n := start.get(k)) is int else None for k in ("max_steps", "val_every_n_steps"))
    if callbacks is None or overrides:
        if rec.config is None:
            raise ReplayError(f"{rec.path}: its run_start event records no config, so the run's callbacks and "
                              "settings cannot be rebuilt; pass callbacks=[...] (and no overrides) to replay it")
        from fsmtrain.app import config as config_mod
        from fsmtrain.app.config import world
        from fsmtrain.app.config.schema import TRAINING_FIELDS

        for item in overrides:
            key = item.partition("=")[0].strip()
            if key.split(".")[0] in TRAINING_FIELDS:
                raise ReplayError(
                    f"--set {item}: a replay re-runs the callbacks on the losses this run recorded, so it cannot "
                    f"tell what another {key} would have done to them; a what-if may change the callbacks' "
                    "settings (early_stopping, checkpoint, callbacks, epochs...), not training itself")
        folders = start.get(world.RECORDED_FOLDERS)
        cfg = world.load_recorded_config(rec.config, folders if isinstance(folders, list) else [], overrides,
                                         f"recorded in {rec.path}")
        if callbacks is None:
            # RecordedTrial answers the two calls PrunerCallback makes on an optuna Trial.
            callbacks = config_mod.build_callbacks(cfg, run_dir=None, trial=cast(Any, trial))
        max_epochs, max_steps, every = cfg.max_epochs, cfg.max_steps, cfg.val_every_n_steps
    extras: dict[str, Any] = {k: start[k] for k in ("config", "seed", "hpo") if k in start}
    if trial is not None:
        extras["trial"] = trial
    # One rank of a multi-process run: the other ranks' part in the agreements, as its log recorded it.
    ranks = recorded_ranks(start, rec.events)
    interrupt = rec.interrupt
    if ranks is not None and interrupt is not None and interrupt.rank not in (None, ranks.rank):
        interrupt = None  # sent to another rank: it comes back through the agreement
    return _execute(rec.epochs, callbacks, max_epochs=max_epochs, max_steps=max_steps, val_every_n_steps=every,
                    run_id=rec.run_id, level=rec.level, extras=extras, strict=strict, interrupt=interrupt,
                    ranks=ranks, recorded=rec, overrides=overrides, trial=trial)


def _series(name: str, values: Sequence[Any], n: int, numbers: bool = True) -> list[Any]:
    """``values``, one per epoch (as floats, when ``numbers``), else a ReplayError naming ``name``."""
    for i, v in enumerate(values):
        if numbers and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ReplayError(f"{name}[{i}] must be a number, got {type(v).__name__} {v!r}")
    out = [float(v) for v in values] if numbers else list(values)
    if len(out) != n:
        raise ReplayError(f"{name} has {len(out)} values but train has {n}; give one value per epoch")
    return out


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReplayError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def replay_losses(train: Sequence[float], val: Sequence[float] | None = None,
                  callbacks: Sequence[TrainingCallback] = (), max_epochs: int | None = None, *,
                  metrics: Mapping[str, Sequence[float]] | None = None, lrs: Sequence[float] | None = None,
                  slots: Mapping[str, Sequence[Any]] | None = None, batches: int = 1,
                  strict: bool | None = None) -> ReplayResult:
    """Drive ``callbacks`` through the real machine with per-epoch values, no model: ``train``/``val``
    losses (``float("nan")`` allowed), further validation ``metrics``, ``lrs``, and ``slots`` no given
    callback computes (``{"max_grad_norm": [...]}``). ``max_epochs`` defaults to the number of values; a
    larger budget the callbacks do not stop within ends as "unknown"."""
    n = len(train)
    columns = {"train_loss": _series("train", train, n)}
    if val is not None:
        columns["val_loss"] = _series("val", val, n)
    _count("batches", batches)
    max_epochs = _count("max_epochs", n if max_epochs is None else max_epochs)
    if lrs is not None:
        columns = {"lr": _series("lrs", lrs, n), **columns}
    columns.update({name: _series(f"metrics[{name!r}]", series, n) for name, series in (metrics or {}).items()})
    slot_cols = {name: _series(f"slots[{name!r}]", vs, n, numbers=False) for name, vs in (slots or {}).items()}
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, TrainingCallback):
            raise ReplayError(f"callbacks[{i}] must be a TrainingCallback, got {type(cb).__name__}")
    epochs = [RecordedEpoch(i, {k: col[i] for k, col in columns.items()},
                            {k: col[i] for k, col in slot_cols.items() if col[i] is not None}, batches)
              for i in range(n)]
    return _execute(epochs, callbacks, max_epochs=max_epochs, run_id="replay", level="info", extras={},
                    strict=strict)
