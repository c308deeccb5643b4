"""Where ``fsmtrain hpo`` meets the other commands: a ``--workers`` study is found by ``validate`` and
by ``hpo`` without ``--workers``, and the run paths it prints read as the README shows them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hpo_support import fsmtrain, journal, load, study_config


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_workers_study_is_found_by_validate_and_by_hpo_without_workers(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "RandomSampler"})
    first = fsmtrain("hpo", cfg, "--workers", "2", cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    checked = fsmtrain("validate", cfg, cwd=tmp_path, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "--workers" not in checked.stdout + checked.stderr
    again = fsmtrain("hpo", cfg, "--n-trials", "1", cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "study.journal" in again.stdout
    study = load(journal(tmp_path / "runs" / "quickstart" / "s" / "study.journal"))
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hpo_prints_run_paths_relative_to_the_working_directory(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "RandomSampler"})
    done = fsmtrain("hpo", cfg, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    trials = [line for line in lines if line.startswith("trial ")]
    assert len(trials) == 2, done.stdout
    for number, line in enumerate(trials):
        assert line.endswith(f" -> runs/quickstart/s/trial-{number}-seed0"), line
    assert any(line.startswith("  run dir: runs/quickstart/s/trial-") for line in lines), done.stdout
    assert str(tmp_path) not in done.stdout.replace(f"fsmtrain train {cfg}", "")
