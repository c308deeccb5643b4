"""TensorBoardLoggingCallback: the event files it writes, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fsmtrain import Trainer
from fsmtrain.app.config import build_callbacks, load_config
from fsmtrain.callbacks import EarlyStoppingCallback, GradientMonitorCallback, TensorBoardLoggingCallback

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
REPO = Path(__file__).resolve().parents[2]


def test_every_epoch_metric_and_slot_is_a_scalar_at_its_global_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    train = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    result = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, train, max_epochs=3,
                     callbacks=[GradientMonitorCallback(), EarlyStoppingCallback(patience=10),
                                TensorBoardLoggingCallback(tmp_path / "tb")],
                     default_callbacks=False, console_level="error").fit()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"epoch", "train_loss", "val_loss", "lr", "max_grad_norm", "early_stopping_wait"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("epoch")] == [(3, 1), (6, 2), (9, 3)]  # 3 batches an epoch
    for key in ("train_loss", "val_loss"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(3 * (r.epoch + 1), r.metrics[key]) for r in result.history]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    grad = [e.value for e in acc.Scalars("max_grad_norm")]
    assert grad == pytest.approx([r.slots["max_grad_norm"] for r in result.history], rel=1e-6)


def test_the_config_switch_puts_it_in_the_run_dir(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["tensorboard.enabled=true"])
    (tb,) = [c for c in build_callbacks(cfg, run_dir=tmp_path) if isinstance(c, TensorBoardLoggingCallback)]
    assert tb.log_dir == tmp_path / "tensorboard"
    off = load_config(REPO / "configs" / "quickstart.yaml")
    assert not [c for c in build_callbacks(off, run_dir=tmp_path) if isinstance(c, TensorBoardLoggingCallback)]
