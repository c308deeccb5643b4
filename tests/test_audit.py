"""``fsmtrain.tools.audit`` on real run logs (the session fixture ``real_runs``) and on tampered copies.

Every tamper case edits a real log the way a lost, repeated or altered line would, and the audit
must fail naming that line.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from audit_runs import REPO, RealRuns, line_of, read_lines, rechain
from hypothesis import given
from hypothesis import strategies as st

from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.cli import main as cli_main
from fsmtrain.tools.audit import AuditReport, Finding, Severity, audit_file, audit_run_dir
from fsmtrain.tools.audit.ending import best_epoch

pytestmark = pytest.mark.slow  # the session fixture trains seven tiny runs (~10 s, once)

RUNS = [
    ("completed", "completed"),
    ("early_stopped", "early_stop"),
    ("nan", "nan"),
    ("pruned", "pruned"),
    ("errored", "error"),
    ("interrupted_callback", "interrupted"),
    ("interrupted_sigint", "interrupted"),
    ("debug", "completed"),
]


def _violations(report: AuditReport, check: str | None = None) -> list[Finding]:
    return [f for f in report.violations if check is None or f.check == check]


def _write(tmp: Path, lines: list[str], name: str = "events.jsonl") -> Path:
    path = tmp / name
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_lines(path)]


def _audit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "fsmtrain", "audit", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)


# --- real runs hold and are explained -------------------------------------------------------------
@pytest.mark.parametrize(("name", "reason"), RUNS)
def test_real_runs_pass_and_name_the_reason(real_runs: RealRuns, name: str, reason: str) -> None:
    path = real_runs.events(name)
    report = audit_file(path)
    assert report.violations == [], report.render()
    ex = report.explanation
    assert ex.stop_reason == reason
    # The reason and the lines the explanation names are those in the log itself.
    records = _records(path)
    end = next(r for r in records if r["event"] == "transition" and r["to"] == "train_end")
    assert end["payload"]["reason"] == reason
    assert ex.train_end_line == records.index(end) + 1
    assert ex.epochs_completed == sum(r["event"] == "epoch" for r in records)
    if reason != "completed":
        request = records[ex.stop_request_line - 1]  # type: ignore[operator]
        assert request["event"] == "stop_request" and request["payload"]["reason"] == reason
        assert ex.stop_source == request["payload"]["source"]


def test_explanation_of_an_early_stopped_run(real_runs: RealRuns) -> None:
    path = real_runs.events("early_stopped")
    records = _records(path)
    report = audit_file(path)
    ex = report.explanation
    text = report.render()
    assert "EarlyStoppingCallback" in text and "early_stop" in text
    vals = [(r["payload"]["metrics"]["val_loss"], r["epoch"]) for r in records if r["event"] == "epoch"]
    assert ex.best_epoch == min(vals)[1]
    # time per phase and per callback are the sums of the epoch events' own figures
    phase_total = sum(r["payload"]["phase_seconds"]["train_step"] for r in records if r["event"] == "epoch")
    assert ex.phase_seconds["train_step"] == pytest.approx(phase_total)
    assert set(ex.callback_seconds) >= {"EarlyStoppingCallback", "CheckpointCallback", "NaNDetectionCallback"}
    assert "time per callback" in text and "time in epochs" in text
    assert ex.checkpoints_verified >= 1


def test_checkpoints_removed_by_keep_last_k_are_fine(real_runs: RealRuns) -> None:
    path = real_runs.events("completed")
    removed = [r for r in _records(path) if r["event"] == "checkpoint_removed"]
    assert removed, "the completed run is set up so keep_last_k deletes old periodic checkpoints"
    report = audit_file(path)
    assert report.ok_strict
    assert report.explanation.checkpoints_removed == len(removed)


def test_warnings_are_collected(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("completed"))
    records = [json.loads(x) for x in lines]
    # Put a real warning (as ctx.warn writes it) in place of the first epoch event's successor.
    k = line_of(lines, lambda r: r["event"] == "epoch")
    warning = dict(records[k - 1], event="warning", level="warning",
                   payload={"source": "GradientMonitorCallback", "message": "gradient norm 3e4 at batch 2"})
    warning["seq"] = records[k - 1]["seq"]
    patched = [*lines[: k - 1], json.dumps(warning) + "\n"]
    for rec in records[k - 1:]:
        rec = dict(rec, seq=rec["seq"] + 1)
        patched.append(json.dumps(rec) + "\n")
    report = audit_file(_write(tmp_path, patched), verify_checkpoints=False)
    first = report.violations[0]  # the chain sees the insertion (and the checkpoints after it, their pins)
    assert (first.line, first.check) == (k, "chain") and "inserted" in first.message
    assert {f.check for f in report.violations} == {"chain", "checkpoint"}
    report = audit_file(_write(tmp_path, rechain(patched)), verify_checkpoints=False)  # a consistent log
    assert report.violations == []
    assert report.explanation.warning_counts == {"GradientMonitorCallback": 1}
    assert "gradient norm 3e4" in report.render()


# --- tampering ------------------------------------------------------------------------------------
def test_deleted_line(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("early_stopped"))
    k = line_of(lines, lambda r: r["event"] == "epoch")
    report = audit_file(_write(tmp_path, lines[: k - 1] + lines[k:]))
    seq = _violations(report, "seq")
    assert seq and seq[0].line == k and "lost" in seq[0].message


def test_duplicated_line(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("early_stopped"))
    k = line_of(lines, lambda r: r["event"] == "transition" and r["to"] == "val")
    report = audit_file(_write(tmp_path, [*lines[:k], lines[k - 1], *lines[k:]]), allow_missing=True)
    assert [(f.line, f.check) for f in report.violations] == [(k + 1, "chain"), (k + 1, "seq")]
    assert f"second copy of line {k}" in report.violations[0].message
    assert f"duplicate of line {k}" in report.violations[1].message


def test_illegal_transition(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("completed"))
    k = line_of(lines, lambda r: r["event"] == "transition" and r["from"] == "train_step")
    rec = json.loads(lines[k - 1])
    rec.update({"to": "epoch_end", "phase": "epoch_end"})
    lines[k - 1] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, lines))
    bad = _violations(report, "transition")
    assert bad and bad[0].line == k and "train_step -> epoch_end" in bad[0].message


def test_guard_violation(real_runs: RealRuns, tmp_path: Path) -> None:
    """A legal move whose guard did not hold: next_epoch after an accepted stop request."""
    lines = read_lines(real_runs.events("early_stopped"))
    k = line_of(lines, lambda r: r["event"] == "transition" and r["to"] == "train_end")
    rec = json.loads(lines[k - 1])
    rec.update({"to": "epoch_begin", "phase": "epoch_begin", "trigger": "next_epoch", "payload": {}})
    lines[k - 1] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, lines))
    guard = _violations(report, "guard")
    assert guard and guard[0].line == k and "early_stop" in guard[0].message


def test_truncated_final_line(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("completed"))
    lines[-1] = lines[-1][: len(lines[-1]) // 2]
    report = audit_file(_write(tmp_path, lines))
    bad = _violations(report, "json")
    assert bad and bad[0].line == len(lines) and "truncated" in bad[0].message


def test_log_cut_before_train_end(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("early_stopped"))
    k = line_of(lines, lambda r: r["event"] == "transition" and r["to"] == "train_end")
    report = audit_file(_write(tmp_path, lines[: k - 1]))
    end = _violations(report, "end")
    last = json.loads(lines[k - 2])
    assert end and end[0].line == k - 1
    assert "unfinished run" in end[0].message and repr(last["phase"]) in end[0].message
    assert f"in epoch {last['epoch'] + 1} " in end[0].message  # people read epochs from 1; the log keeps the index


def test_checkpoint_changed_after_the_run(real_runs: RealRuns, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(real_runs.completed, run)
    records = _records(run / "events.jsonl")
    writes = [(i + 1, r["payload"]["path"]) for i, r in enumerate(records) if r["event"] == "checkpoint"]
    line, rel = [w for w in writes if w[1].endswith("latest.pt")][-1]
    with open(run / rel, "ab") as fh:
        fh.write(b"\0")
    report = audit_file(run / "events.jsonl")
    bad = _violations(report, "checkpoint")
    assert [(f.line, rel in f.message) for f in bad] == [(line, True)]
    assert audit_file(run / "events.jsonl", verify_checkpoints=False).ok


def test_missing_checkpoint_allowed_is_a_warning_and_fails_under_strict(real_runs: RealRuns, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(real_runs.early_stopped, run)
    (run / "checkpoints" / "best.pt").unlink()
    assert not audit_file(run / "events.jsonl").ok
    report = audit_file(run / "events.jsonl", allow_missing=True)
    assert report.ok and not report.ok_strict
    assert any(f.check == "checkpoint" and f.severity is Severity.WARNING for f in report.findings)


@pytest.mark.parametrize(("name", "new_reason"), [("completed", "nan"), ("nan", "completed"),
                                                  ("completed", "early_stop")])
def test_stop_reason_edited_to_disagree(real_runs: RealRuns, tmp_path: Path, name: str, new_reason: str) -> None:
    lines = read_lines(real_runs.events(name))
    k = line_of(lines, lambda r: r["event"] == "transition" and r["to"] == "train_end")
    for i, line in enumerate(lines):  # edit it consistently in train_end and result
        rec = json.loads(line)
        if i == k - 1:
            rec["payload"]["reason"] = new_reason
        elif rec["event"] == "result":
            rec["payload"]["stop_reason"] = new_reason
        lines[i] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, lines), verify_checkpoints=False)
    bad = _violations(report, "stop_reason")
    assert bad and all(f.line == k for f in bad), report.render()
    if new_reason == "nan":
        assert any("finite" in f.message for f in bad)
    if name == "nan":
        assert any("not finite" in f.message or "nan" in f.message for f in bad)


def test_interleaved_line_of_another_run(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("completed"))
    rec = json.loads(lines[5])
    rec["run_id"] = "someone-else"
    lines[5] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, lines), verify_checkpoints=False)
    assert [f.line for f in _violations(report, "run_id")] == [6]


def test_epoch_gap(real_runs: RealRuns, tmp_path: Path) -> None:
    lines = read_lines(real_runs.events("completed"))
    ks = [i + 1 for i, line in enumerate(lines) if json.loads(line)["event"] == "epoch"]
    rec = json.loads(lines[ks[1] - 1])
    rec["epoch"] = 2
    lines[ks[1] - 1] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, lines), verify_checkpoints=False)
    bad = _violations(report, "epochs")
    assert bad and bad[0].line == ks[1] and "missing" in bad[0].message


def test_resume_boundary(real_runs: RealRuns, tmp_path: Path) -> None:
    """A second process appending to the log is legal only as a resume from a reached epoch."""
    first = read_lines(real_runs.events("completed"))
    n = len(first)
    second = []
    for line in read_lines(real_runs.events("completed")):
        rec = json.loads(line)
        rec["seq"] += n
        if rec["event"] == "run_start":
            rec["payload"]["start_epoch"] = 0
        second.append(json.dumps(rec) + "\n")
    report = audit_file(_write(tmp_path, first + second), verify_checkpoints=False)
    bad = _violations(report, "resume")
    assert bad and bad[0].line == n + 1 and "resumed_from" in bad[0].message

    # A resume that claims to start beyond what the log reached.
    rec = json.loads(second[0])
    rec["payload"].update(resumed_from="checkpoints/latest.pt", start_epoch=9)
    second[0] = json.dumps(rec) + "\n"
    report = audit_file(_write(tmp_path, first + second, "b.jsonl"), verify_checkpoints=False)
    assert any(f.line == n + 1 and f.check == "resume" for f in report.violations)


# --- CLI ------------------------------------------------------------------------------------------
def test_cli_exit_codes_and_json(real_runs: RealRuns, tmp_path: Path) -> None:
    ok = _audit_cli(str(real_runs.events("pruned")))
    assert ok.returncode == 0, ok.stderr
    assert "pruned" in ok.stdout and "PrunerCallback" in ok.stdout

    lines = read_lines(real_runs.events("pruned"))
    bad_path = _write(tmp_path, lines[:3] + lines[4:])
    bad = _audit_cli(str(bad_path), "--json")
    assert bad.returncode == 1
    data = json.loads(bad.stdout)
    assert data["ok"] is False and data["violations"][0]["line"] == 4
    assert {v["check"] for v in data["violations"] if v["line"] == 4} >= {"chain", "seq"}



def test_cli_unreadable_and_strict(real_runs: RealRuns, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["audit", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert cli_main(["audit", str(tmp_path)]) == 2  # a directory
    assert cli_main(["audit", str(tmp_path / "nope.jsonl"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["ok"] is False

    run = tmp_path / "run"
    shutil.copytree(real_runs.completed, run)
    shutil.rmtree(run / "checkpoints")
    assert cli_main(["audit", str(run / "events.jsonl"), "--allow-missing"]) == 0
    assert "not present" in capsys.readouterr().out
    assert cli_main(["audit", str(run / "events.jsonl"), "--allow-missing", "--strict"]) == 1
    assert "under --strict" in capsys.readouterr().out


def test_missing_committed_checkpoints_fail_unless_allowed(real_runs: RealRuns, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Deleting every committed checkpoint must not let a consistent log pass: missing state is a
    violation, and ``--allow-missing`` (``allow_missing=True``) makes it a warning again."""
    run = tmp_path / "run"
    shutil.copytree(real_runs.completed, run)
    shutil.rmtree(run / "checkpoints")
    report = audit_file(run / "events.jsonl")
    missing = [f for f in report.violations if f.check == "checkpoint"]
    assert missing and not report.ok and all("not present" in f.message for f in missing), report.render()
    assert "--allow-missing" in missing[0].message
    assert not audit_run_dir(run).passes(False)
    assert cli_main(["audit", str(run)]) == 1
    assert "not present" in capsys.readouterr().out
    allowed = audit_file(run / "events.jsonl", allow_missing=True)
    assert allowed.ok and not allowed.ok_strict, allowed.render()
    assert audit_run_dir(run, allow_missing=True).passes(False)
    assert cli_main(["audit", str(run), "--allow-missing"]) == 0


