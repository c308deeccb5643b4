"""The engine's own actions in the lifecycle program: the contexts, the batch cursor (fetched one ahead,
so ``has_batch`` is known before a batch runs), the counters, the ``epoch`` record, outputs, ``result``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsmtrain.core.context import EpochContext, EpochRecord, FaultContext, RunContext, StepContext, ValStepContext
from fsmtrain.core.driver import Driver
from fsmtrain.core.lifecycle import FINAL, Action, HookScope, Transition
from fsmtrain.core.result import TrainResult
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.core.stop import budget_end

__all__ = ["END", "EpochWork", "Outputs", "Work"]

END: Any = object()  # the batch cursor is past the last batch
Work = Callable[[Any], None]
Outputs = Callable[[RunContext, bool], None]  # writes the run's files; the bool: it ended for its own reason


class EpochWork:
    """The run's position (epoch, batch, the contexts) and records (phase times, epoch, result)."""

    def __init__(self, driver: Driver, runner: CallbackRunner, run: RunContext,
                 restore: Callable[[RunContext], None] | None, outputs: Outputs | None = None) -> None:
        self.driver = driver
        self.runner = runner
        self.run = run
        self._restore = restore
        self._outputs = outputs
        self.result: TrainResult | None = None
        self.next: Any = END  # the batch the next ``batch`` move takes
        self._last_loss: Any = None  # the last batch's loss, until this one's forward has run
        self._following: Any = END
        self._iter: Iterator[Any] = iter(())
        self._batch_index = 0
        self.validated_at = -1  # the global step of the last validation
        self.epoch: EpochContext | None = None
        self.step: StepContext | None = None
        self.val_step: ValStepContext | None = None
        self.fault: FaultContext | None = None
        self.tearing_down = False  # set when the teardown starts: a fault from then on is the teardown's
        self.teardown_failed = False  # a step of the teardown raised
        self._debug = run.events.enabled_for("debug")
        self._phase_started = 0.0
        self._phase_seconds: dict[str, float] = {}
        self._epoch_started = 0.0
        self.contexts: dict[HookScope, Callable[[], Any]] = {
            HookScope.RUN: lambda: self.run,
            HookScope.EPOCH: lambda: self.epoch,
            HookScope.STEP: lambda: self.step,
            HookScope.VAL_STEP: lambda: self.val_step,
            HookScope.FAULT: lambda: self.fault,
        }

    def actions(self) -> dict[Action, Work]:
        """Every action of the program, the driver's included, by name."""
        d = self.driver
        return {
            Action.RESTORE: self._restore or (lambda run: None),
            Action.BEGIN_EPOCH: self._begin_epoch,
            Action.LOAD_EPOCH: self._load_epoch,
            Action.NEXT_BATCH: self._next_batch,
            Action.FORWARD: d.forward,
            Action.BACKWARD: d.backward,
            Action.OPTIMIZER_STEP: d.optimizer_step,
            Action.ZERO_GRAD: d.zero_grad,
            Action.COUNT_BATCH: self._count_batch,
            Action.END_TRAIN: self._end_train,
            Action.CUT_TRAIN: self._end_train,
            Action.RESUME_TRAIN: d.resume_train,
            Action.VAL_BATCH: d.val_batch,
            Action.END_VALIDATION: self._end_validation,
            Action.SCHEDULER_STEP: d.step_scheduler,
            Action.RECORD_EPOCH: self._record_epoch,
            Action.END_RUN: d.end_run,
            Action.OUTPUTS: self._write_outputs,
            Action.RESULT: self._write_result,
        }

    def epoch_state(self) -> dict[str, Any]:
        """The epoch in progress: the batches it has done, and the driver's state of it."""
        state: dict[str, Any] = getattr(self.driver, "epoch_state", dict)()
        return {**state, "batch": self._batch_index, "validated_at": self.validated_at}

    def has_batch(self) -> bool:
        return self.next is not END

    def val_due(self) -> bool:
        n, step = self.run.val_every_n_steps, self.run.global_step
        return n is not None and step % n == 0 and step != self.validated_at

    def start_clock(self) -> None:
        self._phase_started = time.perf_counter()

    def move_logger(self, move: Transition) -> Callable[[], None]:
        """What ``move``'s handler does first: time the phase it leaves and log it (an internal move only
        at debug level). The move's words are read once, here."""
        source, dest, trigger, internal = move.source.value, move.dest.value, move.trigger, move.internal
        final, level, run = move.dest is FINAL, "debug" if move.internal else "info", self.run

        def log_move() -> None:
            if not internal:
                self._time_phase(source)
            elif not self._debug:
                return
            payload: dict[str, Any] = self._stop_payload() if final else {}
            run.events.emit("transition", level=level, phase=dest, epoch=run.epoch, global_step=run.global_step,
                            payload=payload, from_phase=source, to_phase=dest, trigger=trigger)

        return log_move

    def _time_phase(self, phase: str) -> float:
        """Add the time since the last mark to ``phase``'s seconds; the new mark."""
        now = time.perf_counter()
        self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + now - self._phase_started
        self._phase_started = now
        return now

    def _stop_payload(self) -> dict[str, Any]:
        run, stop = self.run, self.run.stop
        reason, source, message = (budget_end(run.max_epochs, run.max_steps, run.global_step) if stop is None
                                   else (stop.reason, stop.source, stop.message))
        return {"reason": reason.value, "source": source, "message": message}

    def val_loop(self, body: Work) -> Callable[[], None]:
        """A phase-entry segment running ``body`` over the driver's validation batches."""

        def loop() -> None:
            epoch = self.epoch
            assert epoch is not None
            vstep = self.val_step = ValStepContext(self.run, epoch)
            batches = self.driver.val_batches(epoch)
            try:
                for index, batch in enumerate(batches):
                    vstep.reset(index, batch)
                    body(vstep)
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()

        return loop

    def _begin_epoch(self, _: Any) -> None:
        run = self.run
        run.clear_epoch_slots()
        self._phase_seconds = {}
        # An epoch's callback_seconds count only its own hooks, not what ran before it (on_train_begin).
        self.runner.take_timings()
        self._epoch_started = time.perf_counter()
        epoch = self.epoch = EpochContext(run, run.epoch)
        self.validated_at = run.global_step  # the last epoch's end validated there
        if run.resume_at is not None:  # the driver starts it after the batches the checkpoint had done
            epoch.resumed, run.resume_at = run.resume_at, None
            self.validated_at = int((epoch.resumed.get("epoch_state") or {}).get("validated_at", -1))
        self.step = StepContext(run, epoch)
        lr = self.driver.current_lr()
        if lr is not None:
            epoch.metrics["lr"] = lr

    def _load_epoch(self, epoch: EpochContext) -> None:
        self._iter = iter(self.driver.epoch_batches(epoch))
        self._batch_index = 0 if epoch.resumed is None else int(epoch.resumed["batch"])
        if self.run.max_steps is not None:  # the epoch ends early at max_steps (its last batch says so)
            self._iter = itertools.islice(self._iter, max(0, self.run.max_steps - self.run.global_step))
        self.next = next(self._iter, END)

    def _next_batch(self, step: StepContext) -> None:
        following = self._following = next(self._iter, END)
        # The last batch's graph (its backward done) lives on through this batch's forward, as a plain loop's
        # `loss` does: the parameters' gradient accumulators in it are reused, not built again each batch.
        self._last_loss = None if step.skip_backward else step.loss
        step.reset(self._batch_index, self.next, following is END)

    def _count_batch(self, step: StepContext) -> None:
        self._last_loss = None
        self._batch_index += 1
        self.run.global_step += 1
        self.next = self._following

    def _end_train(self, epoch: EpochContext) -> None:
        epoch.batches = self._batch_index
        epoch.metrics.update(self.driver.end_train(epoch))

    def _end_validation(self, epoch: EpochContext) -> None:
        metrics = self.driver.end_validation(epoch)
        epoch.metrics.update(metrics)
        epoch.inside = self.has_batch()
        run = self.run
        run.validations += 1
        self.validated_at = run.global_step
        if run.val_every_n_steps is not None:  # each validation, mid-epoch or not, for the audit and replay
            run.emit("validation", validation=run.validations, metrics=metrics)

    def _record_epoch(self, epoch: EpochContext) -> None:
        now = self._time_phase("epoch_end")
        record = EpochRecord(epoch.index, dict(epoch.metrics), self.run.slot_values(), now - self._epoch_started)
        self.run.history.append(record)
        cut: dict[str, Any] = {"cut": True} if self.has_batch() else {}  # a stop after a validation inside cut it
        self.run.emit("epoch", metrics=record.metrics, slots=record.slots, batches=epoch.batches,
                      seconds=record.seconds, phase_seconds=self._phase_seconds,
                      callback_seconds=self.runner.take_timings(), **cut)
        self.run.epoch += 1

    def _write_outputs(self, run: RunContext) -> None:
        if self._outputs is not None:
            stop = run.stop
            self._outputs(run, not self.teardown_failed and (stop is None or not stop.reason.fault))

    def _write_result(self, run: RunContext) -> None:
        self.result = TrainResult.from_run(run, run.stop_reason)
        run.emit("result", **self.result.summary())
