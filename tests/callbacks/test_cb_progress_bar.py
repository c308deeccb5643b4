import io
import sys

import torch
from torch import nn

from fsmtrain import Trainer
from fsmtrain.callbacks import ProgressBarCallback
from fsmtrain.callbacks.progress_bar import auto_enabled


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _fit(tiny, cb):
    train, val = tiny.loaders(n=32, batch=8)
    model = tiny.model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val, max_epochs=3,
            callbacks=[cb], console_level="error", default_callbacks=False).fit()


def test_auto_is_off_when_not_a_terminal_or_in_ci(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("CI", raising=False)
    assert not auto_enabled()
    monkeypatch.setattr(sys, "stdout", FakeTTY())
    assert auto_enabled()
    monkeypatch.setenv("CI", "true")
    assert not auto_enabled()


def test_silent_when_not_a_terminal(tiny, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    cb = ProgressBarCallback()
    _fit(tiny, cb)
    assert out.getvalue() == ""
    assert not cb.active


def test_shows_epochs_batches_and_loss_when_enabled(tiny, monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.delenv("CI", raising=False)
    cb = ProgressBarCallback()
    cb.refresh_seconds = 0.0  # read the loss every batch so the text is deterministic
    _fit(tiny, cb)
    text = out.getvalue()
    assert "epochs" in text and "3/3" in text
    assert "epoch 2" in text and "loss " in text and "val_loss" in text
    assert cb._progress is None  # stopped at train end
