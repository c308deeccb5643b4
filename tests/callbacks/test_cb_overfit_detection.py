import pytest

from fsmtrain import StopReason, TrainingCallback
from fsmtrain.callbacks import OverfitDetectionCallback
from fsmtrain.callbacks.overfit_detection import diverging
from fsmtrain.core.slots import OVERFIT_GAP_RATIO


class SlotReader(TrainingCallback):
    priority = 76
    reads = (OVERFIT_GAP_RATIO,)

    def __init__(self):
        self.seen = {}

    def on_epoch_end(self, epoch):
        self.seen[epoch.index] = epoch.get(OVERFIT_GAP_RATIO)


def test_fires_at_first_qualifying_epoch(scripted):
    # train falls from epoch 3 on, val rises from epoch 3 on: changes 3->4 ... 7->8 are 5 diverging
    # changes, so with window 5 the first qualifying epoch index is 8.
    train = [1.0, 0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    val = [1.0, 0.9, 0.9, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    cb = OverfitDetectionCallback(warmup_epochs=5, window_size=5)
    reader = SlotReader()
    out = scripted([cb, reader], train, val)
    assert [i for i, v in reader.seen.items() if v is not None] == [8, 9]
    assert reader.seen[8] == pytest.approx(1.4 / 0.3)
    assert cb.overfitting and cb.first_detected == 8
    warnings = out.named("warning")
    assert len(warnings) == 1 and "epoch 9" in warnings[0]["payload"]["message"]
    assert out.result.stop_reason is StopReason.COMPLETED  # never stops


def test_plateau_does_not_fire(scripted):
    train = [1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2, 0.1]
    val = [1.0, 1.1, 1.2, 1.2, 1.3, 1.4, 1.4, 1.5, 1.6, 1.6, 1.7]  # a flat step in every 3 changes
    cb = OverfitDetectionCallback(warmup_epochs=0, window_size=3)
    reader = SlotReader()
    scripted([cb, reader], train, val)
    assert all(v is None for v in reader.seen.values())
    assert not cb.overfitting


def test_warmup_suppresses_and_flag_is_sticky(scripted):
    train = [1.0, 0.9, 0.8, 0.7, 0.7, 0.7]
    val = [1.0, 1.1, 1.2, 1.3, 1.3, 1.3]
    cb = OverfitDetectionCallback(warmup_epochs=3, window_size=1)
    reader = SlotReader()
    scripted([cb, reader], train, val)
    # epochs 1 and 2 diverge but are in warmup; epoch 3 fires; 4, 5 are flat -> slot None, flag stays
    assert [i for i, v in reader.seen.items() if v is not None] == [3]
    assert cb.overfitting and cb.first_detected == 3


def test_window_one_fires_on_single_divergence():
    assert diverging([1.0, 0.9], [1.0, 1.1], 1)
    assert not diverging([1.0, 0.9], [1.0, 1.0], 1)
    assert not diverging([1.0, float("nan")], [1.0, 1.1], 1)


def test_state_round_trip():
    cb = OverfitDetectionCallback()
    cb.train, cb.val, cb.overfitting, cb.first_detected = [1.0], [2.0], True, 7
    fresh = OverfitDetectionCallback()
    fresh.load_state_dict(cb.state_dict())
    assert fresh.state_dict() == cb.state_dict()


@pytest.mark.parametrize("kwargs", [{"warmup_epochs": -1}, {"window_size": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        OverfitDetectionCallback(**kwargs)
