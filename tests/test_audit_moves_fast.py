"""The audit takes every move line the writer writes from its bytes, not only per-batch ones: a changed
phase-level move gets the findings it gets when every line is parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from audit_runs import RealRuns, read_lines, rechain
from test_longlogs_reader import EDITS, _parsing_every_line, _said

from fsmtrain.tools.audit import audit_file

MOVE_EDITS = {**EDITS, "illegal": lambda recs, i: recs[i].update({"to": "epoch_end", "phase": "epoch_end"})}


@pytest.mark.parametrize("edit", sorted(MOVE_EDITS))
def test_a_changed_phase_level_move_gets_the_findings_of_a_parsed_one(real_runs: RealRuns, tmp_path: Path,
                                                                       edit: str) -> None:
    recs = [json.loads(line) for line in read_lines(real_runs.events("debug"))]
    at = [i for i, r in enumerate(recs) if r["event"] == "transition" and r["trigger"] == "validate"][1]
    MOVE_EDITS[edit](recs, at)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in recs])), encoding="utf-8")
    fast, parsed = audit_file(path, verify_checkpoints=False), _parsing_every_line(path)
    assert _said(fast) == _said(parsed)
    assert fast.explanation == parsed.explanation
    assert fast.ok_strict == (edit == "level"), f"{edit}: the change went unseen"
