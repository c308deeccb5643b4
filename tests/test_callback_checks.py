"""Callback mistakes caught when the runner is built (hook names, hook signatures, data flow over
every epoch hook) and at the ``set`` call (a slot the callback did not declare)."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from core_helpers import make_trainer

from fsmtrain import (
    CallbackDefinitionError,
    CallbackOrderError,
    CallbackRunner,
    Slot,
    SlotWriteError,
    StopReason,
    TrainingCallback,
)
from fsmtrain.callbacks import GradientMonitorCallback, WandbLoggingCallback
from fsmtrain.core.checks import hook_hint, suggest_hook
from fsmtrain.core.context import CheckpointContext, EpochContext, RunContext
from fsmtrain.core.driver import BaseDriver
from fsmtrain.core.engine import Engine
from fsmtrain.core.events import EventLog
from fsmtrain.core.lifecycle import HOOKS

# --- hook names -----------------------------------------------------------------------------------


class Misspelt(TrainingCallback):
    def on_validation_end(self, epoch: EpochContext) -> None: ...


def test_a_misspelt_hook_is_refused_with_a_suggestion() -> None:
    with pytest.raises(CallbackDefinitionError) as info:
        CallbackRunner([Misspelt()], include_global=False)
    assert str(info.value) == (
        "Misspelt.on_validation_end is not a hook and would never be called: did you mean on_val_end? "
        "(rename a helper so it does not start with 'on_', e.g. _on_validation_end)")


@pytest.mark.parametrize(("name", "meant"), [
    ("on_validation_end", "on_val_end"), ("on_train_start", "on_train_begin"), ("on_epoch_ended", "on_epoch_end"),
    ("on_fit_end", "on_train_end"), ("on_val_start", "on_val_begin"), ("on_exceptions", "on_exception"),
])
def test_suggestions(name: str, meant: str) -> None:
    assert suggest_hook(name) == meant


def test_a_name_far_from_every_hook_lists_the_hooks() -> None:
    class Odd(TrainingCallback):
        def on_gpu(self) -> None: ...

    with pytest.raises(CallbackDefinitionError, match=r"Odd.on_gpu is not a hook .*: hooks are: on_train_begin, "):
        CallbackRunner([Odd()], include_global=False)


def test_non_callable_on_attributes_and_inherited_hooks_are_fine() -> None:
    class Base(TrainingCallback):
        def on_epoch_end(self, epoch: EpochContext) -> None: ...

    class Child(Base):
        on_gpu = False  # a flag, not a method

    CallbackRunner([Child()], include_global=False)


def test_a_hook_assigned_on_the_instance_is_refused() -> None:
    cb = TrainingCallback()
    cb.on_val_end = lambda epoch: None  # type: ignore[method-assign]
    with pytest.raises(CallbackDefinitionError, match=r"TrainingCallback.on_val_end is assigned on the instance"):
        CallbackRunner([cb], include_global=False)


# --- hook signatures ------------------------------------------------------------------------------


class SeedStyle(TrainingCallback):
    """The seed document's hook: several positional arguments and **kwargs."""

    def on_val_end(self, trainer, epoch, val_loss, metrics, **kwargs):  # type: ignore[override]
        return None


class SeedTrainEnd(TrainingCallback):
    def on_train_end(self, trainer, **kw):  # type: ignore[override]
        return None


def test_a_seed_style_signature_is_refused_with_the_typed_hint() -> None:
    with pytest.raises(CallbackDefinitionError) as info:
        CallbackRunner([SeedStyle()], include_global=False)
    assert str(info.value) == (
        "SeedStyle.on_val_end(self, trainer, epoch, val_loss, metrics, **kwargs) must take exactly one context "
        "argument: on_val_end(self, epoch: EpochContext)")


def test_kwargs_do_not_make_a_one_argument_hook_acceptable() -> None:
    with pytest.raises(CallbackDefinitionError) as info:
        CallbackRunner([SeedTrainEnd()], include_global=False)
    assert str(info.value) == ("SeedTrainEnd.on_train_end(self, trainer, **kw) must take exactly one context "
                               "argument: on_train_end(self, run: RunContext)")


