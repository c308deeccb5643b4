import io
import math

import pytest

from callbacks import EpochSummaryCallback, GradientMonitorCallback, LossPredictionCallback
from pipeline import StopReason, TrainingCallback


def test_every_n_epochs_and_last(scripted):
    stream = io.StringIO()
    scripted([EpochSummaryCallback(every_n_epochs=3, stream=stream)], [1.0, 0.9, 0.8, 0.7, 0.6],
             [1.1, 1.0, 0.9, 0.8, 0.7])
    lines = stream.getvalue().splitlines()
    assert lines == [
        "epoch 3/5  train 0.8  val 0.9  lr 1.00e-01  grad -",
        "epoch 5/5  train 0.6  val 0.7  lr 1.00e-01  grad -",
    ]


def test_line_holds_grad_norm_and_prediction(scripted):
    class FakeGrad(TrainingCallback):  # a stand-in writer of the slot (the real one needs a model)
        priority = GradientMonitorCallback.priority
        writes = GradientMonitorCallback.writes

        def on_epoch_end(self, epoch):
            epoch.set(self.writes[0], 2.5)

    stream = io.StringIO()
    val = [math.exp(-0.1 * t) for t in range(12)]
    summary = EpochSummaryCallback(every_n_epochs=10, stream=stream)
    scripted([FakeGrad(), LossPredictionCallback(max_epochs=21), summary], [1.0] * 12, val, max_epochs=12)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    # epoch index 9 (line "epoch 10/12") has no prediction yet; index 11 (the last) has one
    assert lines[0].startswith("epoch 10/12") and "grad 2.5" in lines[0] and "pred" not in lines[0]
    assert lines[1].startswith("epoch 12/12") and f"pred {math.exp(-2.0):.4g}" in lines[1]


def test_stop_prints_the_last_epoch(scripted):
    class Stop(TrainingCallback):
        def on_val_end(self, epoch):
            if epoch.index == 1:
                epoch.request_stop(StopReason.EARLY_STOP, "test")

    stream = io.StringIO()
    scripted([Stop(), EpochSummaryCallback(every_n_epochs=10, stream=stream)], [1.0] * 5, [1.0] * 5)
    assert stream.getvalue().startswith("epoch 2/5")


def test_nan_shown(scripted):
    stream = io.StringIO()
    scripted([EpochSummaryCallback(stream=stream)], [math.nan], [math.inf])
    assert "train nan  val inf" in stream.getvalue()


def test_default_stream_is_stdout_at_call_time(scripted, capsys):
    scripted([EpochSummaryCallback()], [1.0], [1.0])
    assert capsys.readouterr().out.startswith("epoch 1/1")


def test_bad_every():
    with pytest.raises(ValueError, match="every_n_epochs"):
        EpochSummaryCallback(every_n_epochs=0)
