"""Replay of real recorded runs: the quickstart task trained through the config path (real Trainer,
real built-in callbacks, real W&B offline, a real Optuna study on SQLite), then replayed from its
``events.jsonl`` alone; and the ``fsmtrain replay`` command in a real subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forked_cli
import optuna
import pytest

from fsmtrain.app.config import load_config
from fsmtrain.app.job import train_seed
from fsmtrain.core.events import read_events
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.replay import ReplayError, load_recording, replay_run

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SMALL = ["data_config.n_samples=512"]  # 7 batches an epoch: the runs take about a second each

pytestmark = pytest.mark.slow  # the session fixture trains four runs (several seconds in all)


@dataclass(frozen=True)
class Runs:
    completed: Path
    early_stop: Path
    nan: Path
    pruned: Path
    study_db: Path


def _train(root: Path, name: str, overrides: list[str], trial: Any = None) -> Path:
    cfg = load_config(QUICKSTART, [*SMALL, *overrides])
    run = train_seed(cfg, cfg.seeds[0], root / name, trial=trial)
    assert run.error is None, run.error
    return root / name / "events.jsonl"


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("replay_runs")
    # debug level: per-batch transitions are in the log and must replay too
    completed = _train(root, "completed", ["epochs=12", "early_stopping.patience=50", "log_level=debug",
                                           "callbacks.overfit_detection.warmup_epochs=1",
                                           "callbacks.overfit_detection.window_size=1"])
    early = _train(root, "early_stop", ["epochs=30", "early_stopping.patience=3", "early_stopping.min_delta=0.05"])
    nan = _train(root, "nan", ["epochs=8", "optimizer=torch.optim.SGD", "optimizer_config.lr=3.0"])
    db = root / "study.db"
    # Optuna's steps count validations (from 1): no decision before the 4th (epoch 4)
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="replay",
                                pruner=optuna.pruners.ThresholdPruner(upper=0.1, n_warmup_steps=4))
    trial = study.ask()
    pruned = _train(root, "pruned", ["epochs=20"], trial=trial)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    return Runs(completed, early, nan, pruned, db)


def _result(path: Path) -> dict[str, Any]:
    return next(e["payload"] for e in read_events(path) if e["event"] == "result")


# --- acceptance 1: no overrides reproduces the recorded trace -----------------------------------
@pytest.mark.parametrize(("name", "reason"), [
    ("completed", StopReason.COMPLETED), ("early_stop", StopReason.EARLY_STOP),
    ("nan", StopReason.NAN), ("pruned", StopReason.PRUNED),
])
def test_replay_reproduces_the_recorded_trace(runs: Runs, name: str, reason: StopReason) -> None:
    path: Path = getattr(runs, name)
    assert _result(path)["stop_reason"] == reason.value  # the run really ended this way
    res = replay_run(path)
    assert res.divergence is None, res.divergence.describe()
    recorded = read_events(path)
    assert res.stop_reason is reason
    assert res.stop_epoch == _result(path)["epochs_completed"]
    # the comparison covered every transition, epoch and stop of the recording, not a subset
    for kind in ("transition", "epoch", "stop_request", "result", "trial_report"):
        assert len(res.events(kind)) == sum(e["event"] == kind for e in recorded), kind
    assert len(res.slots) == res.stop_epoch


def test_the_runs_exercise_what_they_should(runs: Runs) -> None:
    completed = read_events(runs.completed)
    assert any(e["level"] == "debug" and e["trigger"] == "batch" for e in completed)
    assert any(e["payload"].get("source") == "OverfitDetectionCallback" for e in completed if e["event"] == "warning")
    slots = [e["payload"]["slots"] for e in completed if e["event"] == "epoch"]
    assert slots[-1]["loss_prediction"]["fit_ok"] in (True, False) and "max_grad_norm" in slots[-1]
    pruned = [e["payload"] for e in read_events(runs.pruned) if e["event"] == "trial_report"]
    assert [p["should_prune"] for p in pruned][-1] is True
    study = optuna.load_study(study_name="replay", storage=f"sqlite:///{runs.study_db}")
    assert study.trials[0].state is optuna.trial.TrialState.PRUNED
    assert sorted(study.trials[0].intermediate_values) == [p["validation"] for p in pruned] == list(
        range(1, len(pruned) + 1))  # Optuna's step: the validation count


def test_pruning_replays_the_recorded_decisions_beyond_an_early_stop(runs: Runs) -> None:
    # with patience 1 early stopping fires before the pruner's recorded decision: stop moves earlier
    res = replay_run(runs.pruned, overrides=["early_stopping.patience=1", "early_stopping.min_delta=0.9"])
    assert res.stop_reason is StopReason.EARLY_STOP and res.stop_epoch is not None
    assert res.stop_epoch < _result(runs.pruned)["epochs_completed"]
    assert res.divergence is not None and res.divergence.index > 0


def test_a_tampered_recording_is_caught_and_named(runs: Runs, tmp_path: Path) -> None:
    lines = runs.early_stop.read_text().splitlines()
    stop_at = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "stop_request")
    tampered = tmp_path / "events.jsonl"
    tampered.write_text("\n".join(lines[:stop_at] + lines[stop_at + 1:]) + "\n")
    res = replay_run(tampered)
    assert res.divergence is not None
    assert res.divergence.found is not None and res.divergence.found["event"] == "stop_request"
    assert res.divergence.expected is not None and res.divergence.expected["event"] == "transition"


def test_what_if_beyond_the_recording_says_unknown(runs: Runs) -> None:
    recorded = _result(runs.early_stop)["epochs_completed"]
    res = replay_run(runs.early_stop, overrides=["early_stopping.patience=25"])
    assert (res.stop_reason, res.exhausted_after) == (None, recorded)
    assert f"unknown beyond epoch {recorded}" in res.what_if()


@pytest.mark.parametrize("item", ["optimizer_config.lr=0.1", "net_config.hidden=[8]", "batch_size=7", "data=x.y"])
def test_a_what_if_that_changes_training_itself_is_refused(runs: Runs, item: str) -> None:
    """A replay re-runs the callbacks on the recorded losses, so it refuses a change that would have
    changed those losses (a learning rate, the model, the batches, the data)."""
    with pytest.raises(ReplayError, match=f"--set {re.escape(item)}: a replay re-runs the callbacks on the losses"):
        replay_run(runs.completed, overrides=[item])
    done = _cli("replay", str(runs.completed), "--set", item)
    assert done.returncode == 2 and "not training itself" in done.stderr and "Traceback" not in done.stderr


def test_explicit_callbacks_and_errors(runs: Runs, tmp_path: Path) -> None:
    from fsmtrain.callbacks import EarlyStoppingCallback

    res = replay_run(runs.completed, callbacks=[EarlyStoppingCallback(patience=1, min_delta=0.5)])
    assert res.stop_reason is StopReason.EARLY_STOP
    with pytest.raises(ReplayError, match="no events log"):
        replay_run(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "epoch"}\n')
    with pytest.raises(ReplayError, match="no run_start event"):
        replay_run(bad)
    rec = load_recording(runs.early_stop)
    assert rec.config is not None and rec.complete_epochs == _result(runs.early_stop)["epochs_completed"]


# --- the command line ----------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return forked_cli.run(list(args), REPO, env, 300)  # forked: see tests/forked_cli.py


def test_cli_determinism_check_and_divergence_exit_code(runs: Runs, tmp_path: Path) -> None:
    for name in ("early_stop", "pruned"):
        shutil.copytree(getattr(runs, name).parent, tmp_path / "runs" / name,
                        ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    lines = runs.completed.read_text().splitlines()
    res_at = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "result")
    changed = json.loads(lines[res_at])
    changed["payload"]["best_val_loss"] = 123.0
    (tmp_path / "runs" / "tampered").mkdir()
    (tmp_path / "runs" / "tampered" / "events.jsonl").write_text(
        "\n".join([*lines[:res_at], json.dumps(changed), *lines[res_at + 1:]]) + "\n")
    (tmp_path / "runs" / "not_a_run").mkdir()
    (tmp_path / "runs" / "not_a_run" / "events.jsonl").write_text('{"event": "epoch"}\n')
    out = _cli("replay", str(tmp_path / "runs"))
    assert out.returncode == 2, out.stderr  # the unusable log is named and the others still checked
    assert "skipped" in out.stderr and "not_a_run" in out.stderr and "no run_start event" in out.stderr
    shutil.rmtree(tmp_path / "runs" / "not_a_run")
    out = _cli("replay", str(tmp_path / "runs"))
    assert out.returncode == 1, out.stderr
    assert "early_stop/events.jsonl: replay reproduces the recorded trace" in out.stdout
    assert "pruned/events.jsonl: replay reproduces the recorded trace" in out.stdout
    assert "tampered/events.jsonl: replay DIVERGES" in out.stdout
    assert f"(seq {changed['seq']})" in out.stdout and '"best_val_loss": 123.0' in out.stdout

    sweep = _cli("replay", "--sweep", "early_stopping.patience=1,2,40", str(tmp_path / "runs" / "early_stop"))
    assert sweep.returncode == 0, sweep.stderr
    table = sweep.stdout.splitlines()
    assert table[0].split()[:5] == ["run", "patience", "stop", "epoch", "stop"]
    rows = {line.split()[1]: line for line in table[1:]}
    assert "early_stop" in rows["1"] and "unknown" in rows["40"]

    bad = _cli("replay", str(runs.early_stop), "--set", "early_stopping.patience=zero")
    assert bad.returncode == 2 and "early_stopping.patience" in bad.stderr
    missing = _cli("replay", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# --- acceptance 2: a what-if agrees with training again ------------------------------------------
def test_what_if_patience_matches_training_again_on_the_same_seed(tmp_path: Path) -> None:
    common = ["--set", "data_config.n_samples=512", "--set", "epochs=30", "--set", "early_stopping.min_delta=0.05"]
    first = _cli("train", str(QUICKSTART), *common, "--set", "early_stopping.patience=12",
                 "--run-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    events = next((tmp_path / "a").rglob("events.jsonl"))
    recorded = _result(events)["epochs_completed"]

    what_if = _cli("replay", str(events), "--set", "early_stopping.patience=3", "--json")
    assert what_if.returncode == 0, what_if.stderr
    answer = json.loads(what_if.stdout)
    assert answer["stop_reason"] == "early_stop" and answer["stop_epoch"] < recorded  # the what-if matters

    again = _cli("train", str(QUICKSTART), *common, "--set", "early_stopping.patience=3",
                 "--run-dir", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr
    retrained = _result(next((tmp_path / "b").rglob("events.jsonl")))
    assert (retrained["stop_reason"], retrained["epochs_completed"]) == ("early_stop", answer["stop_epoch"])

    sentence = _cli("replay", str(events), "--set", "early_stopping.patience=3")
    assert (f"with patience 3 this run would have stopped at epoch {answer['stop_epoch']} with EARLY_STOP, "
            f"saving {recorded - answer['stop_epoch']} epochs") in sentence.stdout
