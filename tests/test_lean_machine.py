"""The lifecycle machine's lean trigger path (``pipeline.core.machine``) decides exactly as the
library's own ``transitions.Machine`` does: the same trigger fires or is refused, into the same
state, with the same handlers run, for any guard values; and it hands back to the library's code
as soon as a callback list it skips is configured."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import Machine, MachineError

from pipeline.core import lifecycle as L
from pipeline.core.machine import LifecycleMachine


def _spec(guards: dict[L.Guard, Any], log: list[str]) -> list[dict[str, Any]]:
    return [{"trigger": t.trigger, "source": t.source.value, "dest": None if t.internal else t.dest.value,
             "conditions": [guards[g] for g in t.conditions], "unless": [guards[g] for g in t.unless],
             "after": [lambda i=i: log.append(f"after {i}")]}
            for i, t in enumerate(L.TRANSITIONS)]


def _machine(cls: type[Machine], facts: dict[str, bool], log: list[str]) -> Any:
    class Model:
        state: str

    guards = {g: (lambda g=g: facts[g.value]) for g in L.Guard}
    model = Model()
    model.machine = cls(model=model, states=[p.value for p in L.Phase], transitions=_spec(guards, log),
                        initial="created", auto_transitions=False, send_event=False, ignore_invalid_triggers=False)
    return model


TRIGGERS = sorted({t.trigger for t in L.TRANSITIONS})
STEPS = st.lists(st.tuples(st.sampled_from(TRIGGERS), st.fixed_dictionaries({g.value: st.booleans() for g in L.Guard})),
                 max_size=40)


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_the_lean_path_fires_what_the_library_fires(steps: list[tuple[str, dict[str, bool]]]) -> None:
    facts: dict[str, bool] = {}
    plain_log: list[str] = []
    lean_log: list[str] = []
    plain, lean = _machine(Machine, facts, plain_log), _machine(LifecycleMachine, facts, lean_log)
    for trigger, values in steps:
        facts.update(values)
        outcomes = []
        for model in (plain, lean):
            try:
                outcomes.append(("fired", model.trigger(trigger), model.state))
            except MachineError:
                outcomes.append(("invalid", None, model.state))
        assert outcomes[0] == outcomes[1]
        assert plain_log == lean_log


def test_a_configured_before_callback_takes_the_librarys_path() -> None:
    facts = {g.value: False for g in L.Guard}
    log: list[str] = []
    model = _machine(LifecycleMachine, facts, log)
    model.machine.before_state_change = [lambda: log.append("before")]
    assert model.trigger("begin") and model.state == "train_begin"
    assert log == ["before", f"after {next(i for i, t in enumerate(L.TRANSITIONS) if t.trigger == 'begin')}"]


def test_a_trigger_the_state_does_not_have_is_refused_by_the_library() -> None:
    model = _machine(LifecycleMachine, {g.value: False for g in L.Guard}, [])
    with pytest.raises(MachineError, match="Can't trigger event batch from state created"):
        model.trigger("batch")
