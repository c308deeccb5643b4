"""No handler runs for a move the table forbids: each transition's
:class:`~fsmtrain.core.machine.MoveHandler` checks, before the state changes, that the machine is in
the move's source and the table's guards hold, and its program runs only after that check passed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fsmtrain.core.handlers import compile_guard
from fsmtrain.core.lifecycle import Facts, Guard, LifecycleError, Transition
from fsmtrain.core.machine import MoveHandler

__all__ = ["MoveChecks"]


class MoveChecks:
    """The checked handlers of one run's machine; ``facts()`` words the refusal."""

    def __init__(self, state: Callable[[], str], guards: Mapping[Guard, Callable[[], bool]],
                 facts: Callable[[], Facts]) -> None:
        self._state = state
        self._guards = guards
        self._facts = facts
        self._cleared: Transition | None = None  # the move whose check passed and whose program may run

    def handler(self, t: Transition, program: Callable[[], None]) -> MoveHandler:
        return MoveHandler(self._check(t), self._after_check(t, program))

    def _check(self, t: Transition) -> Callable[[], None]:
        allowed = compile_guard(t, self._guards)
        source = t.source.value

        def check() -> None:
            if self._state() != source or not allowed():
                raise LifecycleError(
                    f"the machine fired {t.trigger!r} from {self._state()!r}, but the table allows it from "
                    f"{source!r} only when its guards hold ({t.guard_label() or 'no guard'}; facts {self._facts()}); "
                    "its handlers did not run")
            self._cleared = t

        return check

    def _after_check(self, t: Transition, program: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if self._cleared is not t:
                raise LifecycleError(f"the machine ran the handlers of {t.trigger!r} ({t.source.value} -> "
                                     f"{t.dest.value}) without checking the move first; they did not run")
            self._cleared = None
            program()

        return run
