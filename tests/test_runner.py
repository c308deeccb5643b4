"""Callback ordering, global registration, dispatch tables and data-flow validation."""

from __future__ import annotations

from typing import ClassVar

import pytest
from core_helpers import make_trainer

from fsmtrain import CallbackOrderError, CallbackRunner, Slot, Tier, TrainingCallback, register_global_callback
from fsmtrain.core.context import EpochContext, RunContext

ORDER: list[str] = []


class Named(TrainingCallback):
    def __init__(self, label: str, priority: int = 50) -> None:
        self.label = label
        self.priority = priority

    def on_train_begin(self, run: RunContext) -> None:
        ORDER.append(self.label)


class CoreNamed(Named):
    tier: ClassVar[Tier] = Tier.CORE


@pytest.fixture(autouse=True)
def _clear() -> None:
    ORDER.clear()


def test_priority_then_tier_then_registration() -> None:
    user_a, user_b = Named("user_a", 10), Named("user_b", 10)
    core = CoreNamed("core", 10)
    early = Named("early", 1)
    glob = Named("global", 10)
    handle = register_global_callback(glob)
    try:
        runner = CallbackRunner([user_a, user_b, early, core])
    finally:
        handle.remove()
    assert [cb.label for cb in runner.callbacks] == ["early", "core", "user_a", "user_b", "global"]  # type: ignore[attr-defined]
    runner.fire("on_train_begin", None)
    assert ORDER == ["early", "core", "user_a", "user_b", "global"]


def test_global_callback_by_handle_and_by_with() -> None:
    glob = Named("g", 0)
    handle = register_global_callback(glob)
    assert handle.active
    make_trainer(None, epochs=1).fit()
    assert ORDER == ["g"]
    handle.remove()
    assert not handle.active
    make_trainer(None, epochs=1).fit()
    assert ORDER == ["g"]  # removed: not called again

    with Named("w", 0) as cb:
        trainer = make_trainer(None, epochs=1)
        # the run gets its own copy of the registered instance, never the instance itself
        assert cb not in trainer.callbacks and [c.label for c in trainer.callbacks] == ["w"]
        trainer.fit()
    assert ORDER == ["g", "w"]
    assert all(c.name != "Named" for c in make_trainer(None, epochs=1).callbacks)


def test_same_instance_local_and_global_runs_once() -> None:
    cb = Named("once", 0)
    with cb:
        runner = CallbackRunner([cb])
    assert runner.callbacks == (cb,)


def test_unoverridden_hooks_are_not_dispatched() -> None:
    runner = CallbackRunner([Named("x")])
    assert runner.has("on_train_begin")
    assert runner.table("on_after_backward") == ()
    assert runner.describe()[0]["hooks"] == ["on_train_begin"]


GRAD: Slot[float] = Slot("grad")


class Writer(TrainingCallback):
    writes = (GRAD,)

    def __init__(self, priority: int, value: float = 3.0) -> None:
        self.priority = priority
        self.value = value

    def on_epoch_end(self, epoch: EpochContext) -> None:
        epoch.set(GRAD, self.value)


class Reader(TrainingCallback):
    reads = (GRAD,)

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.seen: list[float | None] = []

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self.seen.append(epoch.get(GRAD))


def test_consumer_before_producer_is_refused_with_names_priorities_hook_and_slot() -> None:
    with pytest.raises(CallbackOrderError) as info:
        CallbackRunner([Writer(20), Reader(10)])
    msg = str(info.value)
    for part in ("Reader (priority 10)", "Writer (priority 20)", "'grad'", "on_epoch_end"):
        assert part in msg


def test_reader_on_a_later_hook_may_have_lower_priority() -> None:
    class EarlyWriter(TrainingCallback):
        writes = (GRAD,)
        priority = 90

        def on_val_end(self, epoch: EpochContext) -> None:
            epoch.set(GRAD, 1.0)

    CallbackRunner([EarlyWriter(), Reader(10)])  # val_end comes before epoch_end: fine


def test_producer_then_consumer_works_and_absent_producer_gives_none() -> None:
    reader = Reader(60)
    make_trainer(None, [Writer(40, 7.0), reader], epochs=2).fit()
    assert reader.seen == [7.0, 7.0]
    alone = Reader(60)
    make_trainer(None, [alone], epochs=2).fit()
    assert alone.seen == [None, None]


def test_epoch_slots_are_cleared_each_epoch() -> None:
    class OnceWriter(Writer):
        def on_epoch_end(self, epoch: EpochContext) -> None:
            if epoch.index == 0:
                epoch.set(GRAD, 5.0)

    reader = Reader(60)
    result = make_trainer(None, [OnceWriter(40), reader], epochs=2).fit()
    assert reader.seen == [5.0, None]
    assert result.history[0].slots == {"grad": 5.0} and result.history[1].slots == {}
