"""The global registry: locked, no re-entry, and no state carried from one run into the next
(stateful callbacks are registered as factories, called once per run)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from core_helpers import tiny_model, tiny_task
from torch import nn

from callbacks import EarlyStoppingCallback
from pipeline import (
    CallbackRunner,
    GlobalRegistrationError,
    StopReason,
    Trainer,
    TrainingCallback,
    TrainResult,
    register_global_callback,
)
from pipeline.core.context import EpochContext
from pipeline.core.registry import global_callbacks


class Plain(TrainingCallback):
    """Stateless: may be registered as an instance."""

    def on_epoch_end(self, epoch: EpochContext) -> None:
        return None


@pytest.fixture(autouse=True)
def _registry_left_empty() -> Any:
    assert global_callbacks() == []
    yield
    assert global_callbacks() == [], "a test leaked a global registration"


@pytest.mark.timeout(120)
def test_threads_register_remove_and_list_concurrently_without_errors() -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(10)
    churning = threading.Event()
    churning.set()

    def churn() -> None:
        try:
            start.wait()
            mine = Plain()
            for i in range(1000):
                # instances and factories alike; re-registering an instance after its removal is fine
                handle = register_global_callback(mine) if i % 2 else register_global_callback(Plain)
                assert handle.active
                handle.remove()
                assert not handle.active
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            start.wait()
            while churning.is_set():  # list for as long as the others churn
                global_callbacks()
                CallbackRunner([])  # builds the run's view of the registry, as Trainer does
        except BaseException as exc:
            errors.append(exc)

    # Switch threads far more often than the default 5 ms, so unlocked races would show (without the
    # lock, listing while others remove raised KeyError within a run of this test).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        churners = [threading.Thread(target=churn) for _ in range(8)]
        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in churners + readers:
            t.start()
        for t in churners:
            t.join(timeout=100)
        churning.clear()
        for t in readers:
            t.join(timeout=10)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in churners + readers)
    assert errors == []


def test_nested_with_of_one_callback_is_refused_and_the_outer_block_still_cleans_up() -> None:
    cb = Plain()
    with cb:
        with pytest.raises(GlobalRegistrationError) as info, cb:
            pass
        assert global_callbacks() == [cb]  # the refused inner block registered nothing
    msg = str(info.value)
    assert msg.startswith("Plain is already registered as a global callback")
    assert "nested `with cb:`" in msg and "remove it first or register another instance" in msg
    assert global_callbacks() == []


def test_registering_one_instance_twice_is_refused_until_it_is_removed() -> None:
    cb = Plain()
    handle = register_global_callback(cb)
    with pytest.raises(GlobalRegistrationError, match="Plain is already registered"):
        register_global_callback(cb)
    handle.remove()
    handle.remove()  # idempotent
    again = register_global_callback(cb)
    assert again.active and again.key != handle.key
    again.remove()


def test_a_stateful_instance_is_refused_with_the_factory_form_in_the_message() -> None:
    with pytest.raises(GlobalRegistrationError) as info:
        register_global_callback(EarlyStoppingCallback(patience=3))
    msg = str(info.value)
    assert "EarlyStoppingCallback keeps state (state_dict)" in msg
    assert "register_global_callback(EarlyStoppingCallback, <its arguments>)" in msg
    with pytest.raises(GlobalRegistrationError, match="register a factory"), EarlyStoppingCallback(patience=3):
        pass

    class NonEmptyState(Plain):  # claims to be stateless, but its state_dict() is not empty
        stateful = False

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 1}

    with pytest.raises(GlobalRegistrationError, match="NonEmptyState keeps state"):
        register_global_callback(NonEmptyState())


def test_factory_arguments_are_checked_at_registration() -> None:
    with pytest.raises(TypeError, match=r"register_global_callback\(EarlyStoppingCallback, \.\.\.\).*patince"):
        register_global_callback(EarlyStoppingCallback, patince=3)
    with pytest.raises(TypeError, match="is already an instance; arguments go with a factory"):
        register_global_callback(Plain(), 3)
    with pytest.raises(TypeError, match="int is not a TrainingCallback class"):
        register_global_callback(int)


def test_a_factory_returning_something_else_fails_when_the_runner_is_built() -> None:
    with register_global_callback(lambda: "nope"), pytest.raises(GlobalRegistrationError, match="returned str"):
        CallbackRunner([])


def test_a_factory_gives_each_runner_a_fresh_instance_in_the_global_tier() -> None:
    with register_global_callback(EarlyStoppingCallback, patience=3) as handle:
        assert handle.callback is None and handle.factory is EarlyStoppingCallback
        first, second = CallbackRunner([]), CallbackRunner([])
    (a,), (b,) = first.callbacks, second.callbacks
    assert isinstance(a, EarlyStoppingCallback) and isinstance(b, EarlyStoppingCallback)
    assert a is not b and a.patience == b.patience == 3
    assert first.describe()[0]["tier"] == "global"


def _plateau_run(callbacks: list[TrainingCallback]) -> tuple[TrainResult, Trainer]:
    """A real run whose val loss never improves (learning rate 0): patience decides the stop."""
    torch.set_num_threads(1)
    model = tiny_model(0)
    train, val = tiny_task(0)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), train, val,
                      max_epochs=10, callbacks=callbacks, console_level="error", default_callbacks=False)
    return trainer.fit(), trainer


def test_a_global_early_stopping_behaves_identically_in_two_consecutive_runs() -> None:
    with register_global_callback(EarlyStoppingCallback, patience=3):
        first, t1 = _plateau_run([])
        second, t2 = _plateau_run([])
    for result in (first, second):
        assert result.stop_reason is StopReason.EARLY_STOP
        assert result.epochs_completed == 4  # best at epoch index 0, then 3 without improvement
        assert result.stop is not None and result.stop.epoch == 3
    assert first.stop is not None and second.stop is not None
    assert (first.stop.source, first.stop.message) == (second.stop.source, second.stop.message)
    stoppers = [next(cb for cb in t.callbacks if isinstance(cb, EarlyStoppingCallback)) for t in (t1, t2)]
    assert stoppers[0] is not stoppers[1]


def test_control_one_shared_instance_does_carry_its_state_into_the_next_run() -> None:
    # What the registry's factory rule prevents: the same instance in two runs stops the second
    # after one epoch (the defect reported in issue 9).
    shared = EarlyStoppingCallback(patience=3)
    first, _ = _plateau_run([shared])
    second, _ = _plateau_run([shared])
    assert first.epochs_completed == 4
    assert second.epochs_completed == 1
