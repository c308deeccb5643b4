"""One way in: a user's own CNN, data builder and two callbacks, each in their own module beside
the config, run from another working folder by every command, with the user's folder on no
PYTHONPATH (only fsmtrain's own source is, as in this dev setup).

Every command finds them the way ``validate`` does: ``hpo`` (whose workers import them too),
``replay RUN`` from the folder holding ``mycbs.py``, and ``cd / && fsmtrain resume RUN``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NETS = '''
import torch
from torch import nn


class SmallCNN(nn.Module):
    """8x8 images in 64 columns -> 10 classes."""

    def __init__(self, channels: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.head = nn.Linear(channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv(x.view(-1, 1, 8, 8))), 2)
        return self.head(x.flatten(1))
'''

DATA = '''
import torch
from torch.utils.data import TensorDataset


def blobs(*, batch_size: int, seed: int, n: int = 160):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 64, generator=g)
    y = (x[:, :8].sum(1) * 10 / 8).long().clamp(0, 9)
    cut = n * 3 // 4
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])
'''

CALLBACKS = '''
from fsmtrain.callbacks import TrainingCallback
from fsmtrain import StopReason


class StopBelow(TrainingCallback):
    def __init__(self, threshold: float = 0.0) -> None:
        super().__init__(priority=60)     # a priority per instance, as the README teaches
        self.threshold = threshold

    def on_val_end(self, epoch) -> None:
        if epoch.val_loss < self.threshold:
            epoch.request_stop(StopReason.EARLY_STOP, self.name, f"val_loss below {self.threshold}")


class CountEpochs(TrainingCallback):
    priority = 65

    def __init__(self) -> None:
        self.seen = 0

    def on_epoch_end(self, epoch) -> None:
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state) -> None:
        self.seen = state["seen"]
'''

CONFIG = '''
project: user
name: cnn
num_threads: 1
data: mydata.blobs
net: mynets.SmallCNN
criterion: torch.nn.CrossEntropyLoss
epochs: 2
batch_size: 40
callbacks:
  extra:
    - {target: mycbs.StopBelow, kwargs: {threshold: 0.0}}
    - {target: mycbs.CountEpochs}
optimize:
  n_trials: 2
  search_space:
    optimizer_config.lr: {type: float, low: 1.0e-3, high: 1.0e-2, log: true}
'''


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("fsmtrain")
    assert exe is not None, "the fsmtrain console script is not installed"
    # fsmtrain's own source only: the user's folder is on no PYTHONPATH, and the console script (not
    # `python -m`, which would put the working folder on the path) is what a user runs.
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_SERVICE", None)
    done = subprocess.run([exe, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"fsmtrain {' '.join(map(str, args))} in {cwd}:\n{out[-3000:]}"
    assert "Traceback" not in out, out
    return done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_command_finds_the_users_modules_from_another_folder(tmp_path: Path) -> None:
    project, elsewhere, third = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "third"
    for folder in (project, elsewhere, third):
        folder.mkdir()
    for name, text in (("mynets.py", NETS), ("mydata.py", DATA), ("mycbs.py", CALLBACKS), ("cnn.yaml", CONFIG)):
        (project / name).write_text(text, encoding="utf-8")
    config = project / "cnn.yaml"

    _run("validate", config, "--data", cwd=elsewhere)
    assert "StopBelow(60)" in _run("preflight", config, cwd=elsewhere).stdout
    _run("train", config, cwd=elsewhere)
    run = elsewhere / "runs" / "user" / "cnn-seed0"
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["event"] == "run_start" and start["payload"]["user_folders"] == [str(project.resolve())]
    _run("hpo", config, "--n-trials", "2", cwd=elsewhere)
    trials = sorted((elsewhere / "runs" / "user" / "cnn").glob("trial-*-seed0"))
    assert len(trials) == 2 and all((t / "model.pt").is_file() for t in trials)

    assert "reproduces the recorded trace" in _run("replay", run, cwd=project).stdout  # beside mycbs.py
    what_if = _run("replay", run, "--set", "callbacks.extra.0.kwargs.threshold=100", cwd=third).stdout
    assert "would have stopped at epoch 1 with EARLY_STOP" in what_if
    _run("resume", run, "--set", "epochs=3", cwd=third)
    epochs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs if e["event"] == "epoch"] == [0, 1, 2]
    assert "OK" in _run("audit", run, cwd=third).stdout
    _run("report", run, cwd=third)
    assert (run / "report.html").is_file()
    assert "StopBelow" in _run("diagram", "--config", config, cwd=third).stdout
