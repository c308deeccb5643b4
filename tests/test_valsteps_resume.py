"""Validations inside epochs survive a real ``kill -9``: a run with ``val_every_n_steps`` and
``checkpoint.every_n_steps`` killed after a mid-epoch validation resumes from the step checkpoint
written before that validation, validates there again and ends with weights bit for bit those of the
uninterrupted run, and the same validations (count, epoch, step, values). Pruning reports each
validation at its count, as Optuna's own storage reads it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from steps_support import RUN, events, fsmtrain, kill_and_resume, same_bits, weights, write_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.app.trainer import Trainer
from fsmtrain.callbacks import PrunerCallback
from fsmtrain.core.events import read_events
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.auditor import audit_file


def _validations(run_dir: Path) -> list[tuple[int, int, int, Any]]:
    """Each validation as the run's log has it last (a resumed run validates again where it continues)."""
    found = {e["payload"]["validation"]: (e["epoch"], e["global_step"], e["payload"]["metrics"])
             for e in events(run_dir) if e["event"] == "validation"}
    return [(n, *found[n]) for n in sorted(found)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_after_a_mid_epoch_validation_resumes_bit_identical_with_the_same_validations(tmp_path: Path) -> None:
    config = write_config(tmp_path, epochs=2, val_every_n_steps=6, **{
        "checkpoint.every_n_steps": 6, "checkpoint.background": False, "checkpoint.keep_last_k": 1,
        "checkpoint.save_best": False})  # no best at a validation: the newest state is the one before it
    (tmp_path / "ref").mkdir()
    done = fsmtrain(tmp_path / "ref", "train", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    ref = tmp_path / "ref" / RUN
    (tmp_path / "killed").mkdir()
    # killed as step 33 begins (validation 6 at step 30 done; the state of step 30 written just before it)
    run_dir, resume = kill_and_resume(tmp_path / "killed", config, "step:32")
    assert resume is not None and resume["global_step"] == 30 and resume["batch"] == 4
    assert resume["validations"] == 5 and resume["validated_at"] == 26  # step 30's validation is done again
    assert same_bits(weights(ref), weights(run_dir))
    expected = _validations(ref)
    assert [v[:3] for v in expected] == [(1, 0, 6), (2, 0, 12), (3, 0, 18), (4, 0, 24), (5, 0, 26), (6, 1, 30),
                                         (7, 1, 36), (8, 1, 42), (9, 1, 48), (10, 1, 52)]
    assert _validations(run_dir) == expected
    report = audit_file(run_dir / "events.jsonl")
    assert not report.violations, [f.message for f in report.violations]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_pruner_reports_each_validation_at_its_count(tmp_path: Path) -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage,
                                pruner=optuna.pruners.ThresholdPruner(upper=-1.0, n_warmup_steps=4))
    trial = study.ask()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    model = nn.Linear(3, 1)
    # 5 batches an epoch, a validation every 2 steps: at 2, 4, 5 (the end), 6... the 4th prunes, inside epoch 2
    result = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                     DataLoader(data, batch_size=8), DataLoader(data, batch_size=8), max_epochs=3, val_every_n_steps=2,
                     callbacks=[PrunerCallback(trial)], run_dir=tmp_path / "run", default_callbacks=False).fit()
    assert result.stop_reason is StopReason.PRUNED and result.global_step == 6 and result.epochs_completed == 2
    read = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert sorted(read.intermediate_values) == [1, 2, 3, 4]
    assert {k: read.user_attrs["pruned"][k] for k in ("validation", "epoch", "step")} == {
        "validation": 4, "epoch": 2, "step": 6}
    log = read_events(tmp_path / "run" / "events.jsonl")
    assert [(e["payload"]["validation"], e["global_step"]) for e in log if e["event"] == "trial_report"] == [
        (1, 2), (2, 4), (3, 5), (4, 6)]
    assert "pruned at validation 4 (epoch 2, step 6)" in next(
        e["payload"]["message"] for e in log if e["event"] == "stop_request")
    assert not audit_file(tmp_path / "run" / "events.jsonl", verify_checkpoints=False).violations


@pytest.mark.timeout(120)
def test_a_best_after_a_mid_epoch_validation_is_a_step_checkpoint_with_the_best_role(tmp_path: Path) -> None:
    from fsmtrain.callbacks import CheckpointCallback
    from fsmtrain.training.checkpoint import load_checkpoint

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    model = nn.Linear(3, 1)
    ckpts = tmp_path / "checkpoints"
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), DataLoader(data, batch_size=8),
            DataLoader(data, batch_size=8), max_epochs=2, val_every_n_steps=3, run_dir=tmp_path,
            callbacks=[CheckpointCallback(ckpts, background=False)], default_callbacks=False).fit()
    log = read_events(tmp_path / "events.jsonl")
    vals = {e["global_step"]: e["payload"]["metrics"]["val_loss"] for e in log if e["event"] == "validation"}
    best_step = min(vals, key=lambda s: vals[s])
    assert best_step in (3, 6, 9)  # inside an epoch (5 batches each): the loss still falls at its last validation
    roles = [(e["global_step"], e["payload"]["path"]) for e in log
             if e["event"] == "checkpoint" and "best" in e["payload"].get("roles", [])]
    assert roles[-1] == (best_step, f"checkpoints/step_{best_step}.pt")
    best = load_checkpoint(ckpts / "best.pt")
    assert best["step"] == best_step and best["position"]["batch"] == best_step - 5 * (best_step // 5)
    assert best["best"]["value"] == vals[best_step]
    assert not audit_file(tmp_path / "events.jsonl").violations