@pytest.mark.parametrize("body", [
    "def on_val_end(self): ...",
    "def on_val_end(self, *args): ...",
    "def on_val_end(self, epoch, **kwargs): ...",
    "def on_val_end(self, epoch, extra=1): ...",
    "def on_val_end(self, *, epoch): ...",
])
def test_every_other_shape_is_refused(body: str) -> None:
    namespace: dict[str, Any] = {}
    exec(body, namespace)
    cls = type("Shape", (TrainingCallback,), {"on_val_end": namespace["on_val_end"]})
    with pytest.raises(CallbackDefinitionError, match=r"on_val_end\(self, epoch: EpochContext\)$"):
        CallbackRunner([cls()], include_global=False)


def test_any_parameter_name_and_a_staticmethod_are_fine() -> None:
    class Fine(TrainingCallback):
        def on_val_end(self, e: EpochContext) -> None: ...

        @staticmethod
        def on_train_begin(run: RunContext) -> None: ...

        def on_save_checkpoint(self, ckpt: CheckpointContext, /) -> None: ...

    CallbackRunner([Fine()], include_global=False)


def test_hints_name_the_context_type_each_hook_receives() -> None:
    # The hint is derived from the hook's scope in lifecycle.HOOKS; the base class's annotations are
    # what the runner really passes, so the two must agree for every hook.
    for spec in HOOKS:
        (param,) = inspect.signature(getattr(TrainingCallback(), spec.name)).parameters.values()
        assert hook_hint(spec.name) == f"{spec.name}(self, {spec.scope.value}: {param.annotation})"
    assert hook_hint("on_val_end") == "on_val_end(self, epoch: EpochContext)"


# --- undeclared slot writes -----------------------------------------------------------------------

MINE: Slot[float] = Slot("mine")
OTHER: Slot[float] = Slot("other")


class Sneaky(TrainingCallback):
    writes = (MINE,)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        epoch.set(MINE, 1.0)
        self._helper(epoch)

    def _helper(self, epoch: EpochContext) -> None:
        epoch.set(OTHER, 2.0)  # not declared


def test_an_undeclared_slot_write_fails_at_the_set_call() -> None:
    trainer = make_trainer(None, [Sneaky()], epochs=2)
    with pytest.raises(SlotWriteError) as info:
        trainer.fit()
    assert str(info.value) == (
        "Sneaky.on_epoch_end wrote slot 'other', which Sneaky does not declare in `writes` (declared: 'mine'); "
        "add it, e.g. writes = (..., Slot('other')), so the runner can order its readers after Sneaky")
    # raised by the set call itself, inside the callback, before the value landed
    frames = traceback.extract_tb(info.value.__traceback__)
    user = [f for f in frames if f.filename == __file__]
    assert user[-1].name == "_helper" and "epoch.set(OTHER" in (user[-1].line or "")
    assert frames[-1].name == "check_write"
    result = trainer.engine.result
    assert result is not None and result.stop_reason is StopReason.ERROR
    assert "other" not in trainer.run.slot_values()


def test_declared_writes_and_writes_outside_any_hook_pass() -> None:
    class Honest(TrainingCallback):
        writes = (MINE,)

        def on_val_end(self, epoch: EpochContext) -> None:
            epoch.set(MINE, float(epoch.index))

    result = make_trainer(None, [Honest()], epochs=2).fit()
    assert [r.slots["mine"] for r in result.history] == [0.0, 1.0]


def test_a_nested_dispatch_gives_the_outer_callback_back_its_guard() -> None:
    class Outer(TrainingCallback):
        priority = 10

        def on_epoch_end(self, epoch: EpochContext) -> None:
            epoch.run.dispatch("on_save_checkpoint", CheckpointContext(epoch.run, {}))
            epoch.set(OTHER, 1.0)  # not declared: still Outer's write after the nested hooks ran

    class Saver(TrainingCallback):
        writes = (OTHER,)

        def on_save_checkpoint(self, ckpt: CheckpointContext) -> None:
            ckpt.run.set(OTHER, 0.5)  # declared by Saver: fine

    with pytest.raises(SlotWriteError, match=r"^Outer.on_epoch_end wrote slot 'other'"):
        make_trainer(None, [Outer(), Saver()], epochs=1).fit()


