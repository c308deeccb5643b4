"""The machine's handlers, compiled once per run from the program: a hook nobody overrides costs nothing.
The teardown runs every step even when one raises; the first error is raised after all ran."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsmtrain.core.epoch_work import EpochWork, Work
from fsmtrain.core.lifecycle import BATCH, FINAL, Action, Guard, HookScope, Step, Transition, program_for
from fsmtrain.core.runner import CallbackRunner

__all__ = ["HandlerCompiler", "compile_body", "compile_guard"]


def compile_guard(t: Transition, guards: Mapping[Guard, Callable[[], bool]],
                  never: frozenset[Guard] = frozenset()) -> Callable[[], bool]:
    """One callable for transition ``t``'s guards; ``never``: guards false for the whole run."""
    conditions = tuple(guards[g] for g in t.conditions)
    unless = tuple(guards[g] for g in t.unless if g not in never)
    if len(conditions) == 1 and len(unless) == 1:
        (c,), (u,) = conditions, unless
        return lambda: c() and not u()
    if len(conditions) == 1 and len(unless) == 2:
        (c,), (u, v) = conditions, unless
        return lambda: c() and not u() and not v()
    return lambda: all(g() for g in conditions) and not any(g() for g in unless)


def compile_body(items: Sequence[tuple[Work, str | None]], flags_can_change: bool) -> Work:
    """One callable for a per-batch program of ``(work, skip flag)`` pairs, each left out when its flag is set."""
    if not flags_can_change:
        plain = tuple(fn for fn, _ in items)

        def body(ctx: Any) -> None:
            for fn in plain:
                fn(ctx)

        return body
    frozen = tuple((flag, tuple(fn for fn, _ in run)) for flag, run in itertools.groupby(items, key=lambda i: i[1]))

    def flagged(ctx: Any) -> None:
        for flag, fns in frozen:
            if flag is None or not getattr(ctx, flag):
                for fn in fns:
                    fn(ctx)

    return flagged


def _bind(work: Work, context: Callable[[], Any]) -> Callable[[], None]:
    def call() -> None:
        work(context())

    return call


class HandlerCompiler:
    """Compiles each transition's handler for one run."""

    def __init__(self, work: EpochWork, runner: CallbackRunner, actions: Mapping[Action, Work],
                 log_exception: Callable[[BaseException, str], None], *, driver_sets_flags: bool) -> None:
        self.work = work
        self.runner = runner
        self.actions = actions
        self.log_exception = log_exception
        self.driver_sets_flags = driver_sets_flags  # a driver may skip a batch's step itself (fp16 overflow)

    def _work(self, step: Step) -> Work | None:
        if step.action is not None:
            return self.actions[step.action]
        return self.runner.dispatcher(step.name)

    def per_batch(self, steps: Sequence[Step]) -> Work:
        """The body of a batch: its steps as one callable of the step (or validation step) context."""
        items = [(w, s.skip) for s in steps if (w := self._work(s)) is not None]
        return compile_body(items, flags_can_change=self._flags_can_change(steps))

    def plain_batch(self, steps: Sequence[Step]) -> tuple[Work, ...] | None:
        """A batch's work in order, for a loop that calls it itself; None when a skip flag may leave some out."""
        if self._flags_can_change(steps):
            return None
        return tuple(w for s in steps if (w := self._work(s)) is not None)

    def _flags_can_change(self, steps: Sequence[Step]) -> bool:
        return self.driver_sets_flags or any(s.action is None and self.runner.has(s.name) for s in steps)

    def compile(self, t: Transition, batch_body: Work) -> Callable[[], None]:
        """The handler of transition ``t``: log the move, then run its program."""
        steps = program_for(t)
        if t.dest is FINAL:
            return self._teardown(t, steps)
        log_move, work = self.work.move_logger(t), self.work
        if t.trigger == BATCH:

            def batch_handler() -> None:
                log_move()
                batch_body(work.step)

            return batch_handler
        segments: list[Callable[[], None]] = []
        for per_batch, group in itertools.groupby(steps, key=lambda s: s.per_batch):
            if per_batch:  # a loop over validation batches inside the phase
                segments.append(self.work.val_loop(self.per_batch(list(group))))
                continue
            for s in group:
                fn = self._work(s)
                if fn is not None:
                    segments.append(_bind(fn, self.work.contexts[s.scope]))

        def handler() -> None:
            log_move()
            for segment in segments:
                segment()

        return handler

    def _teardown(self, t: Transition, steps: Sequence[Step]) -> Callable[[], None]:
        items: list[tuple[str, Work, HookScope]] = []
        for s in steps:
            if s.action is not None:
                items.append((s.name, self.actions[s.action], s.scope))
                continue
            for i, fn in self.runner.table(s.name):
                items.append((f"{self.runner.callbacks[i].name}.{s.name}", fn, s.scope))
        work, contexts, log_exception = self.work, self.work.contexts, self.log_exception
        log_move = work.move_logger(t)

        def teardown() -> None:
            work.tearing_down = True
            first: BaseException | None = None
            try:
                log_move()
            except BaseException as exc:
                work.teardown_failed = True
                first = exc
            for where, fn, scope in items:
                try:
                    fn(contexts[scope]())
                except BaseException as exc:
                    work.teardown_failed = True
                    log_exception(exc, where)
                    first = first or exc
            if first is not None:
                raise first

        return teardown
