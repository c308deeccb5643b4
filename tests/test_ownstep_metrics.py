"""Exact metrics (issue 42.3): a torchmetrics object in the config, updated per batch, computed at the
end of validation and synced over the ranks: on 2 real torchrun ranks it equals the metric of the final
model.pt over the whole val set, computed in one process, with a val set that no ranks x batch divides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
import yaml

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.app.config import load_config
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.context import CheckpointContext
from fsmtrain.training.checkpoint import load_checkpoint
from fsmtrain.training.data import digits
from fsmtrain.training.models import MLP

REPO = Path(__file__).resolve().parents[1]
CLASSES = 10
METRICS = {
    "val_acc": {"target": "torchmetrics.classification.MulticlassAccuracy",
                "kwargs": {"num_classes": CLASSES, "average": "micro"}},
    "val_f1": {"target": "torchmetrics.classification.MulticlassF1Score", "kwargs": {"num_classes": CLASSES}},
    "val_accuracy": "fsmtrain.training.models.accuracy",  # the plain function form keeps working
}


def _config(folder: Path, **changes: Any) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "digits.yaml").read_text())
    cfg.update({"epochs": 2, "batch_size": 64, "metrics": METRICS, "wandb": {"enabled": False}, **changes})
    path = folder / "digits.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1", WANDB_SILENT="true")
    return env


def _last_epoch(run: Path) -> dict[str, float]:
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    metrics: dict[str, float] = [e["payload"]["metrics"] for e in lines if e["event"] == "epoch"][-1]
    return metrics


def _exact(model_pt: Path) -> dict[str, float]:
    """The metrics of the saved weights over the whole val set, in one process, one batch."""
    model = MLP(in_features=64, out_features=CLASSES, hidden=[128], dropout=0.1)
    model.load_state_dict(torch.load(model_pt, weights_only=True))
    model.eval()
    _, val = digits(batch_size=64, seed=0, val_fraction=0.2)
    assert val is not None
    x = torch.cat([b[0] for b in val])
    y = torch.cat([b[1] for b in val])
    with torch.no_grad():
        out = model(x)
    acc = torchmetrics.functional.classification.multiclass_accuracy(out, y, CLASSES, average="micro")
    f1 = torchmetrics.functional.classification.multiclass_f1_score(out, y, CLASSES)
    return {"val_acc": float(acc), "val_f1": float(f1), "rows": float(len(y))}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchmetrics_on_two_ranks_is_exact_over_the_whole_val_set(tmp_path: Path) -> None:
    config = _config(tmp_path)
    rows = 359  # digits' val set: 1797 rows, 20%
    assert rows % (2 * 64) != 0 and rows % 2 != 0  # neither ranks x batch nor ranks divide it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fsmtrain", "train", str(config)]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = [p.parent for p in (tmp_path / "runs").rglob("events.jsonl")]
    logged = _last_epoch(run)
    exact = _exact(run / "model.pt")
    assert exact["rows"] == rows
    assert logged["val_acc"] == pytest.approx(exact["val_acc"], abs=1e-6)
    assert logged["val_f1"] == pytest.approx(exact["val_f1"], abs=1e-6)
    # rank 1 logged the same synced values
    assert _last_epoch(run)["val_f1"] == json.loads(
        [line for line in (run / "events-rank1.jsonl").read_text().splitlines() if '"event":"epoch"' in line][-1]
    )["payload"]["metrics"]["val_f1"]
    assert logged["val_accuracy"] == pytest.approx(exact["val_acc"], abs=1e-6)  # a count: the plain form is too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_process_is_exact_and_the_console_shows_it(tmp_path: Path) -> None:
    config = _config(tmp_path, epochs=1)
    done = subprocess.run([sys.executable, "-m", "fsmtrain", "train", str(config)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = [p.parent for p in (tmp_path / "runs").rglob("events.jsonl")]
    logged, exact = _last_epoch(run), _exact(run / "model.pt")
    assert logged["val_f1"] == pytest.approx(exact["val_f1"], abs=1e-6)
    assert "val_f1" in done.stdout


def test_the_config_names_an_exact_metric_that_is_not_one(tmp_path: Path) -> None:
    from fsmtrain.app.config.problems import ConfigError

    bad = {"val_x": {"target": "torch.nn.Linear", "kwargs": {}}}
    with pytest.raises(ConfigError, match=r"metrics\.val_x\.target.*update\(output, target\), compute\(\) and reset"):
        load_config(_config(tmp_path, metrics=bad))
    cfg = load_config(_config(tmp_path))
    assert cfg.metrics["val_accuracy"] == "fsmtrain.training.models.accuracy"


class _Loaded(TrainingCallback):
    """What the exact metrics hold once a resumed run has restored its checkpoint."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_load_checkpoint(self, ckpt: CheckpointContext) -> None:
        self.state = ckpt.run.exact_metrics.state_dict()


def test_the_exact_metrics_state_is_in_the_checkpoint_and_restored(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)
    train = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 50, 16)]
    val = [(x[i:i + 8], y[i:i + 8]) for i in range(50, 70, 8)]  # 20 rows: 8, 8, 4

    def trainer(epochs: int, callbacks: list[TrainingCallback], resume: bool) -> Trainer:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                       train, val, max_epochs=epochs, metrics={"val_acc": acc}, run_dir=tmp_path / "run",
                       callbacks=[CheckpointCallback(tmp_path / "run" / "checkpoints", background=False), *callbacks],
                       default_callbacks=False, resume_from="latest" if resume else None)

    first = trainer(2, [], False)
    first.fit()
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "latest.pt")["exact_metrics"]
    assert set(saved) == {"val_acc"} and int(saved["val_acc"]["tp"].sum() + saved["val_acc"]["fn"].sum()) == 20
    assert all(torch.equal(v, first.driver.exact.state_dict()["val_acc"][k]) for k, v in saved["val_acc"].items())
    loaded = _Loaded()
    trainer(3, [loaded], True).fit()
    assert loaded.state is not None
    assert all(torch.equal(v, loaded.state["val_acc"][k]) for k, v in saved["val_acc"].items())
