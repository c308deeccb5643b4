"""Property: for any schedule of stop requests and faults, the engine ends in train_end exactly
once, moves only along the table, and reports the reason and epoch count the schedule implies."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.driver import BaseDriver
from fsmtrain.core.engine import Engine, Interrupted
from fsmtrain.core.events import EventLog
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.lifecycle import TRANSITIONS, Phase
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.core.stop import StopReason

LEGAL = {(t.source.value, t.dest.value, t.trigger) for t in TRANSITIONS}
HOOKS = ("on_train_epoch_begin", "on_train_step_end", "on_val_end", "on_epoch_end")


class ListDriver(BaseDriver):
    """Numbers from lists: no torch, the same engine."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def current_lr(self) -> float | None:
        return 0.1

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]:
        return iter(range(self.batches))

    def end_train(self, epoch: EpochContext) -> dict[str, float]:
        return {"train_loss": 1.0 / (epoch.index + 1)}

    def end_validation(self, epoch: EpochContext) -> dict[str, float]:
        return {"val_loss": 2.0 / (epoch.index + 1)}



class Action(Exception):
    pass


class Scripted(TrainingCallback):
    def __init__(self, hook: str, epoch: int, batch: int, kind: str) -> None:
        self.hook, self.at_epoch, self.at_batch, self.kind = hook, epoch, batch, kind
        self.ends = 0
        self.faults = 0
        self.fired = False

    def _act(self, hook: str, epoch: int, batch: int, ctx: Any) -> None:
        if self.fired or (hook, epoch) != (self.hook, self.at_epoch) or batch != self.at_batch:
            return
        self.fired = True
        if self.kind == "error":
            raise Action("scripted")
        if self.kind == "interrupt":
            raise KeyboardInterrupt
        ctx.request_stop(StopReason.EARLY_STOP, "scripted", immediate=self.kind == "immediate")

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self._act("on_train_epoch_begin", epoch.index, 0, epoch)

    def on_train_step_end(self, step: StepContext) -> None:
        self._act("on_train_step_end", step.epoch.index, step.batch_index, step)

    def on_val_end(self, epoch: EpochContext) -> None:
        self._act("on_val_end", epoch.index, 0, epoch)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self._act("on_epoch_end", epoch.index, 0, epoch)

    def on_exception(self, fault: Any) -> None:
        self.faults += 1

    def on_train_end(self, run: RunContext) -> None:
        self.ends += 1


@settings(max_examples=300, deadline=None)
@given(
    max_epochs=st.integers(0, 4),
    batches=st.integers(1, 3),
    hook=st.sampled_from(HOOKS),
    at_epoch=st.integers(0, 4),
    at_batch=st.integers(0, 2),
    kind=st.sampled_from(["normal", "immediate", "error", "interrupt"]),
    strict=st.booleans(),
)
def test_any_schedule_ends_once_along_the_table(
    max_epochs: int, batches: int, hook: str, at_epoch: int, at_batch: int, kind: str, strict: bool
) -> None:
    log = EventLog(None, "p", console=None, keep=True, level="debug")
    cb = Scripted(hook, at_epoch, at_batch if hook == "on_train_step_end" else 0, kind)
    run = RunContext("p", max_epochs, log)
    engine = Engine(ListDriver(batches), CallbackRunner([cb]), run, strict=strict)
    raised: BaseException | None = None
    try:
        engine.execute()
    except (Action, KeyboardInterrupt) as exc:
        raised = exc
    assert log.records is not None
    moves = [(e["from"], e["to"], e["trigger"]) for e in log.records if e["event"] == "transition"]
    assert all(m in LEGAL for m in moves)
    assert moves[0][0] == "created" and moves[-1][1] == "train_end"
    assert sum(1 for m in moves if m[1] == "train_end") == 1
    assert cb.ends == 1
    assert [e["event"] for e in log.records].count("result") == 1

    result = engine.result  # set on every path
    assert result is not None
    fires = cb.fired
    if not fires:
        assert raised is None and result.stop_reason is StopReason.COMPLETED
        assert result.epochs_completed == max_epochs
        return
    if kind in ("error", "interrupt"):
        assert raised is not None and cb.faults == 1
        assert result.stop_reason is (StopReason.ERROR if kind == "error" else StopReason.INTERRUPTED)
        assert result.epochs_completed == at_epoch  # the faulting epoch never completes
        return
    assert raised is None and result.stop_reason is StopReason.EARLY_STOP
    # A normal request completes its epoch; an immediate one completes it only when made in on_epoch_end.
    completes = kind == "normal" or hook == "on_epoch_end"
    assert result.epochs_completed == at_epoch + (1 if completes else 0)


def test_a_signal_between_the_facts_and_the_guards_waits_for_the_next_boundary() -> None:
    """A signal that arrives after the engine took the facts at epoch_begin and before the machine
    reads its guards waits for the next boundary: were the guard to see it and fire ``stop_now``
    while the facts did not, the run would die of a LifecycleError instead of ending INTERRUPTED.
    Here the signal lands in exactly that gap."""
    log = EventLog(None, "s", console=None, keep=True)
    run = RunContext("s", 3, log)
    engine = Engine(ListDriver(2), CallbackRunner([]), run)
    facts = engine.facts

    def facts_then_a_signal() -> Any:
        taken = facts()
        if run.epoch == 1 and engine.phase is Phase.EPOCH_BEGIN:
            run.pending_signal = signal.SIGTERM
        return taken

    engine.facts = facts_then_a_signal  # type: ignore[method-assign]
    with pytest.raises(Interrupted):
        engine.execute()
    assert engine.result is not None and engine.result.stop_reason is StopReason.INTERRUPTED
    assert log.records is not None
    assert not [e for e in log.records if e["event"] == "exception" and e["payload"]["type"] == "LifecycleError"]
    moves = [(e["from"], e["to"], e["trigger"]) for e in log.records if e["event"] == "transition"]
    assert moves[-1][1] == "train_end" and moves[-1][2] == "abort"  # the fault path, at the next boundary
