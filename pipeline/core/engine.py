"""The engine offers the lifecycle machine the triggers leaving its state; the live guards decide which
fires, and each move is checked against the table. The ``batch`` move runs on a compiled fast path while
its guard holds (``FSMTRAIN_STRICT_FSM=1`` sends every batch through the machine). Torch-free."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from fsmtrain.core.consensus import Collective, RankAgreement, RankFailed, on_rank
from fsmtrain.core.context import FaultContext, RunContext
from fsmtrain.core.driver import Driver
from fsmtrain.core.epoch_work import END, EpochWork, Outputs
from fsmtrain.core.handlers import HandlerCompiler, compile_guard
from fsmtrain.core.lifecycle import (
    ABORT,
    BATCH,
    EPOCH_PHASES,
    FINAL,
    TRANSITIONS,
    Facts,
    Guard,
    LifecycleError,
    Phase,
    Transition,
    program_for,
    signal_waits,
    transition_for,
    triggers_from,
)
from fsmtrain.core.log_file import LogWriteError
from fsmtrain.core.machine import MoveChecks, build_machine
from fsmtrain.core.result import TrainResult
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.core.stop import StopReason

__all__ = ["LAUNCH_FACTS", "STRICT_ENV", "Engine", "Interrupted", "exit_status_of"]

STRICT_ENV = "FSMTRAIN_STRICT_FSM"
_PHASES: dict[str, Phase] = {p.value: p for p in Phase}
# How a process of a multi-process run was started: facts of the launch, not of the run's behaviour.
LAUNCH_FACTS = frozenset({"node", "local_rank", "launch", "layout", "elastic", "global_batch", "world_size_before",
                          "strategy", "sharding"})
# The run's extras its run_start records.
_RUN_START_EXTRAS = frozenset({"config", "seed", "resumed_from", "hpo", "rank", "world_size", "user_folders",
                               "reused_run_dir", *LAUNCH_FACTS})


def exit_status_of(signum: int) -> int:
    """130 for SIGINT; a pre-emption notice (SIGTERM, SIGUSR1 or one configured) exits as SIGTERM does, 143."""
    return 128 + (signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A signal asked the run to stop, raised at a phase boundary (never inside a handler, so no write is
    cut in half); ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, rank: int | None = None) -> None:
        self.signum = signum
        self.rank = rank  # in a multi-process run, the rank the signal was sent to
        self.exit_code = exit_status_of(signum)
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"signal {signal.Signals(signum).name} received{where}")

    @staticmethod
    def signal_of(exc: KeyboardInterrupt) -> int:
        """The signal a ``KeyboardInterrupt`` stands for: this class's own, SIGINT for Python's."""
        return exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)


class ExceptionLog:
    """Writes one ``exception`` line per exception, however often it is reported."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self._logged: set[int] = set()

    def __call__(self, exc: BaseException, source: str, **extra: Any) -> None:
        if id(exc) in self._logged:
            return
        self._logged.add(id(exc))
        # A log that can no longer be written must not stop the fault path.
        with contextlib.suppress(LogWriteError):
            self.run.emit(
                "exception", level="error", type=type(exc).__name__, message=str(exc), source=source,
                interrupt=isinstance(exc, (KeyboardInterrupt, RankFailed)),
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=20)), **extra)


def teardown_refused(run: RunContext, programs: Mapping[Transition, Callable[[], None]], log: ExceptionLog,
                     phase: Phase, refusal: str, exc: BaseException) -> NoReturn:
    """The machine refused ``abort`` from ``phase``: run its teardown directly, then raise the refusal."""
    message = (f"the machine refused {ABORT!r} from {phase.value!r} ({refusal}); the engine ran the teardown "
               f"itself. The fault was {type(exc).__name__}: {exc}")
    refused = LifecycleError(message)
    log(refused, "engine")
    with contextlib.suppress(LogWriteError):
        run.force_stop(StopReason.ERROR, "engine", message)
    run.bind_phase(lambda: FINAL)  # the run is in its teardown, whatever state the machine claims
    try:
        programs[transition_for(ABORT, phase)]()
    except BaseException as err:
        log(err, "teardown")
    raise refused from exc


class _MachineModel:
    """The object the ``transitions`` machine keeps its ``state`` on."""

    state: str
    trigger: Callable[..., bool]


