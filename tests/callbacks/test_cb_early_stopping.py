import math

import pytest

from fsmtrain import StopReason
from fsmtrain.callbacks import EarlyStoppingCallback
from fsmtrain.callbacks.early_stopping import improves


def test_stops_at_hand_computed_epoch(scripted):
    # best 1.0 at 0, 0.5 at 1 (improves), then 3 epochs without improvement -> stop at epoch index 4
    val = [1.0, 0.5, 0.6, 0.5, 0.55, 0.1, 0.1]
    out = scripted([EarlyStoppingCallback(patience=3)], [1.0] * 7, val)
    assert out.result.stop_reason is StopReason.EARLY_STOP
    assert out.result.epochs_completed == 5
    assert out.result.stop.epoch == 4


@pytest.mark.parametrize(
    ("value", "improves_expected", "stop_epochs"),
    [
        (0.8999, True, 7),  # improvement 1.11e-4 relative > 1e-4: counter resets at epoch 3 -> stop at 6
        (0.89992, False, 5),  # improvement 8.9e-5 relative < 1e-4: no reset -> stop at epoch 4
    ],
)
def test_min_delta_is_relative_just_above_and_below(scripted, value, improves_expected, stop_epochs):
    # best 0.9 at epoch 1; threshold = 0.9 - 0.9*1e-4 = 0.89991
    val = [1.0, 0.9, 0.95, value, 0.95, 0.95, 0.95, 0.95, 0.95]
    cb = EarlyStoppingCallback(patience=3, min_delta=1e-4)
    out = scripted([cb], [1.0] * 9, val)
    assert improves(value, 0.9, "min", 1e-4) is improves_expected
    assert out.result.stop_reason is StopReason.EARLY_STOP
    assert out.result.epochs_completed == stop_epochs
    assert out.result.stop.epoch == stop_epochs - 1
    assert cb.best == (value if improves_expected else 0.9)


def test_tiny_relative_improvement_does_not_reset():
    # 0.001% = 1e-5 relative < min_delta 1e-4
    assert not improves(1.0 * (1 - 1e-5), 1.0, "min", 1e-4)
    assert improves(1.0 * (1 - 2e-4), 1.0, "min", 1e-4)


def test_negative_and_zero_losses():
    # best -2: margin 2e-4, must go below -2.0002
    assert improves(-2.0003, -2.0, "min", 1e-4)
    assert not improves(-2.0001, -2.0, "min", 1e-4)
    # best 0: margin 0, any strict decrease improves, equal does not
    assert improves(-1e-12, 0.0, "min", 1e-4)
    assert not improves(0.0, 0.0, "min", 1e-4)
    assert not improves(math.nan, 1.0, "min", 1e-4)


def test_max_mode_and_custom_monitor(scripted):
    acc = [{"acc": a} for a in (0.5, 0.6, 0.6, 0.6, 0.9)]
    cb = EarlyStoppingCallback(patience=2, mode="max", monitor="acc")
    out = scripted([cb], [1.0] * 5, [1.0] * 5, extra=acc)
    assert out.result.stop_reason is StopReason.EARLY_STOP
    assert out.result.epochs_completed == 4  # 0.6 at 1 best; epochs 2,3 no improvement
    assert cb.best == 0.6


def test_missing_monitor_warns_once_and_never_stops(scripted):
    out = scripted([EarlyStoppingCallback(patience=1, monitor="nope")], [1.0] * 4, [1.0] * 4)
    assert out.result.stop_reason is StopReason.COMPLETED
    warnings = out.named("warning")
    assert len(warnings) == 1 and "'nope'" in warnings[0]["payload"]["message"]


def test_state_dict_round_trip(scripted):
    cb = EarlyStoppingCallback(patience=3)
    scripted([cb], [1.0] * 4, [1.0, 0.5, 0.6, 0.7])
    state = cb.state_dict()
    assert state == {"best": 0.5, "best_epoch": 1, "best_at": {"validation": 2, "epoch": 2, "step": 2}, "wait": 2}
    fresh = EarlyStoppingCallback(patience=3)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # one more non-improving epoch on the restored callback stops it
    out = scripted([fresh], [1.0], [0.8])
    assert out.result.stop_reason is StopReason.EARLY_STOP


@pytest.mark.parametrize("kwargs", [{"patience": 0}, {"mode": "avg"}, {"min_delta": -1.0}])
def test_bad_arguments_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        EarlyStoppingCallback(**kwargs)
