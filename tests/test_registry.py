"""The global registry: locked, no re-entry, and no state carried from one run into the next
(every run gets its own copy of a registered instance, or a factory's fresh product), and a
local callback instance serves one Trainer only."""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import tiny_model, tiny_task
from torch import nn

from fsmtrain import (
    CallbackRunner,
    GlobalRegistrationError,
    StopReason,
    Trainer,
    TrainingCallback,
    TrainResult,
    register_global_callback,
)
from fsmtrain.callbacks import EarlyStoppingCallback
from fsmtrain.core.context import EpochContext, Slot
from fsmtrain.core.hooks import CallbackBoundError, bind_callbacks, unbind_callbacks
from fsmtrain.core.registry import global_callbacks


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


def _build_runners_while(work: Callable[[threading.Event], None], readers: int = 4) -> list[str]:
    """Threads build runners (``CallbackRunner([])``, the run's view of the registry, as a Trainer
    builds it) for as long as ``work`` runs in another, switching threads far more often than the
    default 5 ms; the full traceback of whatever any of them raised. ``work`` gets an event set on
    the first failure, to stop early."""
    errors: list[str] = []
    done, failed = threading.Event(), threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                CallbackRunner([])
        except BaseException:
            errors.append(traceback.format_exc())
            failed.set()

    def write() -> None:
        try:
            work(failed)
        except BaseException:
            errors.append(traceback.format_exc())
        finally:
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=read) for _ in range(readers)] + [threading.Thread(target=write)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    return errors


def _register_and_remove(callback: TrainingCallback, failed: threading.Event) -> None:
    register_global_callback(callback).remove()


@pytest.mark.timeout(120)
def test_runners_built_while_a_callback_class_is_first_copied_check_it_without_errors() -> None:
    """A runner's check of its callbacks walks their classes' ``__dict__`` while another thread may be
    deep-copying a first instance of that class, which makes Python store ``__slotnames__`` there
    (copyreg): the check must not fail with 'dictionary changed size during iteration'. The test above
    races that once per process (one class, copied once); here each round has a new class, with many
    attributes so the walk is long (an unguarded walk fails in about 1 round in 60)."""
    deadline = time.monotonic() + 3
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        wide = type("Wide", (Plain,), {f"attr_{i}": i for i in range(200)})
        with register_global_callback(wide):  # so the runners hold a Wide: they walk vars(Wide)
            errors = _build_runners_while(functools.partial(_register_and_remove, wide()))  # its first copy
        assert errors == [], f"round {rounds}:\n" + "\n".join(errors)


class _Wide(Plain):
    """A callback instance with many attributes: a deep copy of it walks them for a while."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(200):
            setattr(self, f"attr_{i}", i)


@pytest.mark.timeout(120)
def test_runners_built_while_registered_instances_change_copy_them_without_errors() -> None:
    """A registered instance changes after registration (``with cb:`` sets its handle on it; a Trainer
    given it as a local callback binds it, and unbinds it if its construction fails), while runners
    are built in other threads: a run copies the registry's own copy of the instance, taken at
    registration, which nothing else holds, so no copy fails with 'dictionary changed size during
    iteration'."""
    deadline = time.monotonic() + 3
    blocks = 0

    def change_registered(failed: threading.Event) -> None:
        nonlocal blocks
        while time.monotonic() < deadline and not failed.is_set():
            with _Wide() as cb:  # a fresh instance: its first handle is a new attribute
                blocks += 1
                for _ in range(50):
                    unbind_callbacks([cb], bind_callbacks([cb]))  # as Trainer(..., callbacks=[cb]) that failed

    errors = _build_runners_while(change_registered)
    assert errors == [], f"in with-block {blocks}:\n" + "\n".join(errors)
    assert blocks > 0


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


def test_a_registered_instance_with_state_is_a_prototype_every_run_copies() -> None:
    """The rule "stateful means overrides state_dict" is gone: any instance may be registered, and
    each run gets a deep copy of it, so the registered instance itself is never run."""
    prototype = EarlyStoppingCallback(patience=3)
    with register_global_callback(prototype):
        first, second = CallbackRunner([]), CallbackRunner([])
    (a,), (b,) = first.callbacks, second.callbacks
    assert isinstance(a, EarlyStoppingCallback) and a.patience == 3
    assert len({id(prototype), id(a), id(b)}) == 3
    assert first.describe()[0]["tier"] == "global"


def test_a_run_copies_the_instance_as_it_was_registered() -> None:
    """Runs copy the registry's own copy, taken at registration: a change made to the instance
    afterwards (in any thread) reaches no run."""
    prototype = EarlyStoppingCallback(patience=3)
    with register_global_callback(prototype):
        prototype.patience = 1
        (copy,) = CallbackRunner([]).callbacks
    assert isinstance(copy, EarlyStoppingCallback) and copy.patience == 3
    assert not hasattr(copy, "_global_handle")


def test_an_instance_that_cannot_be_copied_is_refused_with_the_factory_form_in_the_message() -> None:
    class HoldsALock(Plain):
        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(GlobalRegistrationError) as info:
        register_global_callback(HoldsALock())
    msg = str(info.value)
    assert msg.startswith("HoldsALock cannot be copied for each run (TypeError:")
    assert "register_global_callback(HoldsALock, <its arguments>)" in msg


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


def test_a_registered_instance_run_as_a_local_callback_hands_its_state_to_no_other_run() -> None:
    """A registered instance that a Trainer also got as a local callback runs as that local one, on
    the instance itself; the next run's global copy is made from the registered state, not from the
    state that run left (``wait`` 3, which would stop it after one epoch)."""
    prototype = EarlyStoppingCallback(patience=3)
    with register_global_callback(prototype):
        local, _ = _plateau_run([prototype])
        assert prototype.wait == 3  # the local run ran the instance itself
        other, t = _plateau_run([])
    assert local.epochs_completed == other.epochs_completed == 4
    (copy,) = [cb for cb in t.callbacks if isinstance(cb, EarlyStoppingCallback)]
    assert copy is not prototype


def test_one_local_instance_given_to_a_second_trainer_is_refused_naming_the_fix() -> None:
    """One local instance passed to a second Trainer is refused: it would carry run A's state into
    run B (an early stop after one epoch)."""
    shared = EarlyStoppingCallback(patience=3)
    first, _ = _plateau_run([shared])
    assert first.epochs_completed == 4
    assert shared.wait == 3  # the state a second run would have started from
    with pytest.raises(CallbackBoundError) as info:
        _plateau_run([shared])
    msg = str(info.value)
    assert msg.startswith("EarlyStoppingCallback: this callback instance already belongs to another Trainer")
    assert "give each Trainer its own instance (Trainer(..., callbacks=[EarlyStoppingCallback(...)]))" in msg
    second, _ = _plateau_run([EarlyStoppingCallback(patience=3)])  # the fix the message names
    assert second.epochs_completed == 4


def test_a_trainer_whose_constructor_failed_leaves_its_callbacks_free() -> None:
    mine = EarlyStoppingCallback(patience=3)
    model = tiny_model(0)
    train, val = tiny_task(0)
    with pytest.raises(ValueError, match="metrics named val_loss"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), train, val, max_epochs=2,
                callbacks=[mine], metrics={"val_loss": lambda p, t: p.sum()}, default_callbacks=False)
    result, _ = _plateau_run([mine])  # not refused: the failed Trainer never ran it
    assert result.epochs_completed == 4


