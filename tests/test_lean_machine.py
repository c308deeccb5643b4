"""The lifecycle machine's lean trigger path (``fsmtrain.core.machine``) decides exactly as the
library's own ``transitions.Machine`` does: the same trigger fires or is refused, into the same
state, with the same callbacks run in the same order (prepare, before, after, the machine-wide
lists), for any guard values; and a real run never takes the library's slow path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import Machine, MachineError
from transitions.core import Event, Transition

from fsmtrain.core import lifecycle as L
from fsmtrain.core.machine import LifecycleMachine


class Refused(Exception):
    pass


def _spec(guards: dict[L.Guard, Any], log: list[str], refuse: set[int]) -> list[dict[str, Any]]:
    """Every callback list a lifecycle transition uses (``before``: the engine's move check, which
    may raise; ``after``: the program), and ``prepare``, each logging where it ran."""

    def before(i: int) -> None:
        log.append(f"before {i}")
        if i in refuse:
            raise Refused(i)

    return [{"trigger": t.trigger, "source": t.source.value, "dest": None if t.internal else t.dest.value,
             "conditions": [guards[g] for g in t.conditions], "unless": [guards[g] for g in t.unless],
             "prepare": [lambda i=i: log.append(f"prepare {i}")], "before": [lambda i=i: before(i)],
             "after": [lambda i=i: log.append(f"after {i}")]}
            for i, t in enumerate(L.TRANSITIONS)]


def _machine(cls: type[Machine], facts: dict[str, bool], log: list[str], refuse: set[int] | None = None) -> Any:
    class Model:
        state: str
        machine: Machine

    guards = {g: (lambda g=g: facts[g.value]) for g in L.Guard}
    model = Model()
    model.machine = cls(model=model, states=[p.value for p in L.Phase], transitions=_spec(guards, log, refuse or set()),
                        initial="created", auto_transitions=False, send_event=False, ignore_invalid_triggers=False)
    return model


TRIGGERS = sorted({t.trigger for t in L.TRANSITIONS})
STEPS = st.lists(st.tuples(st.sampled_from(TRIGGERS), st.fixed_dictionaries({g.value: st.booleans() for g in L.Guard})),
                 max_size=40)


@settings(max_examples=300, deadline=None)
@given(STEPS, st.sets(st.integers(0, len(L.TRANSITIONS) - 1), max_size=4))
def test_the_lean_path_fires_what_the_library_fires(steps: list[tuple[str, dict[str, bool]]], refuse: set[int]) -> None:
    """Same outcome, same state, same callbacks in the same order; a ``before`` that raises (the
    engine's move check refusing) leaves both machines where they were, running no ``after``."""
    facts: dict[str, bool] = {}
    plain_log: list[str] = []
    lean_log: list[str] = []
    plain = _machine(Machine, facts, plain_log, refuse)
    lean = _machine(LifecycleMachine, facts, lean_log, refuse)
    for trigger, values in steps:
        facts.update(values)
        outcomes = []
        for model in (plain, lean):
            try:
                outcomes.append(("fired", model.trigger(trigger), model.state))
            except MachineError:
                outcomes.append(("invalid", None, model.state))
            except Refused as exc:
                outcomes.append(("refused", exc.args, model.state))
        assert outcomes[0] == outcomes[1]
        assert plain_log == lean_log


def test_a_run_never_takes_the_librarys_slow_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The engine's machine has ``before`` (the move check) and ``after`` (the program) on every
    transition: the lean path must cover them, or every trigger of a run pays the library's
    per-callback logging."""
    import torch
    from torch import nn

    from fsmtrain import Trainer

    slow: list[str] = []
    library_execute, library_trigger = Transition.execute, Event.trigger

    def counted(self: Transition, event_data: Any) -> bool:
        slow.append(f"{self.source} -> {self.dest}")
        return bool(library_execute(self, event_data))

    def counted_trigger(self: Event, model: Any, *args: Any, **kwargs: Any) -> bool:
        slow.append(f"trigger {self.name}")
        return bool(library_trigger(self, model, *args, **kwargs))

    monkeypatch.setattr(Transition, "execute", counted)
    monkeypatch.setattr(Event, "trigger", counted_trigger)
    model = nn.Linear(2, 1)
    batch = (torch.ones(4, 2), torch.ones(4, 1))
    result = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), [batch] * 3, [batch],
                     max_epochs=2, run_dir=tmp_path / "run", console_level="error", default_callbacks=False).fit()
    assert result.epochs_completed == 2
    assert slow == []


def test_a_machine_wide_before_callback_runs_in_the_librarys_order() -> None:
    facts = {g.value: False for g in L.Guard}
    log: list[str] = []
    model = _machine(LifecycleMachine, facts, log)
    model.machine.before_state_change = [lambda: log.append("before")]
    assert model.trigger("begin") and model.state == "train_begin"
    begin = next(i for i, t in enumerate(L.TRANSITIONS) if t.trigger == "begin")
    assert log == [f"prepare {begin}", "before", f"before {begin}", f"after {begin}"]


def test_a_trigger_the_state_does_not_have_is_refused_by_the_library() -> None:
    model = _machine(LifecycleMachine, {g.value: False for g in L.Guard}, [])
    with pytest.raises(MachineError, match="Can't trigger event batch from state created"):
        model.trigger("batch")