class Engine:
    def __init__(self, driver: Driver, runner: CallbackRunner, run: RunContext, *, strict: bool | None = None,
                 restore: Callable[[RunContext], None] | None = None, collective: Collective | None = None,
                 outputs: Outputs | None = None, rounds_every: int | None = None) -> None:
        """``restore``: a resumed run's load; ``outputs``: the run's files; ``collective``: one rank's;
        ``rounds_every``: the batches between the ranks' signal rounds (None: auto)."""
        self.driver = driver
        self.runner = runner
        self.run = run
        if strict is None:
            strict = os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
        self.strict = strict
        self._faulted = False
        self._log_exception = ExceptionLog(run)
        self._debug = run.events.enabled_for("debug")
        work = self._work = EpochWork(driver, runner, run, restore, outputs)
        self._agreement = (RankAgreement(collective, run, per_batch=runner.may_stop_immediately,
                                         rounds_every=rounds_every)
                           if collective is not None and collective.world_size > 1 else None)
        self._agree_at = self._agreement.points if self._agreement is not None else frozenset()
        self._agreed_here = False  # the fast batch loop agreed just before handing back
        self._signal: int | None = None  # run.pending_signal as of the last boundary
        self._source = Phase.CREATED  # the phase the engine offers the machine its triggers from
        guards: dict[Guard, Callable[[], bool]] = {
            Guard.CAN_CONTINUE: lambda: run.stop is None and run.budget_left(),
            Guard.HAS_BATCH: work.has_batch,
            Guard.IMMEDIATE_STOP: self._agreement.immediate_stop if self._agreement else self._immediate_stop,
            Guard.FAULTED: lambda: self._faulted,
            Guard.VAL_DUE: work.val_due,
        }
        compiler = HandlerCompiler(work, runner, work.actions(), self._log_exception,
                                   driver_sets_flags=bool(getattr(driver, "sets_step_flags", False)))
        self._batch_move = transition_for(BATCH, Phase.TRAIN_STEP)
        self._batch_body = compiler.per_batch(program_for(self._batch_move))
        handlers = [compiler.compile(t, self._batch_body) for t in TRANSITIONS]
        self._programs: dict[Transition, Callable[[], None]] = dict(zip(TRANSITIONS, handlers, strict=True))
        self._batch_handler = self._programs[self._batch_move]
        self._model = _MachineModel()
        checks = MoveChecks(lambda: self._model.state, guards, self.facts)
        self.machine = build_machine(self._model, guards, [checks.handler(t, h) for t, h in self._programs.items()])
        run.bind_phase(lambda: _PHASES[self._model.state])
        never = frozenset({Guard.VAL_DUE}) if run.val_every_n_steps is None else frozenset()
        self._fast_guard = compile_guard(self._batch_move, guards, never)
        # One rank, not at debug level: a loop that reads the move's guard itself and calls its program's steps.
        plain = compiler.plain_batch(program_for(self._batch_move)) or (self._batch_body,)
        inline = (self._batch_move.conditions == (Guard.HAS_BATCH,)
                  and set(self._batch_move.unless) == {Guard.IMMEDIATE_STOP, Guard.VAL_DUE})
        self._solo_steps = plain if inline and self._agreement is None and not self._debug else None
        run.callbacks = runner.callbacks
        run.epoch_state = work.epoch_state
        run.dispatch = runner.fire
        run.slot_guard = runner.check_write

    @property
    def phase(self) -> Phase:
        """The machine's state."""
        return _PHASES[self._model.state]

    @property
    def result(self) -> TrainResult | None:
        """What the run ended with, once its ``result`` is written."""
        return self._work.result

    def _immediate_stop(self) -> bool:
        stop = self.run.stop
        return (stop is not None and stop.immediate) or self._signal is not None

    def facts(self) -> Facts:
        agreement, run, work = self._agreement, self.run, self._work
        return Facts(stop_requested=run.stop is not None,
                     immediate_stop=agreement.immediate_stop() if agreement is not None else self._immediate_stop(),
                     epochs_remain=run.budget_left(), has_batch=work.next is not END,
                     faulted=self._faulted, val_due=run.val_every_n_steps is not None and work.val_due())

    def execute(self) -> TrainResult:
        if self._model.state != Phase.CREATED.value:
            raise LifecycleError("this run has already been executed; build a new Trainer to train again")
        run = self.run
        steps: dict[str, Any] = {"max_steps": run.max_steps, "val_every_n_steps": run.val_every_n_steps}
        steps = {k: v for k, v in steps.items() if v is not None}
        run.emit("run_start", max_epochs=run.max_epochs, **steps, start_epoch=run.epoch, strict=self.strict,
                 callbacks=self.runner.describe(), **{k: v for k, v in run.extras.items() if k in _RUN_START_EXTRAS})
        self._work.start_clock()
        final, train_step = FINAL.value, Phase.TRAIN_STEP.value
        try:
            while self._model.state != final:
                if not self.strict and self._model.state == train_step:
                    self._fast_batches()
                self._advance()
        except BaseException as exc:
            ended = self._fault(exc)
            if ended is exc:
                raise
            raise ended from exc
        result = self._work.result
        assert result is not None
        return result

    def _advance(self) -> None:
        """Offer the machine the triggers that leave its state; check it moved as the table says."""
        source = self._source = _PHASES[self._model.state]
        self._signal = self.run.pending_signal
        if source in self._agree_at and not self._agreed_here:
            assert self._agreement is not None
            self._agreement.agree()
        self._agreed_here = False
        agreement = self._agreement
        if agreement is not None:
            agreement.held = False
        if self._signal is not None or (agreement is not None and agreement.signal is not None):
            stop = self.run.stop if agreement is None else agreement.stop
            unsignalled = dataclasses.replace(self.facts(), immediate_stop=stop is not None and stop.immediate)
            if not signal_waits(source, unsignalled):
                self._raise_if_signalled()
            self._signal = None  # held: the guards see the run as without it; the next boundary raises it
            if agreement is not None:
                agreement.held = True
        facts = self.facts()
        for trigger in triggers_from(source):
            if self._model.trigger(trigger):
                move = transition_for(trigger, source)
                dest = _PHASES.get(self._model.state)
                if dest is not move.dest or not move.enabled(facts):
                    raise LifecycleError(
                        f"the machine fired {trigger!r} from {source.value!r} into {self._model.state!r}, "
                        f"but the table allows {trigger!r} only into {move.dest.value!r} when its guards hold "
                        f"({move.guard_label() or 'no guard'}; facts {facts})")
                return
        raise LifecycleError(f"the machine fired none of {triggers_from(source)} from {source.value!r} ({facts})")

    def _fast_batches(self) -> None:
        """The compiled copy of the internal ``batch`` transition, for as long as its guard holds."""
        guard = self._fast_guard
        agreement = self._agreement
        if agreement is not None and agreement.per_batch:  # the ranks agree before every batch
            agree, handler = agreement.agree, self._batch_handler
            while True:
                agree()
                self._agreed_here = True
                if not guard():
                    return
                handler()
        run = self.run  # at debug level through the handler, which logs each batch move
        batch = self._batch_handler if self._debug else functools.partial(self._batch_body, self._work.step)
        if agreement is not None:  # several ranks: a signal is agreed a batch after it is sent, never blocking
            poll = agreement.poll_signal
            while True:
                poll()
                if not guard():
                    return
                batch()
        steps = self._solo_steps
        if steps is None:
            while True:
                self._signal = run.pending_signal
                if not guard():
                    return
                batch()
        # One rank: the guard (has_batch, not immediate_stop, not val_due) read here, the steps called in turn.
        work = self._work
        step = work.step
        val_due = None if run.val_every_n_steps is None else work.val_due
        while True:
            signal = self._signal = run.pending_signal
            stop = run.stop
            if (work.next is END or signal is not None or (stop is not None and stop.immediate)
                    or (val_due is not None and val_due())):
                return
            for fn in steps:
                fn(step)

    def _raise_if_signalled(self) -> None:
        """At a boundary, a signal routes the run through abort (with several ranks, an agreed one)."""
        agreement = self._agreement
        if agreement is not None:
            if agreement.signal is not None:
                raise Interrupted(*agreement.signal)
        elif self._signal is not None:
            raise Interrupted(self._signal)

    def _fault(self, exc: BaseException) -> BaseException:
        """Route an exception to ``train_end`` through ``abort``; what the run ends with (``exc`` or ``RankFailed``)."""
        run = self.run
        where = self.runner.failed_in
        phase = _PHASES.get(self._model.state, Phase.CREATED)
        if phase is FINAL and not self._work.tearing_down:
            phase = self._source  # a move into train_end whose handlers were refused: the run is still here
        source = f"{where[0]}.{where[1]}" if where and not isinstance(exc, Interrupted) else f"phase {phase.value}"
        if isinstance(exc, Interrupted):
            source = f"signal {signal.Signals(exc.signum).name}" + ("" if exc.rank is None else f" on rank {exc.rank}")
        message = f"{type(exc).__name__}: {exc}"
        extra: dict[str, Any] = {}
        agreement = self._agreement
        if agreement is not None and not self._work.tearing_down:
            ended = agreement.account(exc, source)
            if isinstance(ended, RankFailed):
                failure = ended.failure
                source, message = on_rank(failure.source, failure.rank), failure.message
                extra = {"failed_rank": failure.rank, "symptom": ended.symptom}
            elif not isinstance(exc, Interrupted):
                source = on_rank(source, agreement.collective.rank)
            exc = ended
        epoch = self._work.epoch
        # An epoch cut short gets no `epoch` line: its metrics go with the exception, for replay.
        if epoch is not None and epoch.index == run.epoch and phase in EPOCH_PHASES:
            extra["epoch_metrics"] = dict(epoch.metrics)
        self._log_exception(exc, source, **extra)
        if self._work.tearing_down:
            return exc  # the fault came from the teardown itself, which has run every step
        self._faulted = True
        reason = StopReason.INTERRUPTED if isinstance(exc, (KeyboardInterrupt, RankFailed)) else StopReason.ERROR
        with contextlib.suppress(LogWriteError):  # the stop is set before its line is written
            run.force_stop(reason, source, message)
        self._work.fault = FaultContext(run, exc, phase)
        self._source = phase
        try:
            fired = self._model.trigger(ABORT)
        except BaseException as err:
            if self._work.tearing_down:  # a teardown step failed; it is logged, and exc stays the error
                self._log_exception(err, "teardown")
                return exc
            refusal = f"{type(err).__name__}: {err}"
        else:
            if self._work.tearing_down and self._model.state == FINAL.value:
                return exc
            refusal = "it did not fire" if not fired else f"it moved into {self._model.state!r}"
        teardown_refused(run, self._programs, self._log_exception, phase, refusal, exc)