def test_legal_resume_appended_by_a_second_trainer(real_runs: RealRuns, tmp_path: Path) -> None:
    """An interrupted run, then a real resume (a second Trainer with ``resume_from="latest"``)
    appending to the same events.jsonl from the epoch after the last committed checkpoint."""
    from audit_runs import _trainer

    run = tmp_path / "run"
    shutil.copytree(real_runs.interrupted_sigint, run)
    records = _records(run / "events.jsonl")
    latest = [r for r in records if r["event"] == "checkpoint" and r["payload"]["kind"] == "latest"][-1]
    # an epoch's end state goes on with the next epoch; an interrupt's state inside an epoch, with that epoch
    start = latest["payload"]["epoch"] + ("step" not in latest["payload"])
    first_len = len(records)
    trainer = _trainer(run, [CheckpointCallback(run / "checkpoints", keep_last_k=2)], epochs=start + 2,
                       resume_from="latest")
    assert trainer.run.epoch == start
    trainer.fit()
    report = audit_file(run / "events.jsonl")
    assert report.violations == [], report.render()
    assert report.explanation.segments == 2 and report.explanation.stop_reason == "completed"

    # The same boundary claiming a later start epoch than the checkpoint gives is refused.
    lines = read_lines(run / "events.jsonl")
    rec = json.loads(lines[first_len])
    assert rec["event"] == "run_start"
    rec["payload"]["start_epoch"] = start + 1
    lines[first_len] = json.dumps(rec) + "\n"
    bad = audit_file(_write(tmp_path, lines), verify_checkpoints=False)
    assert any(f.check == "resume" and f.line == first_len + 1 for f in bad.violations)