BEST = Slot[float]("best_val_loss")


class BestLossTracker(TrainingCallback):
    """The seed's callback: the best val loss so far in a plain attribute (no state_dict), reported
    every epoch."""

    writes = (BEST,)

    def __init__(self) -> None:
        self.best = math.inf

    def on_val_end(self, epoch: EpochContext) -> None:
        self.best = min(self.best, epoch.metrics["val_loss"])
        epoch.set(BEST, self.best)


def _run_at(lr: float) -> TrainResult:
    torch.set_num_threads(1)
    model = tiny_model(0)
    train, val = tiny_task(0)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), nn.MSELoss(), train, val, max_epochs=3,
                   console_level="error", default_callbacks=False).fit()


def test_a_registered_callback_with_plain_attributes_carries_nothing_into_the_next_run() -> None:
    """A BestLossTracker registered globally reports each run's own best, never the previous run's."""
    prototype = BestLossTracker()
    with register_global_callback(prototype):
        a = _run_at(0.05)  # learns: a low best
        b = _run_at(0.0)  # lr 0: stays where it started, well above run A's best
    best_a = min(r.metrics["val_loss"] for r in a.history)
    best_b = min(r.metrics["val_loss"] for r in b.history)
    assert best_a < best_b
    assert a.history[-1].slots["best_val_loss"] == best_a
    assert b.history[-1].slots["best_val_loss"] == best_b  # its own best, not run A's
    assert prototype.best == math.inf  # the registered instance was never run


def _snapshot(cb: TrainingCallback) -> dict[str, str]:
    return {k: repr(v) for k, v in vars(cb).items()}


@pytest.mark.timeout(120)
def test_built_ins_holding_per_run_state_are_copied_for_every_run(tmp_path: Path) -> None:
    """GradientMonitor, W&B, ProgressBar and EpochSummary hold per-run state: registered globally,
    each run gets its own copy and the registered instance is never touched by a run."""
    from fsmtrain.callbacks import (
        EpochSummaryCallback,
        GradientMonitorCallback,
        ProgressBarCallback,
        WandbLoggingCallback,
    )

    prototypes: list[TrainingCallback] = [
        GradientMonitorCallback(), WandbLoggingCallback(mode="disabled", directory=tmp_path),
        ProgressBarCallback(enabled=True), EpochSummaryCallback()]
    before = [_snapshot(cb) for cb in prototypes]
    handles = [register_global_callback(cb) for cb in prototypes]
    try:
        runs = [_plateau_run([]) for _ in range(2)]
    finally:
        for handle in handles:
            handle.remove()
    assert [_snapshot(cb) for cb in prototypes] == before
    for cb in prototypes:
        copies = [next(c for c in t.callbacks if type(c) is type(cb)) for _, t in runs]
        assert copies[0] is not copies[1] and cb not in copies
    grads = [next(c for c in t.callbacks if isinstance(c, GradientMonitorCallback)) for _, t in runs]
    assert all(g._params for g in grads)  # each copy did run
