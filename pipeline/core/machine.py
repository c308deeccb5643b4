"""The lifecycle's ``transitions`` machine, built from the table: conditions are the live guards, each
move's ``before`` its check and ``after`` its program. The lean classes (the library's ``*_cls`` extension
points) skip per-trigger logging, falling back to the library's code when anything else is configured."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transitions import Machine
from transitions.core import Condition, Event, EventData, Transition

from fsmtrain.core.handlers import compile_guard
from fsmtrain.core.lifecycle import INITIAL, TRANSITIONS, Facts, Guard, LifecycleError, Phase
from fsmtrain.core.lifecycle import Transition as Move

__all__ = ["GuardCondition", "LeanEvent", "LeanTransition", "LifecycleMachine", "MoveChecks", "MoveHandler",
           "build_machine"]


class GuardCondition(Condition):
    """Calls the guard directly (guards take no arguments: ``send_event=False``)."""

    def check(self, event_data: EventData) -> bool:
        func = self.func
        if not callable(func) or event_data.machine.send_event or event_data.args or event_data.kwargs:
            return bool(super().check(event_data))
        return bool(func() == self.target)


class LeanTransition(Transition):
    """The library's sequence (prepare, conditions, before, change of state, after) without its logging."""

    condition_cls = GuardCondition

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        states = machine.states  # the names of a built machine's own transitions (``get_state``'s lookup)
        source = states[self.source]
        dest = None if self.dest is None else states[self.dest]  # None: an internal transition
        if machine.send_event or source.on_exit or (dest is not None and (dest.on_enter or dest.final)):
            return bool(super().execute(event_data))
        if self.prepare:
            _call_each(self.prepare, machine, event_data)
        for condition in self.conditions:
            if not condition.check(event_data):
                return False
        for callbacks in (machine.before_state_change, self.before):
            if callbacks:
                _call_each(callbacks, machine, event_data)
        if dest is not None:
            setattr(event_data.model, machine.model_attribute, dest.value)
            event_data.state = dest
        for callbacks in (self.after, machine.after_state_change):
            if callbacks:
                _call_each(callbacks, machine, event_data)
        return True


def _call_each(callbacks: list[Any], machine: Machine, event_data: EventData) -> None:
    """A callback list as ``Machine.callbacks`` runs it with ``send_event`` off."""
    args, kwargs = event_data.args, event_data.kwargs
    for callback in callbacks:
        if callable(callback):
            callback(*args, **kwargs)
        else:
            machine.callback(callback, event_data)


class LeanEvent(Event):
    """Tries the transitions of the model's state in order, as ``Event.trigger`` does."""

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        machine = self.machine
        if machine.has_queue or machine.prepare_event or machine.finalize_event or machine.on_exception:
            return bool(super().trigger(model, *args, **kwargs))
        state = machine.states.get(getattr(model, machine.model_attribute))
        moves = None if state is None else self.transitions.get(state.name)
        if not moves:  # not a trigger of this state: the library raises (or ignores) as configured
            return bool(super().trigger(model, *args, **kwargs))
        event_data = EventData(state, self, machine, model, args, kwargs)
        for move in moves:
            event_data.transition = move
            if move.execute(event_data):
                event_data.result = True
                return True
        return False


class LifecycleMachine(Machine):
    event_cls = LeanEvent
    transition_cls = LeanTransition


@dataclass(frozen=True)
class MoveHandler:
    """A transition's ``before`` (``check``: raises when the table forbids the move) and ``after`` (``run``)."""

    check: Callable[[], None]
    run: Callable[[], None]


def build_machine(model: Any, guards: Mapping[Guard, Callable[[], bool]],
                  handlers: Sequence[Callable[[], None] | MoveHandler]) -> Machine:
    """The machine over ``model``: conditions are the live ``guards``; ``handlers[i]`` runs on ``TRANSITIONS[i]``."""
    if len(handlers) != len(TRANSITIONS):
        raise LifecycleError(f"{len(handlers)} handlers for {len(TRANSITIONS)} transitions")
    spec = [{"trigger": t.trigger, "source": t.source.value, "dest": None if t.internal else t.dest.value,
             "conditions": [guards[g] for g in t.conditions], "unless": [guards[g] for g in t.unless],
             "before": [handler.check] if isinstance(handler, MoveHandler) else [],
             "after": [handler.run if isinstance(handler, MoveHandler) else handler]}
            for t, handler in zip(TRANSITIONS, handlers, strict=True)]
    return LifecycleMachine(model=model, states=[p.value for p in Phase], transitions=spec, initial=INITIAL.value,
                            auto_transitions=False, send_event=False, ignore_invalid_triggers=False)


class MoveChecks:
    """The checked handlers of one run's machine; ``facts()`` words the refusal."""

    def __init__(self, state: Callable[[], str], guards: Mapping[Guard, Callable[[], bool]],
                 facts: Callable[[], Facts]) -> None:
        self._state = state
        self._guards = guards
        self._facts = facts
        self._cleared: Move | None = None  # the move whose check passed and whose program may run

    def handler(self, t: Move, program: Callable[[], None]) -> MoveHandler:
        return MoveHandler(self._check(t), self._after_check(t, program))

    def _check(self, t: Move) -> Callable[[], None]:
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

    def _after_check(self, t: Move, program: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if self._cleared is not t:
                raise LifecycleError(f"the machine ran the handlers of {t.trigger!r} ({t.source.value} -> "
                                     f"{t.dest.value}) without checking the move first; they did not run")
            self._cleared = None
            program()

        return run
