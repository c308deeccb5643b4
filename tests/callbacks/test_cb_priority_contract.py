import optuna
import pytest

from fsmtrain import CallbackOrderError, CallbackRunner
from fsmtrain.callbacks import (
    CheckpointCallback,
    EarlyStoppingCallback,
    EpochSummaryCallback,
    GradientMonitorCallback,
    LossPredictionCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
    OverfitDetectionCallback,
    PrunerCallback,
    Tier,
    WandbLoggingCallback,
)


def nine(tmp_path):
    trial = optuna.create_study(storage=None).ask()
    return [
        CheckpointCallback(tmp_path / "ck"),
        EarlyStoppingCallback(),
        PrunerCallback(trial),
        WandbLoggingCallback(directory=tmp_path),
        OverfitDetectionCallback(),
        LossPredictionCallback(max_epochs=10),
        GradientMonitorCallback(),
        OptimizerModeCallback(),
        NaNDetectionCallback(),
    ]


def test_all_nine_validate_and_order_by_priority(tmp_path):
    runner = CallbackRunner(nine(tmp_path), include_global=False)
    described = runner.describe()
    assert [d["priority"] for d in described] == [5, 10, 12, 70, 75, 80, 85, 90, 95]
    assert [d["name"] for d in described] == [
        "NaNDetectionCallback", "OptimizerModeCallback", "GradientMonitorCallback", "LossPredictionCallback",
        "OverfitDetectionCallback", "WandbLoggingCallback", "PrunerCallback", "EarlyStoppingCallback",
        "CheckpointCallback",
    ]
    assert all(cb.tier is Tier.CORE for cb in runner.callbacks)
    hooks = {d["name"]: set(d["hooks"]) for d in described}
    assert "on_epoch_end" in hooks["GradientMonitorCallback"]
    assert "on_val_end" in hooks["LossPredictionCallback"]
    assert "on_val_end" in hooks["PrunerCallback"] and "on_val_end" in hooks["EarlyStoppingCallback"]
    assert "on_epoch_end" in hooks["CheckpointCallback"] and "on_epoch_end" in hooks["NaNDetectionCallback"]


def test_wandb_ahead_of_gradient_monitor_is_refused(tmp_path):
    callbacks = nine(tmp_path)
    wb = next(cb for cb in callbacks if isinstance(cb, WandbLoggingCallback))
    wb.priority = 11
    with pytest.raises(CallbackOrderError) as err:
        CallbackRunner(callbacks, include_global=False)
    msg = str(err.value)
    assert "WandbLoggingCallback (priority 11)" in msg
    assert "GradientMonitorCallback (priority 12)" in msg
    assert "'max_grad_norm'" in msg
    # the overfit detector (75, on_epoch_end) is also after it; the loss prediction is written in
    # on_val_end, which comes before on_epoch_end, so that slot is fine
    assert "'overfit_gap_ratio'" in msg and "'loss_prediction'" not in msg


def test_epoch_summary_must_follow_gradient_monitor(tmp_path):
    summary = EpochSummaryCallback()
    summary.priority = 11
    with pytest.raises(CallbackOrderError, match="max_grad_norm"):
        CallbackRunner([GradientMonitorCallback(), summary], include_global=False)
    # the loss prediction is written in on_val_end, before any on_epoch_end reader: any priority works
    CallbackRunner([LossPredictionCallback(max_epochs=5), summary], include_global=False)
    CallbackRunner([GradientMonitorCallback(), EpochSummaryCallback()], include_global=False)


def test_readers_without_writers_get_none(scripted):
    # a minimal setup: the W&B-free summary alone still works (its slots are simply None)
    import io

    stream = io.StringIO()
    scripted([EpochSummaryCallback(stream=stream)], [1.0, 0.5], [1.0, 0.5])
    lines = stream.getvalue().splitlines()
    assert lines[1].split() == ["epoch", "train", "val", "lr"]  # no grad column: nothing wrote the slot
    assert [line.split()[0] for line in lines[2:]] == ["1/2", "2/2"]
