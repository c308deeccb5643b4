"""The lifecycle's ``transitions`` machine, with a lean trigger path through the library's own
extension points.

A trigger of a plain ``transitions.Machine`` builds a partial and an ``EventData``, resolves every
callback by name, runs the (empty) prepare, before, finalize and state enter/exit callback lists,
and makes about a dozen logger calls; at a few triggers per epoch that was most of the engine's
own cost per epoch. The lifecycle machine uses only conditions and the ``before`` (the move check)
and ``after`` (the program) lists, so its classes run those without the library's overhead, and fall
back to the library's own code the moment anything else is configured (a queue, prepare or finalize
events, ``on_exception``, state enter/exit or final callbacks, ``send_event``):

- :class:`GuardCondition` calls the guard directly (guards take no arguments: ``send_event=False``);
- :class:`LeanTransition` runs the library's sequence (prepare, conditions, before, the change of
  state, after; the machine-wide lists in their places) without its per-step logger calls and
  ``itertools.chain``; the conditions still decide whether it fires;
- :class:`LeanEvent` looks up the transitions of the model's state and tries them in order, as
  ``Event._process`` does, with one ``EventData``;
- :class:`LifecycleMachine` is a plain ``Machine`` that uses them.

Nothing here decides a move: which transition fires is still the machine's, through its conditions.
"""

from __future__ import annotations

from typing import Any

from transitions import Machine
from transitions.core import Condition, Event, EventData, Transition

__all__ = ["GuardCondition", "LeanEvent", "LeanTransition", "LifecycleMachine"]


class GuardCondition(Condition):
    def check(self, event_data: EventData) -> bool:
        func = self.func
        if not callable(func) or event_data.machine.send_event or event_data.args or event_data.kwargs:
            return bool(super().check(event_data))
        return bool(func() == self.target)


class LeanTransition(Transition):
    condition_cls = GuardCondition

    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        # The machine-wide lists, read where ``Machine``'s properties keep them (a property is a Python
        # call per trigger); a library that keeps them elsewhere, or callbacks that take the EventData,
        # take the library's own path.
        stored = machine.__dict__
        before_all, after_all = stored.get("_before_state_change"), stored.get("_after_state_change")
        if machine.send_event or before_all is None or after_all is None:
            return bool(super().execute(event_data))
        if self.prepare:
            _call_each(self.prepare, machine, event_data)
        for condition in self.conditions:
            if not condition.check(event_data):
                return False
        if before_all:
            _call_each(before_all, machine, event_data)
        if self.before:
            _call_each(self.before, machine, event_data)
        if self.dest:  # None: an internal transition, no change of state
            self._change_state(event_data)
        if self.after:
            _call_each(self.after, machine, event_data)
        if after_all:
            _call_each(after_all, machine, event_data)
        return True

    def _change_state(self, event_data: EventData) -> None:
        machine, dest_name = event_data.machine, self.dest
        assert dest_name is not None  # only a transition that changes state gets here
        source, dest = machine.states[self.source], machine.states[dest_name]
        if source.on_exit or dest.on_enter or dest.final:
            super()._change_state(event_data)
            return
        setattr(event_data.model, machine.model_attribute, dest.value)
        event_data.state = dest


def _call_each(callbacks: list[Any], machine: Machine, event_data: EventData) -> None:
    """A callback list as ``Machine.callbacks`` runs it (``send_event`` off): a callable is called
    with the trigger's arguments, a name is resolved by the library."""
    args, kwargs = event_data.args, event_data.kwargs
    for callback in callbacks:
        if callable(callback):
            callback(*args, **kwargs)
        else:
            machine.callback(callback, event_data)


class LeanEvent(Event):
    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        machine = self.machine
        # Read where ``Machine``'s properties keep them (see LeanTransition.execute); a library that
        # keeps them elsewhere takes its own path.
        stored = machine.__dict__
        if (stored.get("_queued", True) or stored.get("_prepare_event", True) or stored.get("_finalize_event", True)
                or stored.get("_on_exception", True)):
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
