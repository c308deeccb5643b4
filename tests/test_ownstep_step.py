"""A user's own step (issue 42): ``step: module.fn`` on dict batches, from a folder of the user's,
through validate --data, preflight, train, audit, replay and a bitwise resume; ``Trainer(step=...)`` on
dataclass batches; and the TARGET_REACHED stop reason through the console, audit, replay and report."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from resume_harness import env, same_weights
from torch import nn

from fsmtrain import StopReason, Trainer, TrainingCallback
from fsmtrain.core.context import EpochContext, StepContext, ValStepContext
from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file

USER_MODULE = '''
import torch
from torch import nn
from torch.utils.data import Dataset
from fsmtrain import ReplaySupport, StopReason, TrainingCallback
from fsmtrain.core.context import Slot
from fsmtrain.training.data import make_loaders

class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return {"left": self.x[i, :4], "right": self.x[i, 4:], "y": self.y[i]}

def pair_data(*, batch_size, seed, n=300):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) - 2 * x[:, 4:].sum(1)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)
    return make_loaders(Pairs(x[:240], y[:240]), Pairs(x[240:], y[240:]), batch_size=batch_size, seed=seed)

class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 16), nn.Linear(4, 16), nn.Linear(32, 1)
    def forward(self, left, right):
        return self.head(torch.cat([torch.tanh(self.a(left)), torch.tanh(self.b(right))], 1))

def pair_step(model, batch):
    pred = model(batch["left"], batch["right"])
    return {"loss": nn.functional.mse_loss(pred, batch["y"]), "output": pred, "target": batch["y"]}

def mae(output, target):
    return (output - target).abs().mean()

TRAIN_SEEN = Slot("train_outputs_seen")
VAL_ROWS = Slot("val_rows_seen")

class SeesOutputs(TrainingCallback):
    priority = 60
    writes = (TRAIN_SEEN, VAL_ROWS)
    replay = ReplaySupport.DRY  # it reads the step's live outputs: a replay feeds its recorded slots
    def on_train_epoch_begin(self, epoch):
        self.train = self.rows = 0
    def on_after_backward(self, step):
        if not step.run.dry_run and set(step.output) == {"output", "target"} and step.output["output"].requires_grad:
            self.train += 1
    def on_val_batch_end(self, step):
        self.rows += 0 if step.run.dry_run else step.output["output"].shape[0]
    def on_val_end(self, epoch):
        if epoch.run.dry_run:
            return
        epoch.set(TRAIN_SEEN, self.train)
        epoch.set(VAL_ROWS, self.rows)

class TargetStop(TrainingCallback):
    priority = 70
    def __init__(self, below):
        self.below = below
    def on_val_end(self, epoch):
        if epoch.metrics["val_loss"] < self.below:
            epoch.request_stop(StopReason.TARGET_REACHED, self.name, f"val_loss below {self.below}")
'''

CONFIG = '''
project: own
name: pairs
seeds: [0]
num_threads: 1
data: ownsteps.pair_data
net: ownsteps.TwoTower
step: ownsteps.pair_step
metrics: {val_mae: ownsteps.mae}
optimizer_config: {lr: 0.01}
epochs: 4
batch_size: 32
early_stopping: {enabled: false}
callbacks:
  loss_prediction: {enabled: false}
  extra: [{target: ownsteps.SeesOutputs}]
'''
RUN = Path("runs") / "own" / "pairs-seed0"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own")
    (root / "proj").mkdir()
    (root / "proj" / "ownsteps.py").write_text(textwrap.dedent(USER_MODULE))
    (root / "proj" / "own.yaml").write_text(CONFIG)
    return root / "proj" / "own.yaml"


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "fsmtrain", *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=300)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout + proc.stderr


def _epochs(run: Path) -> list[dict[str, Any]]:
    return [e["payload"] for e in read_events(run / "events.jsonl") if e["event"] == "epoch"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_user_step_on_dict_batches_from_another_folder(project: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"  # neither the config's folder nor on any path
    valid = _ok(_cli(elsewhere, "validate", "--data", str(project)))
    assert "called the data builder (batches: train 8, val 2)" in valid, valid
    pre = _ok(_cli(elsewhere, "preflight", str(project)))
    assert "preflight passed" in pre and "ownsteps.pair_step" in pre, pre
    assert "{'left': (32, 4) float32, 'right': (32, 4) float32, 'y': (32, 1) float32}" in pre, pre
    _ok(_cli(elsewhere, "train", str(project)))
    run = elsewhere / RUN
    epochs = _epochs(run)
    assert len(epochs) == 4
    assert all(e["slots"]["train_outputs_seen"] == 8 and e["slots"]["val_rows_seen"] == 60 for e in epochs), epochs
    losses = [e["metrics"]["val_loss"] for e in epochs]
    assert losses[-1] < losses[0] and all(e["metrics"]["val_mae"] > 0 for e in epochs)
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)
    third = tmp_path / "third"  # replay and resume find ownsteps.py where the run recorded it
    _ok(_cli(third, "replay", str(run)))
    # resume: two epochs, then on to four from a third folder, bitwise the uninterrupted run's weights
    part = tmp_path / "part"
    _ok(_cli(part, "train", str(project), "--set", "epochs=2"))
    _ok(_cli(third, "resume", str(part / RUN), "--set", "epochs=4"))
    assert same_weights(part / RUN / "model.pt", run / "model.pt")
    assert audit_file(part / RUN / "events.jsonl").ok
    # the control: a different step gives different weights, so the comparison can fail
    other = tmp_path / "other"
    _ok(_cli(other, "train", str(project), "--set", "optimizer_config.lr=0.02"))
    assert not same_weights(other / RUN / "model.pt", run / "model.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_target_reached_reaches_console_audit_replay_and_report(project: Path, tmp_path: Path) -> None:
    stop = "callbacks.extra=[{target: ownsteps.TargetStop, kwargs: {below: 1.0}}]"
    out = _ok(_cli(tmp_path, "train", str(project), "--set", "epochs=30", "--set", stop))
    run = tmp_path / RUN
    result = next(e["payload"] for e in read_events(run / "events.jsonl") if e["event"] == "result")
    assert result["stop_reason"] == StopReason.TARGET_REACHED.value
    assert len(_epochs(run)) < 30
    assert "TARGET_REACHED" in out and "val_loss below 1.0" in out, out
    report = audit_file(run / "events.jsonl")
    assert report.ok and report.explanation.stop_reason == "target_reached", report.render(False)
    replay = _ok(_cli(tmp_path / "third", "replay", str(run), "--json"))
    assert json.loads(replay[replay.index("{"):])["stop_reason"] == "target_reached"
    _ok(_cli(tmp_path, "report", str(run)))
    assert "target_reached" in (run / "report.html").read_text(encoding="utf-8")


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


class _Seen(TrainingCallback):
    def __init__(self) -> None:
        self.train: list[Any] = []
        self.val: list[Any] = []
        self.hooks: list[str] = []

    def on_before_forward(self, step: StepContext) -> None:
        self.hooks.append("before_forward")

    def on_after_forward(self, step: StepContext) -> None:
        self.train.append(step.output)

    def on_before_backward(self, step: StepContext) -> None:
        self.hooks.append("before_backward")

    def on_after_optimizer_step(self, step: StepContext) -> None:
        self.hooks.append("after_optimizer_step")

    def on_val_batch_end(self, step: ValStepContext) -> None:
        self.val.append((step.output, step.loss))

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self.hooks.append("epoch_end")


def _batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    return [Batch(torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)) for _ in range(n)]


def test_trainer_step_on_dataclass_batches_with_its_own_val_step() -> None:
    model = nn.Linear(3, 1)
    seen = _Seen()

    def step(m: nn.Module, b: Batch) -> dict[str, Any]:
        assert b.note == "kept"
        out = m(b.x)
        return {"loss": ((out - b.y) ** 2).mean(), "output": out, "target": b.y}

    def val_step(m: nn.Module, b: Batch) -> torch.Tensor:
        return (m(b.x) - b.y).abs().mean()  # the loss alone

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, _batches(4), _batches(2),
                      max_epochs=2, callbacks=[seen], default_callbacks=False, step=step, val_step=val_step)
    result = trainer.fit()
    assert result.stop_reason is StopReason.COMPLETED
    assert len(seen.train) == 8 and all(set(o) == {"output", "target"} for o in seen.train)
    assert len(seen.val) == 4 and all(o == {} and loss.ndim == 0 for o, loss in seen.val)
    assert seen.hooks[:3] == ["before_forward", "before_backward", "after_optimizer_step"]
    with torch.no_grad():
        expected = sum(float(val_step(model, b)) * 5 for b in _batches(2)) / 10
    assert trainer.run.history[-1].metrics["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_a_step_that_returns_something_else_is_named() -> None:
    model = nn.Linear(3, 1)

    def bad(m: nn.Module, b: Batch) -> dict[str, Any]:
        return {"output": m(b.x)}

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, _batches(2), None, max_epochs=1,
                      default_callbacks=False, step=bad)
    with pytest.raises(TypeError, match=r"step .*bad must return the loss .* mapping with a tensor 'loss'; "
                                        r"it returned dict with keys \['output'\]"):
        trainer.fit()
    with pytest.raises(ValueError, match="give a loss_fn, or a step"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, _batches(2), default_callbacks=False)


def test_metrics_need_the_steps_output_and_target() -> None:
    model = nn.Linear(3, 1)

    def loss_only(m: nn.Module, b: Batch) -> torch.Tensor:
        return ((m(b.x) - b.y) ** 2).mean()

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, _batches(2), _batches(1),
                      max_epochs=1, default_callbacks=False, step=loss_only,
                      metrics={"val_mae": lambda o, t: (o - t).abs().mean()})
    with pytest.raises(TypeError, match="must return them as 'output' and 'target' next to 'loss'; it returned "
                                        "the loss alone"):
        trainer.fit()


def test_a_misspelt_step_is_a_config_error(project: Path, tmp_path: Path) -> None:
    proc = _cli(tmp_path, "validate", str(project), "--set", "step=ownsteps.pair_stp")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "step" in proc.stderr and "ownsteps.pair_step" in proc.stderr, proc.stderr
