"""The engine offers the lifecycle machine its triggers and gives the machine its handlers.

The machine is the authority. At each phase the engine offers the ``transitions`` machine the
triggers that leave its current state, in table order; the machine's own conditions (the live
guards) decide which one fires, and the phase is read from the machine's state, nowhere else. What
happens on a move is the machine's handler for that transition, compiled here from
:func:`pipeline.core.lifecycle.program_for`: the hooks and the driver's work, in the table's order.
After a move the engine checks the machine moved where the table allows, so a broken machine
(one that accepts every trigger, or never changes state) stops the run instead of faking it.

It knows nothing of torch: what it drives is a :class:`~pipeline.core.driver.Driver`. Training and
replay are drivers; both take exactly this code path.

Per batch, the internal ``batch`` transition runs on a fast path: a compiled copy of that declared
transition (its guards as bound predicates, its handler list) that loops for as long as the guard
holds, then hands back to the real trigger. Strict mode (``strict=True`` or
``FSMTRAIN_STRICT_FSM=1``) sends every batch through the real trigger; both write the same events.

Teardown cannot be skipped: every step of ``train_end`` (``on_exception``, ``on_train_end`` per
callback, the driver's ``end_run``, the ``result`` event) runs even when an earlier one raises or a
second interrupt arrives; the first error is raised after all have run.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline.core.consensus import Collective, decide, proposal_of
from pipeline.core.context import (
    EpochContext,
    EpochRecord,
    FaultContext,
    RunContext,
    StepContext,
    StopRequest,
    ValStepContext,
)
from pipeline.core.driver import Driver
from pipeline.core.lifecycle import (
    ABORT,
    BATCH,
    EPOCH_PHASES,
    FINAL,
    TRANSITIONS,
    Action,
    ActionSpec,
    Facts,
    Guard,
    HookScope,
    HookSpec,
    LifecycleError,
    Phase,
    Step,
    StopReason,
    Transition,
    agreement_points,
    build_machine,
    program_for,
    transition_for,
    triggers_from,
)
from pipeline.core.result import TrainResult
from pipeline.core.runner import CallbackRunner

STRICT_ENV = "FSMTRAIN_STRICT_FSM"
_END: Any = object()
_PHASES: dict[str, Phase] = {p.value: p for p in Phase}

Work = Callable[[Any], None]
# What of the run's extras its run_start records (rank and world size: one rank of a multi-process run).
_RUN_START_EXTRAS = frozenset({"config", "seed", "resumed_from", "hpo", "rank", "world_size"})


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) asked the run to stop; raised by the engine at a phase boundary,
    never inside a handler, so no write is cut in half. ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, rank: int | None = None) -> None:
        self.signum = signum
        self.rank = rank  # in a multi-process run, the rank the signal was sent to
        self.exit_code = 128 + signum
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"signal {signal.Signals(signum).name} received{where}")


class _MachineModel:
    """The object the ``transitions`` machine keeps its ``state`` on."""

    state: str
    trigger: Callable[..., bool]


def compile_guard(
    conditions: tuple[Callable[[], bool], ...], unless: tuple[Callable[[], bool], ...]
) -> Callable[[], bool]:
    """One callable for a transition's guards; the common one-and-one shape avoids generator cost."""
    if len(conditions) == 1 and len(unless) == 1:
        (c,), (u,) = conditions, unless
        return lambda: c() and not u()
    return lambda: all(g() for g in conditions) and not any(g() for g in unless)


