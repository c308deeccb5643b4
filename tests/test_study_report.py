"""The study report and the pruning explanations on a study made by the real ``fsmtrain hpo``:
each trial row links the trial's run report, and a pruning decision is explained by what the
pruner saw when it decided."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
from hpo_support import load, study_config
from optuna.trial import TrialState

from fsmtrain.cli import main

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Study:
    root: Path
    db: Path
    good: int  # a trial that completed first
    pruned: int  # a trial MedianPruner pruned against it
    later: tuple[int, ...]  # complete trials that finished after the decision


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Study]:
    """Trial 0 (lr 0.03) completes; trial 1 (lr 1e-7, learns nothing) is pruned by MedianPruner at
    its first validation; then three trials finish with a far worse value at that validation (added through
    Optuna's API: what trials finishing later leave in a study)."""
    root = tmp_path_factory.mktemp("study_report")
    db = root / "runs" / "quickstart" / "s" / "study.db"
    cwd = Path.cwd()
    os.chdir(root)
    try:
        db.parent.mkdir(parents=True)
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        created = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
        for lr in (0.03, 1e-7):
            created.enqueue_trial({"optimizer_config.lr": lr})
        space = {"optimizer_config.lr": {"type": "float", "low": 1e-8, "high": 0.1, "log": True}}
        cfg = study_config(root, {"n_trials": 2, "search_space": space, "pruner": "MedianPruner",
                                  "pruner_config": {"n_startup_trials": 1, "n_warmup_steps": 0}})
        assert main(["hpo", str(cfg)]) == 0
        done = load(f"sqlite:///{db}")
        assert [t.state for t in done.trials] == [TrialState.COMPLETE, TrialState.PRUNED], done.trials
        dist = done.trials[0].distributions
        for _ in range(3):
            done.add_trial(optuna.trial.create_trial(
                params={"optimizer_config.lr": 0.05}, distributions=dist, value=100.0,
                intermediate_values={s: 100.0 for s in done.trials[0].intermediate_values}))
        yield Study(root, db, 0, 1, (2, 3, 4))
    finally:
        os.chdir(cwd)


def test_the_study_report_links_every_trials_run_report(study: Study, capsys: pytest.CaptureFixture[str]) -> None:
    """`fsmtrain report STUDY --study NAME` links each row's run report: hpo stores a trial's run dirs
    as {seed: dir}, and the report reads them so."""
    os.chdir(study.root)
    capsys.readouterr()
    assert main(["report", str(study.db.relative_to(study.root)), "--study", "s"]) == 0
    out = capsys.readouterr().out
    folder = study.db.parent
    page = (folder / "s-report.html").read_text(encoding="utf-8")
    assert "(not found)" not in page  # the three trials added without runs show '-'
    for number in (study.good, study.pruned):
        report = folder / f"trial-{number}-seed0" / "report.html"
        assert report.is_file() and f"wrote {report}" in out, out
        assert f'<a href="trial-{number}-seed0/report.html">trial-{number}-seed0</a>' in page
    assert "{'0':" not in page


def test_a_pruning_is_explained_by_the_trials_complete_when_it_was_decided(
        study: Study, capsys: pytest.CaptureFixture[str]) -> None:
    """hpo-report quotes the median over the trials complete when the pruner decided, not over trials
    that finished later (which the pruned trial's value might beat)."""
    os.chdir(study.root)
    capsys.readouterr()
    assert main(["hpo-report", str(study.db.relative_to(study.root))]) == 0
    text = capsys.readouterr().out
    trials = load(f"sqlite:///{study.db}").trials
    n = trials[study.pruned].last_step  # Optuna's step: the validation count, its first validation
    step = trials[study.pruned].user_attrs["pruned"]["step"]  # the global step W&B and TensorBoard show
    assert n == 1 == min(trials[study.good].intermediate_values) and step > 1
    seen = trials[study.good].intermediate_values[n]  # the only trial complete at the decision
    value = trials[study.pruned].intermediate_values[n]
    assert value > seen  # MedianPruner's own rule, on what it saw: worse than the median, pruned
    line = next(line for line in text.splitlines() if f"trial {study.pruned} pruned" in line)
    assert line == (f"  trial {study.pruned} pruned at validation 1 (epoch 1, step {step}, val_loss {value:.6g}) by "
                    f"MedianPruner (median at that validation over the 1 trial complete at the decision: {seen:.6g})")
    assert trials[study.pruned].user_attrs["pruned"]["epoch"] == 1
    # the trials that finished later are in the study, and their values would have put the median above it
    later = sorted([seen, *(trials[other].intermediate_values[n] for other in study.later)])
    assert len(later) == 4 and (later[1] + later[2]) / 2 > value
    assert main(["hpo-report", str(study.db.relative_to(study.root)), "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    (decision,) = report["pruned"]
    assert [decision[k] for k in ("optuna_step", "validation", "epoch", "step")] == [1, 1, 1, step]
    assert decision["others_at_validation"] == {"n": 1, "median": seen, "basis": "complete at the decision"}
    assert math.isclose(decision["best_so_far"], value)
    assert re.fullmatch(r"\d+\.\d+", str(trials[study.pruned].user_attrs["pruned"]["decided_at"]))