def test_an_extended_run_is_explained_by_the_segment_that_ended_it(tmp_path: Path) -> None:
    """2 epochs, extended to 3, then resumed with epochs=2 (nothing left to train): the run ended
    at max_epochs=3, the max_epochs of the segment that trained its last epoch."""
    from audit_runs import _trainer

    run = tmp_path / "run"
    for epochs, resume in ((2, None), (3, "latest"), (2, "latest")):
        _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=epochs, resume_from=resume).fit()
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render()
    ex = report.explanation
    assert (ex.segments, ex.epochs_completed, ex.max_epochs) == (3, 3, 3), report.render()
    assert ex.stop_message == "reached max_epochs=3" and "max_epochs=2" not in report.render(), report.render()


@given(st.lists(st.sampled_from([0.5, 0.25, -0.0, 0.0, 1e308, math.inf, -math.inf, math.nan, 2.0]), max_size=12))
# (found from the losses by a few calls in C where they are all finite and one is least)
def test_the_best_epoch_is_the_first_least_finite_val_loss_however_it_is_found(losses: list[float]) -> None:
    counted = [(e, x, 10 + e) for e, x in enumerate(losses)]
    by_hand = min(((x, e, line) for e, x, line in counted if math.isfinite(x)), default=None)
    assert repr(best_epoch([], counted)) == repr(by_hand)
