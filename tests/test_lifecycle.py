"""The lifecycle table: its checks, and the machine built from it."""

from __future__ import annotations

import dataclasses

import pytest
from transitions import MachineError

from fsmtrain.core.lifecycle import (
    ABORT,
    FINAL,
    HOOK_NAMES,
    HOOKS,
    INITIAL,
    PROGRAM,
    TRANSITIONS,
    Facts,
    Guard,
    LifecycleError,
    Phase,
    Transition,
    check_table,
    enabled_transition,
    transition_for,
    transitions_from,
    triggers_from,
)
from fsmtrain.core.machine import build_machine


def test_the_shipped_table_passes_its_checks() -> None:
    check_table()


def test_the_indexes_the_engine_reads_are_the_table_itself() -> None:
    """The engine looks moves up in indexes built once; they must answer as a walk of the table does."""
    for phase in Phase:
        walked = [t.trigger for t in TRANSITIONS if t.source is phase and t.trigger != ABORT]
        assert triggers_from(phase) == tuple(dict.fromkeys(walked))
        assert transitions_from(phase) == tuple(t for t in TRANSITIONS if t.source is phase and t.trigger != ABORT)
    for t in TRANSITIONS:  # the first of the table's transitions that a trigger fires from a phase
        assert transition_for(t.trigger, t.source) is next(
            u for u in TRANSITIONS if u.trigger == t.trigger and u.source is t.source)
    with pytest.raises(KeyError, match="no transition 'batch' from 'created'"):
        transition_for("batch", Phase.CREATED)


def test_every_phase_has_an_abort_route_and_train_end_is_final() -> None:
    sources = {t.source for t in TRANSITIONS if t.trigger == ABORT}
    assert sources == set(Phase) - {FINAL}
    assert not [t for t in TRANSITIONS if t.source is FINAL]


def test_design_moves_are_all_present() -> None:
    moves = {(t.source.value, t.dest.value, t.trigger) for t in TRANSITIONS}
    expected = {
        ("created", "train_begin", "begin"),
        ("train_begin", "epoch_begin", "start_epoch"),
        ("epoch_begin", "train_step", "batch"),
        ("train_step", "train_step", "batch"),
        ("train_step", "val", "validate"),
        ("epoch_begin", "val", "validate"),
        ("val", "epoch_end", "end_epoch"),
        ("epoch_end", "epoch_begin", "next_epoch"),
        ("epoch_end", "train_end", "finish"),
        ("train_begin", "train_end", "finish"),
        ("train_step", "train_end", "stop_now"),
        ("val", "train_end", "stop_now"),
    }
    assert expected <= moves
    assert ("train_step", "epoch_end", "validate") not in moves


def test_dropping_a_transition_is_caught() -> None:
    broken = tuple(t for t in TRANSITIONS if t.trigger != "end_epoch")
    with pytest.raises(LifecycleError, match=r"unreachable|no transition|enabled none"):
        check_table(broken)


def test_overlapping_guards_are_caught() -> None:
    # A second way out of epoch_end that is enabled together with next_epoch.
    extra = Transition("finish_early", Phase.EPOCH_END, Phase.TRAIN_END, conditions=(Guard.CAN_CONTINUE,))
    with pytest.raises(LifecycleError, match=r"enabled next_epoch->epoch_begin, finish_early->train_end"):
        check_table((*TRANSITIONS, extra))


def test_a_table_that_can_only_end_by_abort_is_caught() -> None:
    no_way_out = tuple(t for t in TRANSITIONS if t.trigger not in ("finish", "stop_now"))
    with pytest.raises(LifecycleError, match="phase 'epoch_end' cannot reach 'train_end'"):
        check_table(no_way_out)


def test_hook_naming_an_unknown_trigger_is_caught() -> None:
    bad = (*PROGRAM, dataclasses.replace(HOOKS[0], name="on_weird", trigger="no_such_trigger"))
    with pytest.raises(LifecycleError, match="'on_weird' is bound to 'no_such_trigger'"):
        check_table(TRANSITIONS, bad)


@pytest.mark.parametrize(
    ("phase", "facts", "trigger"),
    [
        (Phase.TRAIN_BEGIN, Facts(False, False, True, False, False), "start_epoch"),
        (Phase.TRAIN_BEGIN, Facts(False, False, False, False, False), "finish"),
        (Phase.TRAIN_STEP, Facts(False, False, True, True, False), "batch"),
        (Phase.TRAIN_STEP, Facts(False, False, True, False, False), "validate"),
        (Phase.TRAIN_STEP, Facts(True, True, True, True, False), "stop_now"),
        (Phase.VAL, Facts(True, False, True, False, False), "end_epoch"),
        (Phase.EPOCH_END, Facts(True, False, True, False, False), "finish"),
        (Phase.EPOCH_END, Facts(False, False, True, False, False), "next_epoch"),
    ],
)
def test_enabled_transition(phase: Phase, facts: Facts, trigger: str) -> None:
    assert enabled_transition(phase, facts).trigger == trigger


def test_real_transitions_machine_refuses_illegal_and_guarded_moves() -> None:
    class Model:
        state: str

    facts = {"stop": False, "batch": True}
    guards = {
        Guard.CAN_CONTINUE: lambda: not facts["stop"],
        Guard.HAS_BATCH: lambda: facts["batch"],
        Guard.IMMEDIATE_STOP: lambda: facts["stop"],
        Guard.FAULTED: lambda: False,
        Guard.VAL_DUE: lambda: False,
    }
    m = Model()
    fired: list[str] = []
    handlers = [lambda t=t: fired.append(f"{t.trigger}:{t.dest.value}") for t in TRANSITIONS]
    build_machine(m, guards, handlers)
    assert m.state == INITIAL.value
    with pytest.raises(MachineError):
        m.trigger("validate")  # type: ignore[attr-defined]  # not legal from created
    assert m.trigger("begin")  # type: ignore[attr-defined]
    assert m.trigger("start_epoch")  # type: ignore[attr-defined]
    assert m.trigger("batch")  # type: ignore[attr-defined]
    assert m.state == "train_step"
    assert m.trigger("batch")  # type: ignore[attr-defined]  # internal: stays
    assert m.state == "train_step"
    assert not m.trigger("validate")  # type: ignore[attr-defined]  # guard: a batch is still there
    assert not m.trigger("abort")  # type: ignore[attr-defined]  # guard: not faulted
    facts["stop"] = True
    assert m.trigger("stop_now")  # type: ignore[attr-defined]
    assert m.state == "train_end"
    # each fired transition ran its own handler, once; refused triggers ran none
    assert fired == ["begin:train_begin", "start_epoch:epoch_begin", "batch:train_step", "batch:train_step",
                     "stop_now:train_end"]


def test_hooks_cover_the_base_class() -> None:
    from fsmtrain.core.hooks import TrainingCallback

    for name in HOOK_NAMES:
        assert callable(getattr(TrainingCallback, name))
