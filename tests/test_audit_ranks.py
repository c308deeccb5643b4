"""``fsmtrain audit RUN_DIR`` on the logs of a multi-process run: one log per rank, as many as its
``run_start`` says, and no more.

The logs are the session fixture's completed run, made rank ``r`` of ``world`` by its ``run_start``
(and the chain recomputed, as the real run would have written it). The real ``torchrun`` runs are
in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from audit_runs import RealRuns, read_lines, rechain

from fsmtrain.cli import main as cli_main
from fsmtrain.core.consensus import log_name_for_rank
from fsmtrain.tools.audit import audit_file
from fsmtrain.tools.audit.ranks import audit_run_dir

pytestmark = pytest.mark.slow  # the session fixture trains seven tiny runs (~10 s, once)


def _rank_log(real_runs: RealRuns, rank: int, world: int | None) -> str:
    """The completed run's log as rank ``rank`` of ``world`` wrote it (None: a one-process run)."""
    recs = [json.loads(line) for line in read_lines(real_runs.events("completed"))]
    if world is not None:
        recs[0]["payload"].update(rank=rank, world_size=world)
    return "".join(rechain([json.dumps(r) + "\n" for r in recs]))


def _run_dir(real_runs: RealRuns, tmp: Path, world: int | None, ranks: dict[int, int] | list[int]) -> Path:
    """A run directory with a log per file rank (``{file rank: rank its run_start names}``).
    Without the checkpoint files: they pin the original chain; the audits below skip them."""
    run = tmp / "run"
    run.mkdir()
    named = ranks if isinstance(ranks, dict) else {r: r for r in ranks}
    for file_rank, rank in named.items():
        (run / log_name_for_rank(file_rank)).write_text(_rank_log(real_runs, rank, world), encoding="utf-8")
    return run


def _messages(run: Path) -> list[str]:
    return [f.message for f in audit_run_dir(run, verify_checkpoints=False).findings]


def test_every_rank_s_log_present_agrees(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, 2, [0, 1])
    audit = audit_run_dir(run, verify_checkpoints=False)
    assert audit.findings == [] and audit.ok_strict
    assert "2 ranks agree" in audit.render(strict=True)
    assert audit.to_dict()["world_size"] == 2


def test_a_deleted_rank_log_is_a_violation(real_runs: RealRuns, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(real_runs, tmp_path, 2, [0])  # rank 1's log deleted
    audit = audit_run_dir(run, verify_checkpoints=False)
    assert audit.reports[0].ok_strict  # rank 0's log on its own holds
    assert [f.message for f in audit.findings] == ["run_start says world_size 2; events-rank1.jsonl is missing"]
    assert not audit.ok and not audit.ok_strict
    text = audit.render()
    assert "events-rank1.jsonl is missing" in text and "agree (" not in text
    assert text.rstrip().endswith(f"audit {run}: FAILED")

    assert cli_main(["audit", str(run), "--no-checkpoints", "--strict"]) == 1
    assert "run_start says world_size 2; events-rank1.jsonl is missing" in capsys.readouterr().out
    assert cli_main(["audit", str(run), "--no-checkpoints", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["world_size"] == 2 and list(data["ranks"]) == ["0"]
    assert [a["message"] for a in data["agreement"]] == ["run_start says world_size 2; events-rank1.jsonl is missing"]


def test_every_missing_rank_log_is_named(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, 4, [0, 2])
    assert _messages(run) == ["run_start says world_size 4; events-rank1.jsonl, events-rank3.jsonl are missing"]


def test_a_huge_world_size_names_a_few_missing_logs_and_counts_the_rest(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, 10**12, [0, 1])
    assert _messages(run) == ["run_start says world_size 1000000000000; " + ", ".join(
        f"events-rank{r}.jsonl" for r in range(2, 10)) + f" and {10**12 - 10} more are missing"]


def test_a_stray_rank_log_beyond_the_world_size_is_a_violation(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, 2, [0, 1, 5])
    assert _messages(run) == ["run_start says world_size 2; events-rank5.jsonl is beyond it (no such rank)"]
    audit = audit_run_dir(run, verify_checkpoints=False)
    assert not audit.ok and sorted(audit.reports) == [0, 1, 5]  # the stray log is still audited on its own


def test_a_rank_log_next_to_a_one_process_run_is_a_violation(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, None, [0, 1])  # run_start names no world size: one process
    assert "run_start says world_size 1; events-rank1.jsonl is beyond it (no such rank)" in _messages(run)


def test_a_log_that_names_another_rank_is_still_named(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, 2, {0: 0, 1: 0})  # rank 0's log copied over rank 1's
    assert _messages(run) == ["events-rank1.jsonl says it is rank 0"]


def test_one_process_run_dir_is_rendered_as_its_log(real_runs: RealRuns, tmp_path: Path) -> None:
    run = _run_dir(real_runs, tmp_path, None, [0])
    audit = audit_run_dir(run, verify_checkpoints=False)
    assert audit.findings == [] and audit.ok_strict and audit.to_dict()["world_size"] == 1
    assert audit.render() == audit.reports[0].render()


def test_the_file_alone_says_it_is_one_rank_s_log(real_runs: RealRuns, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Given ``events.jsonl`` rather than the run directory, the audit checks that log only (as the
    README says) and says so: it never claims the ranks agreed."""
    run = _run_dir(real_runs, tmp_path, 2, [0])
    report = audit_file(run / "events.jsonl", verify_checkpoints=False)
    assert report.ok_strict
    assert (report.explanation.rank, report.explanation.world_size) == (0, 2)
    assert cli_main(["audit", str(run / "events.jsonl"), "--no-checkpoints", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2: this log only; the audit of the run directory checks every rank's log" in out
    assert "== ranks" not in out  # no claim that the ranks were compared
    single = audit_file(real_runs.events("completed"), verify_checkpoints=False)
    assert (single.explanation.rank, single.explanation.world_size) == (None, None)
    assert "this log only" not in single.render()
