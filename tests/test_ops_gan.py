"""configs/gan.yaml (two named optimizers, a manual step) through real ``fsmtrain`` processes: one
killed with SIGKILL inside its second epoch, after a step checkpoint, and resumed, bitwise equal to an
uninterrupted run in both models and both optimizers' states; audit, and predict over its val data."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from resume_harness import REPO, env

from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.data import two_moons
from fsmtrain.training.models import GAN

# Holds the process at global step 17 (epoch 2, after step_15.pt) while FSMTRAIN_TEST_HOLD names a file
# to create, so the test kills it there; a resume, without the variable, passes straight through.
HOLD = '''
import os, time
from fsmtrain import TrainingCallback


class HoldAtStep(TrainingCallback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, step):
        marker = os.environ.get("FSMTRAIN_TEST_HOLD")
        if marker and step.run.global_step == self.step:
            open(marker, "w").close()
            time.sleep(120)
'''
RUN = Path("runs") / "gan" / "two-moons-seed0"


def _config(root: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "gan.yaml").read_text())
    cfg.update(epochs=3, checkpoint={"every_n_steps": 5, "background": False})
    cfg["schedulers"]["gen"]["kwargs"]["step_size"] = 1  # the scheduler's state moves every epoch
    cfg["callbacks"]["extra"] = [{"target": "opshold.HoldAtStep", "kwargs": {"step": 17}}]
    (root / "opshold.py").write_text(textwrap.dedent(HOLD))
    (root / "gan.yaml").write_text(yaml.safe_dump(cfg))
    return root / "gan.yaml"


def _cli(cwd: Path, *args: str, hold: Path | None = None) -> subprocess.Popen[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    extra = {"FSMTRAIN_TEST_HOLD": str(hold)} if hold else {}
    return subprocess.Popen([sys.executable, "-m", "fsmtrain", *args], cwd=cwd, env={**env(), **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ok(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err
    return out + err


def _trained(run: Path) -> dict[str, Any]:
    state = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)
    return {"model": state["model"], "optimizer": state["optimizer"], "scheduler": state["scheduler"]}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gan_killed_mid_epoch_resumes_bitwise(tmp_path: Path) -> None:
    config = _config(tmp_path)
    full, cut = tmp_path / "full", tmp_path / "cut"
    whole = _cli(full, "train", str(config))
    marker = tmp_path / "held"
    killed = _cli(cut, "train", str(config), hold=marker)
    deadline = time.monotonic() + 200
    while not marker.exists():
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    _ok(whole)
    log = (cut / RUN / "events.jsonl").read_text()
    assert "checkpoints/step_15.pt" in log and '"event":"result"' not in log  # cut inside epoch 2
    _ok(_cli(tmp_path / "elsewhere", "resume", str(cut / RUN)))
    resumed = [e["payload"] for e in read_events(cut / RUN / "events.jsonl") if e["event"] == "resume"]
    assert [(r["global_step"], r["batch"]) for r in resumed] == [(15, 3)]  # inside epoch 2, from step 15
    a, b = _trained(full / RUN), _trained(cut / RUN)
    assert set(a["optimizer"]["optimizers"]) == {"gen", "disc"} and set(a["scheduler"]) == {"gen"}
    assert all(a["optimizer"]["optimizers"][n]["state"] for n in ("gen", "disc"))  # both stepped
    assert _equal(a, b)
    assert a["scheduler"]["gen"]["last_epoch"] == 3
    report = audit_file(cut / RUN / "events.jsonl")
    assert report.ok, report.render(False)
    # predict: the run's val step (its own) over its val data, one row per example in order
    preds = tmp_path / "preds.pt"
    _ok(_cli(tmp_path, "predict", str(full / RUN), "--checkpoint", "latest", "--out", str(preds)))
    got = torch.load(preds, weights_only=True)["predictions"]["output"]
    model = GAN(2, 4, [32])
    model.load_state_dict(a["model"])
    val = two_moons(batch_size=32, seed=0, n_samples=512).val
    assert val is not None
    points = torch.cat(list(val))
    assert got.shape == (128, 1) and torch.allclose(got, model(points).detach())
