"""``fsmtrain report`` without a browser: what the pages hold for real runs that ended every way, the
study storage forms, the CLI's one-line errors, and that a run report imports neither torch nor Optuna.
(tests/test_report_browser.py renders the pages in Chromium.)"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import optuna
import pytest
from audit_runs import REPO, RealRuns, read_lines
from optuna.storages.journal import JournalFileBackend

from fsmtrain.cli import main as cli_main
from fsmtrain.tools.report import render_report, write_run_report
from fsmtrain.tools.report.run import RUN_PLOTS
from fsmtrain.tools.report.run_log import read_run
from fsmtrain.tools.report.study import STUDY_PLOTS
from fsmtrain.tools.report.svgplot import ticks


def _ids(html: str) -> set[str]:
    return set(re.findall(r'<(?:figure|section) class="[^"]*" id="([^"]+)"', html))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsmtrain", "report", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))


# --- run reports ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("name", "reason", "why"), [
    ("completed", "completed", "reached max_epochs=4"),
    ("early_stopped", "early_stop", "did not improve"),
    ("nan", "nan", "NaNDetectionCallback"),
    ("pruned", "pruned", "PrunerCallback"),
    ("errored", "error", "disk full"),
    ("interrupted_sigint", "interrupted", "signal SIGINT"),
])
def test_every_way_a_run_ends_gets_a_page(real_runs: RealRuns, tmp_path: Path, name: str, reason: str,
                                          why: str) -> None:
    out = write_run_report(real_runs.events(name), tmp_path / "r.html")
    html = out.read_text(encoding="utf-8")
    assert _ids(html) >= set(RUN_PLOTS)
    stop = html[html.index('id="stop"'):html.index('id="checkpoints"')]
    assert f"<td>{reason}</td>" in stop and why in stop, stop
    assert "<script" not in html and not re.findall(r"https?://(?!www\.w3\.org/)", html)  # only XML namespaces
    assert stat.S_IMODE(out.stat().st_mode) & 0o044  # an ordinary readable file, not mkstemp's 0600


@pytest.mark.slow
def test_a_run_page_shows_what_the_log_holds(real_runs: RealRuns, tmp_path: Path) -> None:
    events = real_runs.events("early_stopped")
    data = read_run(events)[0]
    html = write_run_report(events, tmp_path / "r.html").read_text(encoding="utf-8")
    records = [json.loads(line) for line in read_lines(events)]
    # every checkpoint the log committed, with its sha256
    for r in records:
        if r["event"] == "checkpoint":
            assert r["payload"]["sha256"] in html
    # the early-stopping counter against the patience (2), and the grad-norm threshold line
    waits = data.slot("early_stopping_wait")
    assert waits == [0.0, 1.0, 2.0] and "patience 2" in html
    grad = html[html.index('id="plot-grad-norm"'):html.index('id="plot-overfit"')]
    assert "threshold not in the log" in grad  # no GradientMonitorCallback in this run: no threshold to draw
    assert "Audit: <span class=\"ok\">OK" in html and "fsmtrain lifecycle" in html


@pytest.mark.slow
def test_an_old_log_without_settings_events_still_renders(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = [line for line in read_lines(real_runs.events("completed")) if '"callback_settings"' not in line]
    run = tmp_path / "old"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(lines), encoding="utf-8")
    html = write_run_report(run / "events.jsonl").read_text(encoding="utf-8")
    assert _ids(html) >= set(RUN_PLOTS) and "no early-stopping counter in the log" in html


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_report_imports_neither_torch_nor_optuna(real_runs: RealRuns, tmp_path: Path) -> None:
    code = ("import sys; from fsmtrain.tools.report import render_report; "
            "from pathlib import Path; "
            f"render_report({str(real_runs.completed)!r}, out=Path({str(tmp_path / 'r.html')!r})); "
            "bad = [m for m in ('torch', 'optuna', 'numpy', 'scipy') if m in sys.modules]; "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r.html").stat().st_size > 10_000


# --- study reports --------------------------------------------------------------------------------
def _study(storage: object, name: str, n: int = 6) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage,  # type: ignore[arg-type]
                                sampler=optuna.samplers.RandomSampler(seed=1),
                                pruner=optuna.pruners.ThresholdPruner(upper=0.8))
    for _ in range(n):
        trial = study.ask()
        x = trial.suggest_float("x", -1.0, 1.0)
        opt = trial.suggest_categorical("opt", ["adam", "sgd"])
        pruned = False
        for step in range(4):
            value = x * x + (0.1 if opt == "adam" else 0.3) + 1.0 / (step + 1)
            trial.report(value, step)
            if trial.should_prune():
                pruned = True
                break
        trial.set_user_attr("run_dirs", ["runs/nowhere"])
        if pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
    return study


def test_study_from_sqlite_file_and_journal(tmp_path: Path) -> None:
    _study(f"sqlite:///{tmp_path / 's.db'}", "only")
    out, made = render_report(str(tmp_path / "s.db"))  # the storage's only study, no --study needed
    assert out == tmp_path / "only-report.html" and made == []
    html = out.read_text(encoding="utf-8")
    assert _ids(html) >= set(STUDY_PLOTS) and "runs/nowhere (not found)" in html
    journal = tmp_path / "journal.log"
    _study(optuna.storages.JournalStorage(JournalFileBackend(str(journal))), "j")
    out, _ = render_report(str(journal), study="j", out=tmp_path / "j.html")
    assert _ids(out.read_text(encoding="utf-8")) >= set(STUDY_PLOTS)


@pytest.mark.parametrize(("args", "message"), [
    (["missing-dir"], "missing-dir: no such run directory, events.jsonl or study storage file"),
    (["empty"], "empty: a folder without events.jsonl; pass a run directory, its events.jsonl, or a study storage "
                "(a SQLite file, an Optuna journal file or a URL)"),
    (["notes.txt"], "notes.txt: neither a run's events.jsonl nor an Optuna storage (a SQLite file or an Optuna "
                    "journal file)"),
    (["two.db"], "two.db: pass --study NAME; the storage has 2 studies (a, b)"),
    (["other.db"], "other.db: a SQLite file without Optuna's tables, not a study storage"),
    (["empty.db"], "empty.db: neither a run's events.jsonl nor an Optuna storage (a SQLite file or an Optuna "
                   "journal file)"),
    (["two.db", "--study", "c"], "two.db: no study 'c'; it has: a, b"),
])
def test_cli_errors_are_one_line(tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "empty.db").write_bytes(b"")
    with closing(sqlite3.connect(tmp_path / "other.db")) as db:
        db.execute("CREATE TABLE t (x)")
    for name in ("a", "b"):
        optuna.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'two.db'}")
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.chdir(tmp_path)
    assert cli_main(["report", *args]) == 2
    out, err = capsys.readouterr()
    assert err == f"fsmtrain report: {message}\n" and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no database created
    with closing(sqlite3.connect(tmp_path / "other.db")) as db:  # Optuna added no tables to a foreign file
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["t"]


def test_an_output_that_is_a_folder_is_named_as_given(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """-o somedir failed naming a temp file ('.../.somedir.q1k4ij8s: Is a directory'), after the work."""
    _study(optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}"), "s", n=2)
    (tmp_path / "somedir").mkdir()
    (tmp_path / "afile").write_text("mine\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    for out, message in (("somedir", "somedir: expected a file to write the HTML page to; found a folder"),
                         ("afile/r.html", "afile/r.html: expected a file in a folder; found afile, a file")):
        assert cli_main(["report", "study.db", "-o", out]) == 2
        assert capsys.readouterr() == ("", f"fsmtrain report: {message}\n")
        with pytest.raises(ValueError, match=re.escape(message)):  # the library call says the same
            render_report("study.db", out=Path(out))
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "afile").read_text(encoding="utf-8") == "mine\n"


@pytest.mark.slow
def test_cli_writes_the_run_report(real_runs: RealRuns, tmp_path: Path) -> None:
    res = _cli(str(real_runs.events("completed")), "-o", str(tmp_path / "x.html"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'x.html'))} \(\d+ kB\)\n", res.stdout)
    assert cli_main(["report", str(tmp_path / "nothing-here")]) == 2


def test_ticks() -> None:
    assert ticks(0.07, 0.52, log=True) == pytest.approx([0.1, 0.2, 0.5])
    assert ticks(0.5, 2e4, log=True) == pytest.approx([0.1, 1, 10, 100, 1000, 1e4, 1e5])
    assert ticks(0.0, 1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert ticks(-3.0, 7.0) == pytest.approx([-2.0, 0.0, 2.0, 4.0, 6.0])


@pytest.mark.slow
def test_the_checkpoint_panel_counts_files_and_writes(real_runs: RealRuns, tmp_path: Path) -> None:
    """Names that are hard links of one file are one file kept; a write committed under several
    names is one write (4 epochs, one state saved per epoch)."""
    events = real_runs.events("completed")
    html = write_run_report(events, tmp_path / "r.html").read_text(encoding="utf-8")
    names = sorted((real_runs.completed / "checkpoints").glob("*.pt"))
    files = {(p.stat().st_dev, p.stat().st_ino) for p in names}
    assert len(files) < len(names)  # latest.pt is a hard link of the newest epoch's file
    panel = html[html.index('id="checkpoints"'):]
    assert f"Checkpoints: {len(files)} file(s) kept under {len(names)} name(s)," in panel, panel[:300]
    assert "all 4 checkpoint writes of the log" in panel, panel[:600]