def compile_body(items: Sequence[tuple[Work, str | None]], flags_can_change: bool) -> Work:
    """One callable for a per-batch program: ``(work, skip flag)`` pairs in order, a run of pairs
    sharing a flag left out when the step context has that flag set. With no per-batch hook nothing
    can set a flag, and the body is a plain sequence of calls."""
    if not flags_can_change:
        plain = tuple(fn for fn, _ in items)

        def body(ctx: Any) -> None:
            for fn in plain:
                fn(ctx)

        return body
    groups: list[tuple[str | None, list[Work]]] = []
    for fn, flag in items:
        if groups and groups[-1][0] == flag:
            groups[-1][1].append(fn)
        else:
            groups.append((flag, [fn]))
    frozen = tuple((flag, tuple(fns)) for flag, fns in groups)

    def flagged(ctx: Any) -> None:
        for flag, fns in frozen:
            if flag is None or not getattr(ctx, flag):
                for fn in fns:
                    fn(ctx)

    return flagged


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class Engine:
    def __init__(
        self,
        driver: Driver,
        runner: CallbackRunner,
        run: RunContext,
        *,
        strict: bool | None = None,
        restore: Callable[[RunContext], None] | None = None,
        collective: Collective | None = None,
    ) -> None:
        """``restore``: what a resumed run does in ``train_begin`` (load its checkpoint).
        ``collective``: this process is one rank of a multi-process run; the shared guards then read
        the facts the ranks agree on (see :mod:`pipeline.core.consensus`)."""
        self.driver = driver
        self._restore = restore
        self.runner = runner
        self.run = run
        self.strict = strict_from_env() if strict is None else strict
        self.result: TrainResult | None = None
        self._faulted = False
        self._logged: set[int] = set()  # exceptions already written to the log
        self._iter: Iterator[Any] = iter(())
        self._next: Any = _END
        self._following: Any = _END
        self._batch_index = 0
        self._epoch: EpochContext | None = None
        self._step: StepContext | None = None
        self._val_step: ValStepContext | None = None
        self._fault_ctx: FaultContext | None = None
        self._phase_started = 0.0
        self._phase_seconds: dict[str, float] = {}
        self._epoch_started = 0.0
        self._debug = run.events.enabled_for("debug")
        self._collective = collective
        shared = collective is not None and collective.world_size > 1
        self._per_batch_agreement = shared and runner.may_stop_immediately
        self._agree_at = agreement_points(self._per_batch_agreement) if shared else frozenset()
        self._agreed_stop: StopRequest | None = None
        self._agreed_signal: tuple[int, int] | None = None  # (signal, rank)
        self._agreed_here = False  # the fast batch loop agreed just before handing back
        # run.pending_signal as it was at the last boundary: a signal handler sets the live one between
        # any two bytecodes, and the facts the engine checks a move against must be the ones its guards read.
        self._signal: int | None = None
        guards: dict[Guard, Callable[[], bool]] = {
            Guard.CAN_CONTINUE: self._can_continue,
            Guard.HAS_BATCH: self._has_batch,
            Guard.IMMEDIATE_STOP: self._agreed_immediate_stop if shared else self._immediate_stop,
            Guard.FAULTED: self._is_faulted,
        }
        self._actions: dict[Action, Work] = self._action_table()
        self._contexts: dict[HookScope, Callable[[], Any]] = {
            HookScope.RUN: lambda: self.run,
            HookScope.EPOCH: lambda: self._epoch,
            HookScope.STEP: lambda: self._step,
            HookScope.VAL_STEP: lambda: self._val_step,
            HookScope.FAULT: lambda: self._fault_ctx,
        }
        self._batch_move = transition_for(BATCH, Phase.TRAIN_STEP)
        self._batch_body = self._compile_per_batch(program_for(self._batch_move))
        handlers = [self._compile(t) for t in TRANSITIONS]
        self._batch_handler = handlers[TRANSITIONS.index(self._batch_move)]
        self._model = _MachineModel()
        self.machine = build_machine(self._model, guards, handlers)
        run.bind_phase(self._machine_phase)
        # The compiled fast path of the internal batch transition: its guards, its handlers.
        self._fast_guard = compile_guard(
            tuple(guards[g] for g in self._batch_move.conditions), tuple(guards[g] for g in self._batch_move.unless)
        )
        run.callbacks = runner.callbacks
        run.dispatch = runner.fire
        run.slot_guard = runner.check_write

    def _machine_phase(self) -> Phase:
        return _PHASES[self._model.state]

    @property
    def phase(self) -> Phase:
        """The machine's state."""
        return _PHASES[self._model.state]

    # --- guards ----------------------------------------------------------------------------
    def _can_continue(self) -> bool:
        return self.run.stop is None and self.run.epoch < self.run.max_epochs

    def _has_batch(self) -> bool:
        return self._next is not _END

    def _immediate_stop(self) -> bool:
        stop = self.run.stop
        return (stop is not None and stop.immediate) or self._signal is not None

    def _agreed_immediate_stop(self) -> bool:
        stop = self._agreed_stop
        return (stop is not None and stop.immediate) or self._agreed_signal is not None

    def _is_faulted(self) -> bool:
        return self._faulted

    def facts(self) -> Facts:
        stop = self.run.stop
        return Facts(
            stop_requested=stop is not None,
            immediate_stop=self._guards_immediate(),
            epochs_remain=self.run.epoch < self.run.max_epochs,
            has_batch=self._next is not _END,
            faulted=self._faulted,
        )

    # --- compiling the machine's handlers from the program ------------------------------------
    def _action_table(self) -> dict[Action, Work]:
        d = self.driver
        return {
            Action.RESTORE: self._restore_run,
            Action.BEGIN_EPOCH: self._begin_epoch,
            Action.LOAD_EPOCH: self._load_epoch,
            Action.NEXT_BATCH: self._next_batch,
            Action.FORWARD: d.forward,
            Action.BACKWARD: d.backward,
            Action.OPTIMIZER_STEP: d.optimizer_step,
            Action.ZERO_GRAD: d.zero_grad,
            Action.COUNT_BATCH: self._count_batch,
            Action.END_TRAIN: self._end_train,
            Action.VAL_BATCH: d.val_batch,
            Action.END_VALIDATION: self._end_validation,
            Action.SCHEDULER_STEP: d.step_scheduler,
            Action.RECORD_EPOCH: self._record_epoch,
            Action.END_RUN: d.end_run,
            Action.RESULT: self._write_result,
        }

    def _work(self, step: Step) -> Work | None:
        if isinstance(step, ActionSpec):
            return self._actions[step.action]
        return self.runner.dispatcher(step.name)

    def _compile_per_batch(self, steps: Sequence[Step]) -> Work:
        items = [(w, s.skip) for s in steps if (w := self._work(s)) is not None]
        hooked = any(isinstance(s, HookSpec) and self.runner.has(s.name) for s in steps)
        # A driver may skip a batch's step itself (mixed precision's overflow): it says so.
        return compile_body(items, flags_can_change=hooked or bool(getattr(self.driver, "sets_step_flags", False)))

    def _compile(self, t: Transition) -> Callable[[], None]:
        """The handler of transition ``t``: log the move, then run its program."""
        steps = program_for(t)
        if t.dest is FINAL:
            return self._compile_teardown(t, steps)
        if t.trigger == BATCH:
            body = self._batch_body

            def batch_handler() -> None:
                self._log_move(t)
                body(self._step)

            return batch_handler
        segments: list[Callable[[], None]] = []
        i = 0
        while i < len(steps):
            s = steps[i]
            if s.per_batch:  # a loop over validation batches inside the phase
                j = i
                while j < len(steps) and steps[j].per_batch:
                    j += 1
                segments.append(self._val_loop(self._compile_per_batch(steps[i:j])))
                i = j
                continue
            work = self._work(s)
            if work is not None:
                segments.append(self._bind(work, self._contexts[s.scope]))
            i += 1

        def handler() -> None:
            self._log_move(t)
            for segment in segments:
                segment()

        return handler

    @staticmethod
    def _bind(work: Work, context: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            work(context())

        return call

    def _val_loop(self, body: Work) -> Callable[[], None]:
        def loop() -> None:
            epoch = self._epoch
            assert epoch is not None
            vstep = self._val_step = ValStepContext(self.run, epoch)
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

    def _compile_teardown(self, t: Transition, steps: Sequence[Step]) -> Callable[[], None]:
        """Every step runs, every callback of every hook runs; failures are logged as they happen
        and the first is raised at the end (a second Ctrl-C included)."""
        items: list[tuple[str, Work, HookScope]] = []
        for s in steps:
            if isinstance(s, ActionSpec):
                items.append((s.name, self._actions[s.action], s.scope))
                continue
            for i, fn in self.runner.table(s.name):
                items.append((f"{self.runner.callbacks[i].name}.{s.name}", fn, s.scope))

        def teardown() -> None:
            first: BaseException | None = None
            try:
                self._log_move(t)
            except BaseException as exc:
                first = exc
            for where, fn, scope in items:
                try:
                    fn(self._contexts[scope]())
                except BaseException as exc:
                    self._log_exception(exc, where)
                    first = first or exc
            if first is not None:
                raise first

        return teardown

    # --- the walk --------------------------------------------------------------------------
    def execute(self) -> TrainResult:
        if self._model.state != Phase.CREATED.value:
            raise LifecycleError("this run has already been executed; build a new Trainer to train again")
        self.run.emit(
            "run_start",
            max_epochs=self.run.max_epochs,
            start_epoch=self.run.epoch,
            strict=self.strict,
            callbacks=self.runner.describe(),
            **{k: v for k, v in self.run.extras.items() if k in _RUN_START_EXTRAS},
        )
        self._phase_started = time.perf_counter()
        final, train_step = FINAL.value, Phase.TRAIN_STEP.value
        try:
            while self._model.state != final:
                if not self.strict and self._model.state == train_step:
                    self._fast_batches()
                self._advance()
        except BaseException as exc:
            self._fault(exc)
            raise
        assert self.result is not None
        return self.result

    def _advance(self) -> None:
        """Offer the machine the triggers that leave its state; check it moved as the table says."""
        source = _PHASES[self._model.state]
        self._signal = self.run.pending_signal
        if source in self._agree_at and not self._agreed_here:
            self._agree()
        self._agreed_here = False
        self._raise_if_signalled()
        facts = self.facts()
        for trigger in triggers_from(source):
            if self._model.trigger(trigger):
                move = transition_for(trigger, source)
                dest = _PHASES.get(self._model.state)
                if dest is not move.dest or not move.enabled(facts):
                    raise LifecycleError(
                        f"the machine fired {trigger!r} from {source.value!r} into {self._model.state!r}, "
                        f"but the table allows {trigger!r} only into {move.dest.value!r} when its guards hold "
                        f"({move.guard_label() or 'no guard'}; facts {facts})"
                    )
                return
        raise LifecycleError(f"the machine fired none of {triggers_from(source)} from {source.value!r} ({facts})")

    def _fast_batches(self) -> None:
        """The compiled copy of the internal ``batch`` transition, for as long as its guard holds."""
        guard = self._fast_guard
        if self._per_batch_agreement:  # the ranks agree before every batch: one shared guard check
            agree, handler = self._agree, self._batch_handler
            while True:
                agree()
                self._agreed_here = True
                if not guard():
                    return
                handler()
        run = self.run
        if self._debug:
            handler = self._batch_handler
            while True:
                self._signal = run.pending_signal
                if not guard():
                    return
                handler()
        body, step = self._batch_body, self._step
        while True:
            self._signal = run.pending_signal
            if not guard():
                return
            body(step)

    # --- agreement between ranks ----------------------------------------------------------
    def _guards_immediate(self) -> bool:
        if self._agree_at:
            return self._agreed_immediate_stop()
        return self._immediate_stop()

    def _raise_if_signalled(self) -> None:
        """At a boundary, a signal routes the run through abort (the fault path). In a
        multi-process run only an agreed signal counts, so every rank raises it at the same point."""
        if self._agree_at:
            if self._agreed_signal is not None:
                raise Interrupted(*self._agreed_signal)
        elif self._signal is not None:
            raise Interrupted(self._signal)

    def _agree(self) -> None:
        """One all-gather of every rank's new stop request and signal; every rank applies the same verdict."""
        collective = self._collective
        assert collective is not None
        run = self.run
        mine = run.stop if run.stop is not self._agreed_stop else None
        signal_seen = run.pending_signal if self._agreed_signal is None else None
        verdict = decide(collective.all_gather_ints(proposal_of(mine, signal_seen)))
        if verdict.signal and self._agreed_signal is None:
            self._agreed_signal = (verdict.signal, verdict.signal_rank)
        if verdict.reason is None:
            return
        source, message = collective.broadcast_object(
            (mine.source, mine.message) if mine is not None and collective.rank == verdict.stop_rank else None,
            verdict.stop_rank,
        )
        if collective.rank != verdict.stop_rank or mine is None:
            source = f"{source} on rank {verdict.stop_rank}"
            replaced = run.stop
            run.stop = StopRequest(verdict.reason, source, message, verdict.immediate, verdict.epoch,
                                   run.global_step, verdict.phase)
            extra = {"overrides": replaced.reason.value} if replaced is not None else {}
            run.emit("stop_request", reason=verdict.reason.value, source=source, message=message,
                     immediate=verdict.immediate, accepted=True, rank=verdict.stop_rank,
                     requested_epoch=verdict.epoch, requested_phase=verdict.phase.value, **extra)
        self._agreed_stop = run.stop
        if verdict.immediate and not self._per_batch_agreement and verdict.phase not in self._agree_at:
            run.warn("engine", f"an immediate stop from {source} is honoured at this epoch's end: no callback of "
                     "this run declares may_stop_immediately, so the ranks agree once per epoch")

    def _log_move(self, move: Transition) -> None:
        source = move.source.value
        if not move.internal:
            now = time.perf_counter()
            self._phase_seconds[source] = self._phase_seconds.get(source, 0.0) + now - self._phase_started
            self._phase_started = now
        elif not self._debug:
            return
        payload: dict[str, Any] = self._stop_payload() if move.dest is FINAL else {}
        dest = move.dest.value
        self.run.events.emit(
            "transition", level="debug" if move.internal else "info", phase=dest, epoch=self.run.epoch,
            global_step=self.run.global_step, payload=payload, from_phase=source, to_phase=dest, trigger=move.trigger,
        )

    def _stop_payload(self) -> dict[str, Any]:
        stop = self.run.stop
        reason = stop.reason if stop is not None else StopReason.COMPLETED
        return {
            "reason": reason.value,
            "source": stop.source if stop else "max_epochs",
            "message": stop.message if stop else f"reached max_epochs={self.run.max_epochs}",
        }

    # --- actions ---------------------------------------------------------------------------
    def _restore_run(self, run: RunContext) -> None:
        if self._restore is not None:
            self._restore(run)

    def _begin_epoch(self, _: Any) -> None:
        run = self.run
        run.clear_epoch_slots()
        self._phase_seconds = {}
        self._epoch_started = time.perf_counter()
        epoch = self._epoch = EpochContext(run, run.epoch)
        self._step = StepContext(run, epoch)
        lr = self.driver.current_lr()
        if lr is not None:
            epoch.metrics["lr"] = lr

    def _load_epoch(self, epoch: EpochContext) -> None:
        self._iter = iter(self.driver.epoch_batches(epoch))
        self._batch_index = 0
        self._next = next(self._iter, _END)

    def _next_batch(self, step: StepContext) -> None:
        following = self._following = next(self._iter, _END)
        step.reset(self._batch_index, self._next, following is _END)

    def _count_batch(self, step: StepContext) -> None:
        self._batch_index += 1
        self.run.global_step += 1
        self._next = self._following

    def _end_train(self, epoch: EpochContext) -> None:
        epoch.batches = self._batch_index
        epoch.metrics.update(self.driver.end_train(epoch))

    def _end_validation(self, epoch: EpochContext) -> None:
        epoch.metrics.update(self.driver.end_validation(epoch))

    def _record_epoch(self, epoch: EpochContext) -> None:
        now = time.perf_counter()
        self._phase_seconds["epoch_end"] = self._phase_seconds.get("epoch_end", 0.0) + now - self._phase_started
        self._phase_started = now
        record = EpochRecord(epoch.index, dict(epoch.metrics), self.run.slot_values(), now - self._epoch_started)
        self.run.history.append(record)
        self.run.emit(
            "epoch",
            metrics=record.metrics,
            slots=record.slots,
            batches=epoch.batches,
            seconds=record.seconds,
            phase_seconds=self._phase_seconds,
            callback_seconds=self.runner.take_timings(),
        )
        self.run.epoch += 1

    def _write_result(self, run: RunContext) -> None:
        stop = run.stop
        self.result = TrainResult.from_run(run, stop.reason if stop is not None else StopReason.COMPLETED)
        run.emit("result", **self.result.summary())

    # --- faults ----------------------------------------------------------------------------
    def _log_exception(self, exc: BaseException, source: str, **extra: Any) -> None:
        if id(exc) in self._logged:
            return
        self._logged.add(id(exc))
        self.run.emit(
            "exception", level="error", type=type(exc).__name__, message=str(exc), source=source,
            interrupt=isinstance(exc, KeyboardInterrupt),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=20)), **extra,
        )

    def _fault(self, exc: BaseException) -> None:
        """Route an exception or interrupt to train_end (reason ERROR / INTERRUPTED) through the
        machine's ``abort``; its handler runs the whole teardown. The caller re-raises ``exc``."""
        run = self.run
        where = self.runner.failed_in
        phase = _PHASES.get(self._model.state, Phase.CREATED)
        source = f"{where[0]}.{where[1]}" if where and not isinstance(exc, Interrupted) else f"phase {phase.value}"
        if isinstance(exc, Interrupted):
            source = f"signal {signal.Signals(exc.signum).name}" + ("" if exc.rank is None else f" on rank {exc.rank}")
        epoch = self._epoch
        cut = epoch is not None and epoch.index == run.epoch and phase in EPOCH_PHASES
        # An epoch cut short never gets its `epoch` line: what it had measured (lr, train and val
        # losses) goes with the exception, so a replay can run the cut epoch as far as it went.
        self._log_exception(exc, source, **({"epoch_metrics": dict(epoch.metrics)} if cut and epoch else {}))
        if phase is FINAL:
            return  # the fault came from the teardown itself, which has run every step
        self._faulted = True
        reason = StopReason.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else StopReason.ERROR
        run.force_stop(reason, source, f"{type(exc).__name__}: {exc}")
        self._fault_ctx = FaultContext(run, exc, phase)
        try:
            fired = self._model.trigger(ABORT)
        except BaseException as err:  # a teardown step failed; it is logged, and exc stays the error
            self._log_exception(err, "teardown")
            return
        if not fired or self._model.state != FINAL.value:
            raise LifecycleError(f"the machine refused {ABORT!r} from {phase.value!r}") from exc