# --- data flow over every epoch hook --------------------------------------------------------------

GRAD: Slot[float] = Slot("grad")


class EpochEndWriter(TrainingCallback):
    writes = (GRAD,)

    def __init__(self, priority: int) -> None:
        self.priority = priority

    def on_epoch_end(self, epoch: EpochContext) -> None:
        epoch.set(GRAD, 1.0)


class ValEndReader(TrainingCallback):
    """Reads in on_val_end, and also overrides on_epoch_end (the case the last-hook rule missed)."""

    reads = (GRAD,)

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.seen: list[float | None] = []

    def on_val_end(self, epoch: EpochContext) -> None:
        self.seen.append(epoch.get(GRAD))

    def on_epoch_end(self, epoch: EpochContext) -> None:
        return None


@pytest.mark.parametrize("reader_priority", [30, 10])
def test_a_reader_is_judged_by_its_earliest_epoch_hook(reader_priority: int) -> None:
    with pytest.raises(CallbackOrderError) as info:
        CallbackRunner([EpochEndWriter(20), ValEndReader(reader_priority)], include_global=False)
    assert str(info.value) == (
        "callback order breaks the data flow:\n"
        f"  ValEndReader (priority {reader_priority}) reads slot 'grad' in on_val_end, which runs before its writer "
        "EpochEndWriter (priority 20) may write it in on_epoch_end (every epoch hook a callback overrides counts as "
        "a place where it may read or write); read it only in on_epoch_end with a priority above 20 (or a later "
        "hook), moving or splitting off ValEndReader's earlier epoch hooks, or have EpochEndWriter write it before "
        "on_val_end")


class _OneBatch(BaseDriver):
    """The smallest driver: one no-op batch and fixed losses per epoch."""

    def epoch_batches(self, epoch: EpochContext) -> Iterator[Any]: return iter([None])
    def end_train(self, epoch: EpochContext) -> dict[str, float]: return {"train_loss": 1.0}
    def end_validation(self, epoch: EpochContext) -> dict[str, float]: return {"val_loss": 1.0}


def test_control_the_refused_order_reads_none_every_epoch() -> None:
    reader = ValEndReader(30)
    runner = CallbackRunner([EpochEndWriter(20), reader], include_global=False, validate=False)
    run = RunContext("x", 2, EventLog(None, "x", keep=True, console=None))
    Engine(_OneBatch(), runner, run).execute()
    assert reader.seen == [None, None]  # the writer wrote after the read, and slots clear each epoch


def test_a_writer_is_judged_by_its_latest_epoch_hook() -> None:
    class ResetThenWrite(EpochEndWriter):  # overrides an early hook, writes only at epoch end
        def on_train_epoch_begin(self, epoch: EpochContext) -> None: ...

    class LateReader(ValEndReader):
        pass

    with pytest.raises(CallbackOrderError, match=r"LateReader \(priority 90\) reads slot 'grad' in on_val_end"):
        CallbackRunner([ResetThenWrite(20), LateReader(90)], include_global=False)


def test_a_reader_after_the_writers_last_hook_passes() -> None:
    class EpochEndReader(TrainingCallback):
        reads = (GRAD,)
        priority = 30

        def on_epoch_end(self, epoch: EpochContext) -> None: ...

    CallbackRunner([EpochEndWriter(20), EpochEndReader()], include_global=False)


def test_a_logger_of_every_slot_refuses_a_writer_ordered_after_it(tmp_path: Any) -> None:
    class LateWriter(EpochEndWriter):
        pass

    with pytest.raises(CallbackOrderError) as info:
        CallbackRunner([GradientMonitorCallback(), WandbLoggingCallback(directory=tmp_path), LateWriter(85)],
                       include_global=False)
    assert ("WandbLoggingCallback (priority 80) reads slot 'grad' (it reads every slot) in on_epoch_end, but its "
            "writer LateWriter (priority 85) only writes it in on_epoch_end") in str(info.value)
    CallbackRunner([GradientMonitorCallback(), WandbLoggingCallback(directory=tmp_path), LateWriter(79)],
                   include_global=False)
