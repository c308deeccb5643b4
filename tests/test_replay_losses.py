"""Callbacks tested from loss curves alone, through the ``replay_losses`` pytest fixture (the
``pytest11`` plugin of the package): the real lifecycle machine and the real built-ins, no model."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any, cast

import pytest

from fsmtrain.callbacks import (
    CheckpointCallback,
    EarlyStoppingCallback,
    GradientMonitorCallback,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
    TrainingCallback,
    WandbLoggingCallback,
)
from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import ReplaySupport
from fsmtrain.core.slots import LOSS_PREDICTION, MAX_GRAD_NORM, OVERFIT_GAP_RATIO
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.replay import RecordedTrial, ReplayError, ReplayResult, TrialReport, compare_traces

Replay = Callable[..., ReplayResult]
NAN, INF = math.nan, math.inf


def flat_after(n_down: int, n_flat: int) -> list[float]:
    return [1.0 - 0.1 * i for i in range(n_down)] + [1.0 - 0.1 * (n_down - 1)] * n_flat


# --- early stopping -------------------------------------------------------------------------------
def test_early_stopping_stops_after_patience_epochs_without_improvement(replay_losses: Replay) -> None:
    val = flat_after(3, 10)  # best at epoch index 2, then flat
    res = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=4)], max_epochs=13)
    assert (res.stop_reason, res.stop_epoch, res.stopped_by) == (StopReason.EARLY_STOP, 7, "EarlyStoppingCallback")


def test_early_stopping_min_delta_is_relative(replay_losses: Replay) -> None:
    # 1.0 -> 0.995 is a 0.5% gain: an improvement at min_delta=1e-3, not at min_delta=1e-2.
    val = [1.0, 0.995, 0.99, 0.985, 0.98]
    loose = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=2, min_delta=1e-3)])
    strict = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=2, min_delta=1e-2)])
    assert loose.stop_reason is StopReason.COMPLETED
    assert (strict.stop_reason, strict.stop_epoch) == (StopReason.EARLY_STOP, 3)


def test_early_stopping_max_mode_and_negative_values(replay_losses: Replay) -> None:
    acc = [0.1, 0.5, 0.6, 0.6, 0.6, 0.6]
    res = replay_losses(train=acc, val=acc, metrics={"acc": acc},
                        callbacks=[EarlyStoppingCallback(patience=2, mode="max", monitor="acc")])
    assert (res.stop_reason, res.stop_epoch) == (StopReason.EARLY_STOP, 5)
    neg = [-1.0, -2.0, -3.0, -3.0, -3.0]  # improving means more negative in min mode
    res = replay_losses(train=neg, val=neg, callbacks=[EarlyStoppingCallback(patience=2)])
    assert (res.stop_reason, res.stop_epoch) == (StopReason.EARLY_STOP, 5)


def test_early_stopping_nan_never_improves_and_patience_counts_resets(replay_losses: Replay) -> None:
    val = [1.0, NAN, NAN, 0.5, NAN, NAN, NAN]
    res = replay_losses(train=[1.0] * 7, val=val, callbacks=[EarlyStoppingCallback(patience=3)])
    assert (res.stop_reason, res.stop_epoch) == (StopReason.EARLY_STOP, 7)


def test_early_stopping_missing_monitor_warns_once_and_never_stops(replay_losses: Replay) -> None:
    res = replay_losses(train=[1.0] * 6, val=[1.0] * 6, callbacks=[EarlyStoppingCallback(patience=1, monitor="f1")])
    assert res.stop_reason is StopReason.COMPLETED
    assert len(res.warnings("EarlyStoppingCallback")) == 1


# --- overfit detection ----------------------------------------------------------------------------
def test_overfit_flags_after_warmup_when_train_falls_and_val_rises(replay_losses: Replay) -> None:
    train = [1.0 - 0.05 * i for i in range(12)]
    val = [1.0 - 0.05 * i for i in range(6)] + [0.8 + 0.05 * i for i in range(6)]  # rises from index 6
    res = replay_losses(train=train, val=val, callbacks=[OverfitDetectionCallback(warmup_epochs=2, window_size=3)])
    ratios = [s.get(OVERFIT_GAP_RATIO.name) for s in res.slots]
    # val rises over index 5->6, 6->7, 7->8: the window of 3 changes diverges first at index 8
    assert [i for i, r in enumerate(ratios) if r is not None] == [8, 9, 10, 11]
    assert ratios[8] == pytest.approx(val[8] / train[8])
    assert len(res.warnings("OverfitDetectionCallback")) == 1  # warned once, flag is sticky
    assert res.stop_reason is StopReason.COMPLETED  # it never stops training


def test_overfit_window_one_fires_on_any_single_divergence_but_not_in_warmup(replay_losses: Replay) -> None:
    train = [5.0, 4.0, 3.0, 2.0, 1.0]
    val = [1.0, 2.0, 1.0, 2.0, 1.0]
    res = replay_losses(train=train, val=val, callbacks=[OverfitDetectionCallback(warmup_epochs=2, window_size=1)])
    assert [s.get(OVERFIT_GAP_RATIO.name) is not None for s in res.slots] == [False, False, False, True, False]


def test_overfit_flat_step_or_nan_breaks_the_streak(replay_losses: Replay) -> None:
    train = [5.0, 4.0, 3.0, 3.0, 2.0, 1.0, 0.5, 0.25]
    val = [1.0, 2.0, 3.0, 4.0, NAN, 6.0, 7.0, 8.0]
    res = replay_losses(train=train, val=val, callbacks=[OverfitDetectionCallback(warmup_epochs=0, window_size=2)])
    assert [s.get(OVERFIT_GAP_RATIO.name) is not None for s in res.slots] == [False, False, True, False, False,
                                                                             False, False, True]


# --- NaN detection --------------------------------------------------------------------------------
@pytest.mark.parametrize(("train", "val", "stop_epoch"), [
    ([1.0, 0.9, NAN, 0.7], [1.0, 0.9, 0.8, 0.7], 3),
    ([1.0, 0.9, 0.8, 0.7], [1.0, INF, 0.8, 0.7], 2),
    ([1.0, 0.9, 0.8, 0.7], [1.0, 0.9, 0.8, -INF], 4),
])
def test_nan_detection_stops_on_any_non_finite_loss(replay_losses: Replay, train: list[float], val: list[float],
                                                    stop_epoch: int) -> None:
    res = replay_losses(train=train, val=val, callbacks=[NaNDetectionCallback()], max_epochs=10)
    assert (res.stop_reason, res.stop_epoch) == (StopReason.NAN, stop_epoch)
    assert res.result is not None and res.result.objective == math.inf
    assert res.trace[-1]["payload"]["stop_reason"] == "nan"


def test_nan_detection_finite_run_completes(replay_losses: Replay) -> None:
    res = replay_losses(train=[1.0, 0.5], val=[1.0, 0.5], callbacks=[NaNDetectionCallback()])
    assert (res.stop_reason, res.stop_epoch) == (StopReason.COMPLETED, 2)


# --- loss prediction ------------------------------------------------------------------------------
def test_loss_prediction_none_before_epoch_10_then_extrapolates(replay_losses: Replay) -> None:
    val = [2.0 * math.exp(-0.1 * t) for t in range(15)]
    res = replay_losses(train=val, val=val, callbacks=[LossPredictionCallback(max_epochs=50)])
    preds = [s.get(LOSS_PREDICTION.name) for s in res.slots]
    assert all(p is None for p in preds[:10])
    last = preds[-1]
    assert last is not None and last.fit_ok
    assert last.predicted_loss == pytest.approx(2.0 * math.exp(-0.1 * 49), rel=1e-4)
    assert last.neg_log10 == pytest.approx(-math.log10(last.predicted_loss))


def test_loss_prediction_falls_back_to_last_val_loss(replay_losses: Replay) -> None:
    flat = [0.5] * 12
    res = replay_losses(train=flat, val=flat, callbacks=[LossPredictionCallback(max_epochs=100)])
    pred = res.slots[-1][LOSS_PREDICTION.name]
    assert (pred.fit_ok, pred.predicted_loss) == (False, 0.5)


# --- slots from dry callbacks, and the dry callbacks themselves -----------------------------------
def test_recorded_slots_reach_readers_and_dry_callbacks_record_intent(replay_losses: Replay, tmp_path: Any) -> None:
    val = [1.0, 0.8, 0.6]
    wandb_cb = WandbLoggingCallback()
    ckpt = CheckpointCallback(tmp_path / "ckpt", keep_last_k=1)
    res = replay_losses(train=val, val=val, lrs=[0.1, 0.05, 0.01], slots={"max_grad_norm": [3.0, 2.0, 1.0]},
                        callbacks=[wandb_cb, ckpt])
    assert [d["max_grad_norm"] for d in wandb_cb.logged] == [3.0, 2.0, 1.0]
    assert [d["lr"] for d in wandb_cb.logged] == [0.1, 0.05, 0.01]
    assert wandb_cb.wandb_run is None  # dry: nothing initialised or sent
    assert not any((tmp_path / "ckpt").glob("*.pt"))  # dry: no file written
    planned = [e["payload"]["kind"] for e in res.dry_events if e["event"] == "checkpoint_planned"]
    assert "best" in planned and "latest" in planned
    assert not res.events("checkpoint_planned")  # a dry callback's intent is kept out of the trace
    assert [s[MAX_GRAD_NORM.name] for s in res.slots] == [3.0, 2.0, 1.0]


# --- user callbacks (acceptance 4) ----------------------------------------------------------------
class StopBelow(TrainingCallback):
    """A user callback written with no thought of replay: stop once val loss is below a target."""

    priority = 60

    def __init__(self, target: float) -> None:
        self.target = target
        self.seen_lr: list[float | None] = []

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self.seen_lr.append(epoch.lr)

    def on_val_end(self, epoch: EpochContext) -> None:
        if (epoch.val_loss or math.inf) < self.target:
            epoch.request_stop(StopReason.EARLY_STOP, self.name, f"val loss below {self.target}")


class NeedsTheModel(TrainingCallback):
    replay = ReplaySupport.NONE

    def on_train_begin(self, run: RunContext) -> None:
        assert run.model is not None


def test_user_callback_replays_without_changes(replay_losses: Replay) -> None:
    cb = StopBelow(0.35)
    res = replay_losses(train=[1, 0.5, 0.3, 0.2], val=[1, 0.5, 0.3, 0.2], lrs=[1.0, 0.5, 0.25, 0.125], callbacks=[cb])
    assert (res.stop_reason, res.stop_epoch, res.stopped_by) == (StopReason.EARLY_STOP, 3, "StopBelow")
    assert cb.seen_lr == [1.0, 0.5, 0.25]


def test_unreplayable_callback_is_refused_by_name(replay_losses: Replay) -> None:
    with pytest.raises(ReplayError, match=r"NeedsTheModel \(priority 50\).*ReplaySupport.NONE"):
        replay_losses(train=[1.0], val=[1.0], callbacks=[StopBelow(0.1), NeedsTheModel()])


def test_globally_registered_unreplayable_callback_is_refused(replay_losses: Replay) -> None:
    with NeedsTheModel(), pytest.raises(ReplayError, match="NeedsTheModel"):
        replay_losses(train=[1.0], val=[1.0])


def test_step_hooks_fire_per_recorded_batch_and_honour_skip_flags(replay_losses: Replay) -> None:
    class Accumulate(TrainingCallback):
        def __init__(self) -> None:
            self.steps: list[tuple[int, int]] = []

        def on_before_backward(self, step: StepContext) -> None:
            step.skip_optimizer_step = step.batch_index % 2 == 0

        def on_after_optimizer_step(self, step: StepContext) -> None:
            self.steps.append((step.epoch.index, step.batch_index))

    cb = Accumulate()
    res = replay_losses(train=[1.0, 0.5], val=[1.0, 0.5], callbacks=[cb], batches=4)
    assert cb.steps == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert res.result is not None and res.result.global_step == 8


# --- running past the data, and bad input --------------------------------------------------------
def test_budget_beyond_the_values_ends_unknown(replay_losses: Replay) -> None:
    res = replay_losses(train=[1.0, 0.9], val=[1.0, 0.9], callbacks=[EarlyStoppingCallback(patience=5)], max_epochs=10)
    assert (res.stop_reason, res.stop_epoch, res.exhausted_after) == (None, None, 2)
    assert "unknown beyond epoch 2" in res.what_if()
    assert res.events("exception")[0]["payload"]["type"] == "RecordingExhausted"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"train": [1.0, 2.0], "val": [1.0]}, "val has 1 values but train has 2"),
    ({"train": [1.0], "val": ["x"]}, r"val\[0\] must be a number, got str"),
    ({"train": [1.0], "lrs": [0.1, 0.2]}, "lrs has 2 values"),
    ({"train": [1.0], "max_epochs": -1}, "max_epochs must be an integer >= 0"),
    ({"train": [1.0], "callbacks": [object()]}, r"callbacks\[0\] must be a TrainingCallback, got object"),
])
def test_bad_input_names_the_field(replay_losses: Replay, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        replay_losses(**kwargs)


# --- trace comparison -----------------------------------------------------------------------------
def test_same_values_replay_to_the_same_trace_and_a_change_is_named(replay_losses: Replay) -> None:
    val = [1.0, 0.8, 0.8, 0.8, 0.8]
    a = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=2)])
    b = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=2)])
    assert compare_traces(a.trace, b.trace) is None
    c = replay_losses(train=val, val=val, callbacks=[EarlyStoppingCallback(patience=3)])
    div = compare_traces(a.trace, c.trace)
    assert div is not None and div.expected is not None and div.found is not None
    assert div.expected["event"] == "stop_request" and div.found["event"] == "transition"
    assert "first difference at event #" in div.describe()


def test_callbacks_that_need_a_live_model_say_so() -> None:
    # Replay feeds recorded values only for slots no FULL callback computes, and keeps the events
    # of DRY callbacks out of the trace; a model-bound built-in marked FULL would silently compute
    # nothing in a replay and break the determinism check of every real run.
    from fsmtrain.callbacks import GradientMonitorCallback, OptimizerModeCallback

    for cls in (GradientMonitorCallback, OptimizerModeCallback, WandbLoggingCallback, CheckpointCallback):
        assert cls.replay is ReplaySupport.DRY, f"{cls.__name__} needs a live model: replay = ReplaySupport.DRY"


# --- the collector pause ---------------------------------------------------------------------------
class CollectAtEpochEnd(TrainingCallback):
    """Last at each epoch's end: a full collection (``gc.collect`` runs even while the collector is
    paused), counting the unreachable cyclic objects that epoch left behind."""

    priority = 100

    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.found: list[int] = []

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self.enabled.append(gc.isenabled())
        self.found.append(gc.collect())


def test_an_epoch_with_the_replayable_built_ins_leaves_no_cyclic_garbage(replay_losses: Replay, tmp_path: Any) -> None:
    """What lets a replay pause the cyclic collector: with every replayable built-in, an epoch makes no
    garbage that only the collector could free, so the pause cannot grow memory epoch after epoch."""
    n = 20
    val = [1.0 / (i + 1) + 0.01 * math.sin(i) for i in range(n)]
    trial = RecordedTrial({i: TrialReport(i, 0.0, False) for i in range(n)})
    probe = CollectAtEpochEnd()
    callbacks: list[TrainingCallback] = [
        NaNDetectionCallback(), OptimizerModeCallback(), GradientMonitorCallback(),
        LossPredictionCallback(max_epochs=n), OverfitDetectionCallback(), WandbLoggingCallback(),
        PrunerCallback(cast(Any, trial)), EarlyStoppingCallback(patience=n), CheckpointCallback(tmp_path / "ckpt"),
        probe,
    ]
    res = replay_losses(train=val, val=val, lrs=[1e-3] * n, slots={"max_grad_norm": [1.0] * n}, callbacks=callbacks)
    assert res.stop_reason is StopReason.COMPLETED and len(probe.found) == n
    assert probe.enabled == [False] * n  # paused for the walk
    assert probe.found[2:] == [0] * (n - 2), probe.found  # the first epochs may free start-up cycles


@pytest.mark.parametrize("enabled", [True, False])
def test_a_replay_leaves_the_collector_as_it_found_it(replay_losses: Replay, enabled: bool) -> None:
    class Fails(TrainingCallback):
        def on_val_end(self, epoch: EpochContext) -> None:
            raise RuntimeError("a replayed callback fails")

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        replay_losses(train=[1.0, 0.5], val=[1.0, 0.5], callbacks=[StopBelow(0.1)])
        assert gc.isenabled() is enabled
        res = replay_losses(train=[1.0, 0.5], val=[1.0, 0.5], callbacks=[Fails()])
        assert res.stop_reason is StopReason.ERROR
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
