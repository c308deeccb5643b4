"""A Trainer resumed with other objects than its run was trained with is refused, naming the
difference, as ``fsmtrain resume`` refuses a changed config."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import tiny_model, tiny_task
from torch import nn

from fsmtrain import Trainer
from fsmtrain.app.rundir import LOCK_FILE
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.training.checkpoint import load_checkpoint
from fsmtrain.training.resume import ResumeError
from fsmtrain.training.resume_match import mismatches

Build = Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]


def _adam(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


def _trainer(run_dir: Path, build: Build, *, epochs: int, model: nn.Module | None = None, **kw: Any) -> Trainer:
    torch.set_num_threads(1)
    model = model if model is not None else tiny_model(0)
    opt, scheduler = build(model)
    train, val = tiny_task(0)
    return Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, scheduler=scheduler,
                   callbacks=[CheckpointCallback(run_dir / "checkpoints")], run_dir=run_dir,
                   console_level="error", default_callbacks=False, **kw)


@pytest.fixture
def adam_run(tmp_path: Path) -> Path:
    _trainer(tmp_path, _adam, epochs=2).fit()
    return tmp_path


def _sgd(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)


def _no_scheduler(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    return torch.optim.Adam(model.parameters(), lr=0.01), None


def _cosine(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)


def _wider() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


@pytest.mark.parametrize(("build", "model", "named"), [
    (_sgd, None, "optimizer: the run was trained with Adam, this Trainer has SGD"),
    (_no_scheduler, None, "scheduler: the run was trained with StepLR, this Trainer has none"),
    (_cosine, None, "scheduler: the run was trained with StepLR, this Trainer has CosineAnnealingLR"),
    (_adam, _wider, "model: 3 tensor(s) changed shape (0.weight (16, 8) -> (32, 8)"),
], ids=["optimizer", "no-scheduler", "other-scheduler", "model"])
def test_a_resume_with_other_objects_is_refused_naming_the_difference(
        adam_run: Path, build: Build, model: Callable[[], nn.Module] | None, named: str) -> None:
    """An Adam run resumed with SGD is refused in one line, not a `KeyError: 'momentum'` traceback."""
    before = {p: p.read_bytes() for p in adam_run.rglob("*") if p.is_file()}
    with pytest.raises(ResumeError) as info:
        _trainer(adam_run, build, epochs=4, model=model() if model else None, resume_from="latest")
    message = str(info.value)
    assert named in message, message
    # epoch_2.pt, latest.pt and best.pt are one file (the newest state): the message names it by one of them
    assert re.search(r"cannot resume from checkpoints/(epoch_2|latest|best)\.pt:", message), message
    assert "build the Trainer with the model, optimizer and scheduler the run was trained with" in message
    assert {p: p.read_bytes() for p in adam_run.rglob("*") if p.is_file()} == before
    assert not (adam_run / LOCK_FILE).exists()
    assert _trainer(adam_run, _adam, epochs=3, resume_from="latest").fit().epochs_completed == 3


def test_a_checkpoint_without_recorded_classes_is_compared_by_its_state(adam_run: Path) -> None:
    state = load_checkpoint(adam_run / "checkpoints" / "latest.pt")
    assert state["classes"]["optimizer"] == "torch.optim.adam.Adam"
    del state["classes"]  # as a checkpoint written before the classes were recorded
    model = tiny_model(0)
    sgd, step = _sgd(model)
    problems = mismatches(state, model, sgd, step)
    assert len(problems) == 1 and "optimizer: the run's has hyper-parameters" in problems[0]
    assert "'betas'" in problems[0] and "'momentum'" in problems[0]
    adam, _ = _no_scheduler(model)
    assert mismatches(state, model, adam, None) == [
        "scheduler: the run was trained with one, this Trainer has none"]
    assert mismatches(state, model, *_adam(model)) == []
