"""``max_steps`` ends a run at that global step, with or without ``epochs``; whichever budget runs out
first wins and the stop reason says which. Real runs: the CLI in a subprocess and the Python API,
then the audit and the replay of their logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forked_cli
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.app.trainer import Trainer
from fsmtrain.core.context import StepContext
from fsmtrain.core.events import read_events
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.replay import replay_run

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


def _train(cwd: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1"}
    args = [a for s in ("wandb.enabled=false", *sets) for a in ("--set", s)]
    return forked_cli.run(["train", str(QUICKSTART), *args], cwd, env, timeout=240)


def _result(events: Path) -> dict[str, object]:
    return next(e["payload"] for e in read_events(events) if e["event"] == "result")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("epochs", ["20", "null"])
def test_the_cli_ends_mid_epoch_at_max_steps_and_audit_and_replay_agree(tmp_path: Path, epochs: str) -> None:
    proc = _train(tmp_path, "max_steps=40", f"epochs={epochs}", "scheduler_config.T_max=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = tmp_path / RUN / "events.jsonl"
    result = _result(events)
    # 1638 training rows in batches of 64: 26 batches an epoch, so step 40 is batch 14 of epoch 2
    assert result["stop_reason"] == StopReason.STEPS.value and result["global_step"] == 40
    assert result["epochs_completed"] == 2
    assert "STEPS after 2 epoch(s) (max_steps reached: step 40)" in proc.stdout
    start = next(e["payload"] for e in read_events(events) if e["event"] == "run_start")
    assert start["max_steps"] == 40
    batches = [e["payload"]["batches"] for e in read_events(events) if e["event"] == "epoch"]
    assert batches == [26, 14]
    end = next(e for e in read_events(events) if e["event"] == "transition" and e["to"] == "train_end")
    assert end["payload"]["source"] == "max_steps" and end["payload"]["message"] == "reached max_steps=40"
    report = audit_file(events)
    assert not report.violations, [f.message for f in report.violations]
    assert report.explanation.stop_message == "reached max_steps=40"
    replay = replay_run(events)
    assert replay.divergence is None, replay.divergence.describe()
    assert replay.stop_reason is StopReason.STEPS
    assert "epoch_2.pt" in {p.name for p in (tmp_path / RUN / "checkpoints").iterdir()}


def test_an_audit_rejects_a_max_steps_stop_the_steps_do_not_explain(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", max_epochs=3, max_steps=7)
    trainer.fit()
    events = tmp_path / "run" / "events.jsonl"
    assert not audit_file(events, verify_checkpoints=False).violations
    lines = events.read_text().splitlines()
    forged = []
    for line in lines:  # the run_start claims a larger budget than the steps that ran
        rec = json.loads(line)
        if rec["event"] == "run_start":
            line = line.replace('"max_steps":7', '"max_steps":9')
        forged.append(line)
    tampered = tmp_path / "forged.jsonl"
    tampered.write_text("\n".join(forged) + "\n")
    found = " ".join(f.message for f in audit_file(tampered, verify_checkpoints=False).violations)
    assert "max_steps" in found


class _Steps(TrainingCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    def on_train_step_end(self, step: StepContext) -> None:
        self.seen.append((step.epoch.index, step.batch_index, step.last_batch))


def _trainer(run_dir: Path | None, *, max_epochs: int | None, max_steps: int | None,
             callbacks: list[TrainingCallback] | None = None) -> Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    model = nn.Linear(3, 1)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                   DataLoader(data, batch_size=8), DataLoader(data, batch_size=8), max_epochs=max_epochs,
                   max_steps=max_steps, callbacks=callbacks or [], run_dir=run_dir, default_callbacks=False)


@pytest.mark.parametrize(("max_epochs", "max_steps", "reason", "steps", "epochs"), [
    (10, 7, StopReason.STEPS, 7, 2),  # steps first, mid-epoch
    (1, 100, StopReason.COMPLETED, 5, 1),  # epochs first
    (None, 12, StopReason.STEPS, 12, 3),  # no epoch bound at all
    (2, 10, StopReason.STEPS, 10, 2),  # both at once: the step budget is named
])
def test_whichever_budget_runs_out_first_ends_the_run(max_epochs: int | None, max_steps: int, reason: StopReason,
                                                      steps: int, epochs: int) -> None:
    seen = _Steps()
    result = _trainer(None, max_epochs=max_epochs, max_steps=max_steps, callbacks=[seen]).fit()
    assert (result.stop_reason, result.global_step, result.epochs_completed) == (reason, steps, epochs)
    assert len(seen.seen) == steps
    # the batch at max_steps is its epoch's last: gradient accumulation flushes on it
    assert seen.seen[-1][2] is True
    assert [s for s in seen.seen if s[2]] == [s for s in seen.seen if s[1] == 4 or s == seen.seen[-1]]


def test_max_steps_is_checked_like_every_argument() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
            _trainer(None, max_epochs=1, max_steps=bad)  # type: ignore[arg-type]


def test_a_config_needs_epochs_or_max_steps(tmp_path: Path) -> None:
    env = {**os.environ, "CI": "1"}
    proc = subprocess.run([sys.executable, "-m", "fsmtrain", "validate", str(QUICKSTART), "--set", "epochs=null"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "set epochs or max_steps" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
