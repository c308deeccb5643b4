import math

import torch
from torch import nn

from fsmtrain import StopReason, Trainer, TrainingCallback
from fsmtrain.callbacks import CheckpointCallback, NaNDetectionCallback


def test_nan_val_loss_stops_with_nan_and_inf_objective(scripted):
    out = scripted([NaNDetectionCallback()], [1.0, 0.9, 0.8, 0.7, 0.6], [1.0, 0.9, math.nan, 0.7, 0.6])
    assert out.result.stop_reason is StopReason.NAN
    assert out.result.epochs_completed == 3  # the NaN epoch finishes (epoch_end handlers run)
    assert out.result.objective == math.inf
    assert "val_loss" in out.result.stop.message and "epoch 3" in out.result.stop.message


def test_inf_train_loss_stops_with_nan(scripted):
    out = scripted([NaNDetectionCallback()], [1.0, math.inf, 0.8], [1.0, 0.9, 0.8])
    assert out.result.stop_reason is StopReason.NAN
    assert out.result.epochs_completed == 2
    assert out.result.objective == math.inf


def test_negative_inf_also_stops(scripted):
    out = scripted([NaNDetectionCallback()], [1.0, 0.9, 0.8], [1.0, -math.inf, 0.8])
    assert out.result.stop_reason is StopReason.NAN


def test_finite_losses_complete(scripted):
    out = scripted([NaNDetectionCallback()], [1.0, 0.9, 0.8], [1.0, 0.9, 0.8])
    assert out.result.stop_reason is StopReason.COMPLETED
    assert out.result.objective == 0.8


def test_real_run_with_inf_inputs_stops_and_checkpoints_that_epoch(tiny, tmp_path):
    train, _ = tiny.loaders()
    bad = [(torch.full((4, 4), math.inf), torch.zeros(4, 1))]
    model = tiny.model()
    seen: list[int] = []

    class Count(TrainingCallback):
        def on_epoch_end(self, epoch):
            seen.append(epoch.index)

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), train, bad,
                      max_epochs=5, callbacks=[NaNDetectionCallback(), Count(),
                                               CheckpointCallback(tmp_path / "ck", save_every_n_epochs=100)],
                      default_callbacks=False)
    result = trainer.fit()
    assert result.stop_reason is StopReason.NAN
    assert result.objective == math.inf
    assert seen == [0]
    assert (tmp_path / "ck" / "latest.pt").exists()  # the stopping epoch still got its latest checkpoint
