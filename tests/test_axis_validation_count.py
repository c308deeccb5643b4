"""Optuna's step is the run's validation count (issue 41: pruning counts validations): a resumed run
continues the count from its checkpoint, and a checkpoint written without the pruner's state continues
it from the epochs done (one validation each); a log or a study made before the count still reads."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from core_helpers import make_trainer

from fsmtrain.app.hpo.monitor import describe_trial
from fsmtrain.callbacks import CheckpointCallback, PrunerCallback
from fsmtrain.core.events import read_events
from fsmtrain.tools.replay.recording import recording_from_events
from fsmtrain.training.checkpoint import load_checkpoint


def _fit(run_dir: Path, epochs: int, trial: optuna.trial.Trial | None, resume_from: str | None = None) -> None:
    pruner = [] if trial is None else [PrunerCallback(trial)]
    make_trainer(run_dir, [CheckpointCallback(run_dir / "checkpoints", keep_last_k=1), *pruner],
                 epochs=epochs, resume_from=resume_from).fit()


def _trial() -> tuple[optuna.study.Study, optuna.trial.Trial]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    return study, study.ask()


@pytest.mark.timeout(120)
def test_a_resumed_trial_continues_the_validation_count_from_its_checkpoint(tmp_path: Path) -> None:
    study, trial = _trial()
    _fit(tmp_path, 2, trial)
    assert load_checkpoint(tmp_path / "checkpoints" / "latest.pt")["callbacks"]["PrunerCallback"] == {"validations": 2}
    _fit(tmp_path, 4, trial, resume_from="latest")
    assert sorted(study.trials[0].intermediate_values) == [1, 2, 3, 4]
    reports = [(e["payload"]["validation"], e["epoch"] + 1) for e in read_events(tmp_path / "events.jsonl")
               if e["event"] == "trial_report"]
    assert reports == [(1, 1), (2, 2), (3, 3), (4, 4)]


@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_pruner_state_continues_from_its_epochs(tmp_path: Path) -> None:
    study, trial = _trial()
    _fit(tmp_path, 2, None)
    _fit(tmp_path, 3, trial, resume_from="latest")
    assert sorted(study.trials[0].intermediate_values) == [3]


@pytest.mark.timeout(120)
def test_a_log_and_a_study_from_before_the_count_still_read(tmp_path: Path) -> None:
    _, trial = _trial()
    _fit(tmp_path, 3, trial)
    events = read_events(tmp_path / "events.jsonl")
    now = recording_from_events(events).trial_reports
    for e in events:  # as the 0-based epoch index named Optuna's step before
        if e["event"] == "trial_report":
            e["payload"] = {"epoch": e["epoch"], **{k: v for k, v in e["payload"].items() if k != "validation"}}
    assert recording_from_events(events).trial_reports == now and sorted(now) == [1, 2, 3]
    old = optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, intermediate_values={0: 1.0, 1: 2.0},
                                    user_attrs={"pruned": {"epoch": 1, "pruner": "MedianPruner"}})
    assert "PRUNED at Optuna step 1 by MedianPruner" in describe_trial(old)  # not a misnamed validation or epoch
