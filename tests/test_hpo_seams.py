"""Where ``fsmtrain hpo`` meets the other commands: a ``--workers`` study is found by ``validate`` and
by ``hpo`` without ``--workers``, and the run paths it prints read as the README shows them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hpo_support import fsmtrain, journal, load, study_config


def _ok(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = fsmtrain(*args, cwd=cwd, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_workers_study_is_found_by_validate_and_by_hpo_without_workers(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "RandomSampler"})
    _ok("hpo", cfg, "--workers", "2", cwd=tmp_path)
    checked = _ok("validate", cfg, cwd=tmp_path)
    assert "--workers" not in checked.stdout + checked.stderr
    again = _ok("hpo", cfg, "--n-trials", "1", cwd=tmp_path)
    assert "study.journal" in again.stdout
    study = load(journal(tmp_path / "runs" / "quickstart" / "s" / "study.journal"))
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hpo_prints_run_paths_relative_to_the_working_directory(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "RandomSampler"})
    done = _ok("hpo", cfg, cwd=tmp_path)
    lines = done.stdout.splitlines()
    trials = [line for line in lines if line.startswith("trial ")]
    assert len(trials) == 2, done.stdout
    for number, line in enumerate(trials):
        assert line.endswith(f" -> runs/quickstart/s/trial-{number}-seed0"), line
    assert any(line.startswith("  run dir: runs/quickstart/s/trial-") for line in lines), done.stdout
    assert str(tmp_path) not in done.stdout.replace(f"fsmtrain train {cfg}", "")
