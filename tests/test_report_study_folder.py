"""``fsmtrain report STUDY_FOLDER`` renders the study page, as ``hpo-report`` accepts the same
folder: tested on the folder a real ``fsmtrain hpo`` run made, through the CLI in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest
from hpo_support import fsmtrain, study_config


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_accepts_the_folder_hpo_made(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 2})
    done = fsmtrain("hpo", cfg, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    [folder] = {p.parent for p in (tmp_path / "runs").glob("*/s/study.*")}
    assert fsmtrain("hpo-report", folder, cwd=tmp_path).returncode == 0

    made = fsmtrain("report", folder, cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    page = folder / "s-report.html"
    assert f"wrote {page}" in made.stdout, made.stdout
    html = page.read_text(encoding="utf-8")
    assert "<title>fsmtrain study s</title>" in html and 'id="plot-history"' in html
    assert "2 trials" in html
    for number in (0, 1):
        assert f'href="trial-{number}-seed0/report.html"' in html  # each trial's run report is linked
        assert (folder / f"trial-{number}-seed0" / "report.html").is_file()


@pytest.mark.timeout(60)
def test_a_folder_with_neither_a_run_log_nor_a_study_is_still_refused(tmp_path: Path) -> None:
    done = fsmtrain("report", tmp_path, cwd=tmp_path)
    assert done.returncode == 2
    assert "a folder without events.jsonl" in done.stderr and "Traceback" not in done.stderr
