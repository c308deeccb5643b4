"""``log_every_n_steps``: a ``train_step`` event (the log's step series) every N global steps with
the batch's loss, the lr and the gradient norm; no callback (no per-batch hook) without it."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.app.config import build_callbacks, load_config
from fsmtrain.app.trainer import Trainer
from fsmtrain.callbacks import StepLogCallback
from fsmtrain.core.context import StepContext
from fsmtrain.core.events import read_events
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.runner import CallbackRunner
from fsmtrain.tools.audit.auditor import audit_file

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


class _Truth(TrainingCallback):
    """What the step's loss and gradient norm are, read at every step (the test's own measurement)."""

    priority = 14

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, float]] = {}

    def on_after_backward(self, step: StepContext) -> None:
        assert step.run.model is not None and step.loss is not None
        norm = torch.cat([p.grad.reshape(-1) for p in step.run.model.parameters() if p.grad is not None]).norm()
        self.seen[step.run.global_step + 1] = (float(step.loss.detach()), float(norm))


def test_every_nth_step_logs_its_loss_lr_and_gradient_norm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    model = nn.Linear(3, 1)
    truth = _Truth()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), DataLoader(data, batch_size=8),
            DataLoader(data, batch_size=8), max_epochs=2, callbacks=[StepLogCallback(every_n_steps=3), truth],
            run_dir=tmp_path / "run", default_callbacks=False).fit()
    rows = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "train_step"]
    assert [r["payload"]["step"] for r in rows] == [3, 6, 9] == [r["global_step"] + 1 for r in rows]
    for r in rows:
        p = r["payload"]
        loss, norm = truth.seen[p["step"]]
        assert p["loss"] == loss and math.isclose(p["grad_norm"], norm, rel_tol=1e-5) and p["lr"] == 0.1
    assert not audit_file(tmp_path / "run" / "events.jsonl").violations


def test_the_config_setting_builds_it_and_its_absence_does_not(tmp_path: Path) -> None:
    on = build_callbacks(load_config(QUICKSTART, ["log_every_n_steps=50"]), run_dir=None)
    off = build_callbacks(load_config(QUICKSTART, []), run_dir=None)
    assert [cb.every_n_steps for cb in on if isinstance(cb, StepLogCallback)] == [50]
    assert not any(isinstance(cb, StepLogCallback) for cb in off)
    assert not CallbackRunner(off).has("on_train_step_end")  # nothing per batch
    assert CallbackRunner(on).has("on_train_step_end")
