"""Long logs: the audit reads lines in bulk as typed lines (msgspec) and takes move lines from their fields,
runs of per-batch lines at once and whole epochs that repeat the one before together, with the same findings
as parsing every line; other lines are parsed with json's findings; the report reads the log once, in the
audit's pass."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from ahead_check import auditor_state
from audit_runs import RealRuns, read_lines, rechain
from hypothesis import given
from hypothesis import strategies as st

from fsmtrain.core.log_file import EMPTY_PAYLOAD, typed_lines
from fsmtrain.tools.audit import AuditReport, audit_file
from fsmtrain.tools.audit.auditor import LogAuditor
from fsmtrain.tools.audit.cycles import Cycle, EpochRun
from fsmtrain.tools.audit.moves import record_columns
from fsmtrain.tools.audit.segment import Moves
from fsmtrain.tools.report.run import run_sections

Edit = Callable[[list[dict[str, Any]], int], object]  # changes the records around the batch line at index i


def _batch_indexes(recs: list[dict[str, Any]]) -> list[int]:
    return [i for i, r in enumerate(recs) if r["event"] == "transition" and r["from"] == r["to"] == "train_step"]


def _parsing_every_line(path: Path) -> AuditReport:
    auditor = LogAuditor(path)
    lines = path.read_bytes().splitlines(keepends=True)
    for n, raw in enumerate(lines, 1):
        auditor.feed_parsed(n, raw, None)
    auditor.lines = len(lines)
    return auditor.finish()


def _said(report: AuditReport) -> list[tuple[str, str, int | None, str]]:
    return [(f.check, f.message, f.line, f.severity.value) for f in report.findings]


EDITS: dict[str, Edit] = {
    "step": lambda recs, i: recs[i].update(global_step=recs[i]["global_step"] + 1),
    "removed": lambda recs, i: recs.pop(i),
    "duplicated": lambda recs, i: recs.insert(i, dict(recs[i])),
    "swapped": lambda recs, i: recs.insert(i + 1, recs.pop(i)),
    "ts_back": lambda recs, i: recs[i].update(ts=recs[i]["ts"] - 10.0),
    "run_id": lambda recs, i: recs[i].update(run_id="other"),
    "epoch": lambda recs, i: recs[i].update(epoch=recs[i]["epoch"] + 1),
    "seq": lambda recs, i: recs[i].update(seq=recs[i]["seq"] + 5),
    "level": lambda recs, i: recs[i].update(level="error"),  # legal: a run's config records no log level here
    "ts_int": lambda recs, i: recs[i].update(ts=int(recs[i]["ts"]) + 1),
}


def test_the_writers_batch_lines_are_taken_from_their_bytes(real_runs: RealRuns) -> None:
    raw = real_runs.events("debug").read_bytes().splitlines(keepends=True)
    recs = [json.loads(line) for line in raw]
    batches = _batch_indexes(recs)
    assert len(batches) >= 6
    typed = typed_lines(raw)
    moves = [i for i, r in enumerate(recs) if r["event"] == "transition" and r["to"] != "train_end"]
    assert set(batches) <= set(moves)
    assert all(rec is not None and rec.payload == EMPTY_PAYLOAD for rec in map(typed.__getitem__, moves))  # train_end's
    # move carries its reason


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("rechained", [True, False])
def test_a_changed_batch_line_gets_the_findings_of_a_parsed_one(real_runs: RealRuns, tmp_path: Path, edit: str,
                                                                 rechained: bool) -> None:
    recs = [json.loads(line) for line in read_lines(real_runs.events("debug"))]
    EDITS[edit](recs, _batch_indexes(recs)[4])
    lines = [json.dumps(r, separators=(",", ":")) + "\n" for r in recs]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain(lines) if rechained else lines), encoding="utf-8")
    fast, parsed = audit_file(path, verify_checkpoints=False), _parsing_every_line(path)
    assert _said(fast) == _said(parsed)
    assert fast.explanation == parsed.explanation
    assert fast.ok_strict == (edit == "level" and rechained), f"{edit}: the change went unseen"


def test_an_intact_debug_log_audits_alike_both_ways(real_runs: RealRuns) -> None:
    path = real_runs.events("debug")
    fast, parsed = audit_file(path, verify_checkpoints=False), _parsing_every_line(path)
    assert fast.ok and _said(fast) == _said(parsed) and fast.explanation == parsed.explanation


class _CountingRuns(LogAuditor):
    """The audit, counting the per-batch lines it took a run at a time, or in whole epochs taken together."""

    taken = 0

    def _batch_run(self, n: int, lines: list[bytes], recs: list[Any]) -> bool:
        ok = super()._batch_run(n, lines, recs)
        self.taken += len(lines) if ok else 0
        return ok

    def _take_epochs(self, run: EpochRun, cycle: Cycle, *, tally: bool = True) -> list[EpochRun]:
        self.taken += cycle.batch_lines * run.count
        return super()._take_epochs(run, cycle, tally=tally)


def _fed_in_blocks(path: Path, size: int) -> tuple[AuditReport, int]:
    """The audit of ``path`` fed ``size`` lines at a time, and how many lines it took a run at a time."""
    auditor = _CountingRuns(path)
    lines = path.read_bytes().splitlines(keepends=True)
    for i in range(0, len(lines), size):
        auditor.feed_block(i + 1, lines[i:i + size])
    auditor.lines = len(lines)
    return auditor.finish(), auditor.taken


@pytest.mark.parametrize("size", [1, 2, 3, 5, 10**6])
def test_runs_of_batch_lines_are_taken_in_one_go_and_audit_alike_however_the_log_is_cut(real_runs: RealRuns,
                                                                                         size: int) -> None:
    path = real_runs.events("debug")
    recs = [json.loads(line) for line in read_lines(path)]
    (fast, taken), parsed = _fed_in_blocks(path, size), _parsing_every_line(path)
    assert fast.ok and _said(fast) == _said(parsed) and fast.explanation == parsed.explanation
    assert taken == len(_batch_indexes(recs))  # every per-batch line of an intact log, in runs


def test_a_run_id_written_with_escapes_is_taken_a_run_at_a_time_too(real_runs: RealRuns, tmp_path: Path) -> None:
    recs = [json.loads(line) for line in read_lines(real_runs.events("debug"))]
    for rec in recs:
        rec["run_id"] = 'run "\u00e9\\1'
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in recs])), encoding="utf-8")
    assert b'"run_id":"run \\"\\u00e9\\\\1"' in path.read_bytes()  # escaped as json writes it
    (fast, taken), parsed = _fed_in_blocks(path, 10**6), _parsing_every_line(path)
    assert fast.ok and _said(fast) == _said(parsed) and fast.explanation == parsed.explanation
    assert taken == len(_batch_indexes(recs))  # not only a run id the log holds as it is


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("size", [3, 10**6])
def test_a_changed_line_inside_a_run_of_batch_lines_gets_the_findings_of_a_parsed_one(
        real_runs: RealRuns, tmp_path: Path, edit: str, size: int) -> None:
    recs = [json.loads(line) for line in read_lines(real_runs.events("debug"))]
    EDITS[edit](recs, _batch_indexes(recs)[-3])  # inside the last epoch's run
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in recs])), encoding="utf-8")
    (fast, _), parsed = _fed_in_blocks(path, size), _parsing_every_line(path)
    assert _said(fast) == _said(parsed) and fast.explanation == parsed.explanation
    assert fast.ok_strict == (edit == "level"), f"{edit}: the change went unseen"


@pytest.mark.timeout(60)
def test_the_report_reads_the_log_once(real_runs: RealRuns, tmp_path: Path) -> None:
    """From a pipe, which can be read only once: a second pass would wait for a writer forever."""
    src = real_runs.events("debug")
    expected = run_sections(src)[1]
    pipe = tmp_path / "events.jsonl"
    os.mkfifo(pipe)

    def write() -> None:
        with open(pipe, "wb") as fh:
            fh.write(src.read_bytes())

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert run_sections(pipe)[1] == expected
    writer.join(5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_long_log_benchmark_writes_logs_that_audit_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from long_logs import SPIKE, real_run, synthetic_epoch, write_log

    steps = tmp_path / "steps.jsonl"
    write_log(real_run(tmp_path / "debug", "debug", 2, 4), 50, steps)
    report = audit_file(steps, verify_checkpoints=False)
    assert report.ok_strict, report.render()
    ex = report.explanation
    assert ex.epochs_completed == 50 and ex.moves["train_step->train_step (batch)"] == 150
    run = tmp_path / "epochs"
    run.mkdir()
    write_log(real_run(tmp_path / "info", "info", 3, 8), 3000, run / "events.jsonl", synthetic_epoch(3000))
    _, summary, sections = run_sections(run / "events.jsonl")
    assert "completed after 3000 epoch(s); audit OK" in summary
    page = "".join(sections)
    assert f": {SPIKE:.6g}</title>" in page and "reduced: " in page


# Every move line the writer writes is taken from its bytes, not only per-batch ones: a changed phase-level
# move gets the findings it gets when every line is parsed. (Beside the reader's tests, so one worker builds
# the real runs once.)
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


# Parsed lines are read by msgspec: where it refuses a line (NaN, a number out of range, a lone surrogate...),
# json reads it. A changed epoch line gets the findings json's reading gives.
WIDE = 2**70
RAW_EDITS: dict[str, Callable[[bytes], bytes]] = {
    "wide_batches": lambda b: b.replace(b'"batches":', b'"batches":%d,"x":' % WIDE),
    "wide_negative_seq": lambda b: b.replace(b'"seq":', b'"seq":-%d,"s":' % WIDE),
    "wide_epoch": lambda b: b.replace(b'"epoch":', b'"epoch":%d,"e":' % (2**64)),
    "wide_slot": lambda b: b.replace(b'"slots":{', b'"slots":{"early_stopping_wait":%d},"s":{' % WIDE),
    "nan_literal": lambda b: b.replace(b'"metrics":{', b'"metrics":{"val_loss":NaN},"m":{'),
    "overflow": lambda b: b.replace(b'"metrics":{', b'"metrics":{"train_loss":1e400},"m":{'),
    "lone_surrogate": lambda b: b.replace(b'"run_id":"', b'"run_id":"\\ud800'),
    "bom": lambda b: b"\xef\xbb\xbf" + b,
    "trailing": lambda b: b[:-1] + b" x\n",
    "bad_utf8": lambda b: b.replace(b'"run_id":"', b'"run_id":"\xff'),
    "control": lambda b: b.replace(b'"run_id":"', b'"run_id":"\x01'),
    "cut": lambda b: b[: len(b) // 2] + b"\n",
    "array": lambda b: b"[%d]\n" % WIDE,
    "number": lambda b: b"%d\n" % WIDE,
    "duplicate_key": lambda b: b[:-2] + b',"event":"warning"}\n',
}


def _json_every_line(path: Path) -> AuditReport:
    """The audit of ``path`` with each line read by ``json.loads`` of its UTF-8 (None: refused)."""
    auditor = LogAuditor(path)
    lines = path.read_bytes().splitlines(keepends=True)
    for n, raw in enumerate(lines, 1):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except ValueError:
            rec = None
        auditor.feed_parsed(n, raw, rec)
    auditor.lines = len(lines)
    return auditor.finish()


@pytest.mark.parametrize("edit", sorted(RAW_EDITS))
def test_a_changed_epoch_line_reads_as_json_reads_it(real_runs: RealRuns, tmp_path: Path, edit: str) -> None:
    from fsmtrain.core.log_file import parse_line

    lines = real_runs.events("debug").read_bytes().splitlines(keepends=True)
    at = [i for i, raw in enumerate(lines) if b'"event":"epoch"' in raw][1]
    lines[at] = RAW_EDITS[edit](lines[at])
    try:
        expected: object = repr(json.loads(lines[at].decode("utf-8")))
    except ValueError as exc:
        expected = str(exc)
    try:
        got: object = repr(parse_line(lines[at]))
    except ValueError as exc:
        got = str(exc)
    assert got == expected
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(lines))
    fast, parsed = audit_file(path, verify_checkpoints=False), _json_every_line(path)
    assert _said(fast) == _said(parsed)
    assert fast.explanation == parsed.explanation
    assert not fast.ok_strict, f"{edit}: the change went unseen"


@pytest.mark.parametrize("run", ["debug", "completed", "early_stopped", "steady", "steady_debug"])
def test_the_report_takes_move_lines_from_bytes_as_it_takes_parsed_ones(real_runs: RealRuns, run: str) -> None:
    from fsmtrain.tools.report.run_log import RunData, read_run

    path = real_runs.events(run)
    fast = read_run(path)[0]
    parsed = RunData(path)
    lines = path.read_bytes().splitlines(keepends=True)
    for n, raw in enumerate(lines, 1):
        parsed.read(n, json.loads(raw))
    parsed.finish(len(lines))
    assert fast.path.result() == parsed.path.result() and fast.path.result().counts
    assert repr(fast.table.columns) == repr(parsed.table.columns) and fast.x == parsed.x and len(fast.x) >= 2


# Whole epochs: an epoch is its moves (at debug level, a per-batch line each batch but the last among them) and its
# epoch line; once one passed every check, the epochs whose lines repeat its words are checked together
# (``EpochCycles``), with the state and the findings that checking them a line at a time gives.
class _CountingEpochs(LogAuditor):
    """The audit, counting the lines it took a group of whole epochs at a time."""

    taken = 0

    def _epoch_group(self, n: int, lines: list[bytes], recs: list[Any], count: int, cycle: Cycle) -> bool:
        ok = super()._epoch_group(n, lines, recs, count, cycle)
        self.taken += len(lines) if ok else 0
        return ok


def _both_ways(path: Path, size: int) -> tuple[_CountingEpochs, LogAuditor]:
    """The audit of ``path`` fed ``size`` lines at a time, and the one that parses every line; not finished."""
    fast, parsed = _CountingEpochs(path), LogAuditor(path)
    lines = path.read_bytes().splitlines(keepends=True)
    for i in range(0, len(lines), size):
        fast.feed_block(i + 1, lines[i:i + size])
    for n, raw in enumerate(lines, 1):
        parsed.feed_parsed(n, raw, None)
    fast.lines = parsed.lines = len(lines)
    return fast, parsed


@pytest.mark.parametrize("run", ["steady", "steady_debug"])
@pytest.mark.parametrize("size", [1, 4, 11, 10**6])
def test_whole_epochs_are_taken_together_and_audit_alike_however_the_log_is_cut(real_runs: RealRuns, run: str,
                                                                                 size: int) -> None:
    path = real_runs.events(run)
    recs = [json.loads(line) for line in read_lines(path)]
    epochs = [i for i, r in enumerate(recs) if r["event"] == "epoch"]
    assert len(epochs) == 12 and recs[epochs[0] + 1]["to"] == "epoch_begin"
    fast, parsed = _both_ways(path, size)
    assert auditor_state(fast) == auditor_state(parsed)
    fast_report, parsed_report = fast.finish(), parsed.finish()
    assert fast_report.ok_strict and _said(fast_report) == _said(parsed_report)
    assert fast_report.explanation == parsed_report.explanation
    cycle = epochs[2] - epochs[1]  # from the third epoch on, each repeats the second's words
    if size == 10**6:
        assert fast.taken == epochs[-1] - epochs[1]  # every epoch after the one it learned from
    else:  # only whole epochs inside one block, after an epoch line there, are taken together
        assert fast.taken == 0 if size <= cycle else fast.taken > 0


EPOCH_EDITS: dict[str, Edit] = {
    **EDITS,
    "illegal": lambda recs, i: recs[i].update({"to": "epoch_end", "phase": "epoch_end"}),
    "batches": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"].update(batches=3),
    "nan_loss": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"]["metrics"].update(val_loss="NaN"),
    "int_loss": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"]["metrics"].update(val_loss=2),
    "slot_type": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"]["slots"].update(early_stopping_wait="x"),
    "no_slots": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"].pop("slots"),
    "bool_seconds": lambda recs, i: recs[_next_epoch_line(recs, i)]["payload"].update(seconds=True),
    "epoch_line_step": lambda recs, i: recs[_next_epoch_line(recs, i)].update(global_step=1),
    "max_epochs": lambda recs, i: recs[0]["payload"].update(max_epochs=8),
    "batch_without_line": lambda recs, i: _batch_without_line(recs, i),
}
_QUIET_EDITS = {"level", "int_loss", "no_slots", "bool_seconds"}  # legal, or no check looks there


def _next_epoch_line(recs: list[dict[str, Any]], i: int) -> int:
    return next(j for j in range(i, len(recs)) if recs[j]["event"] == "epoch")


def _batch_without_line(recs: list[dict[str, Any]], i: int) -> None:
    """One batch more in the epoch of line ``i``, without its line: every step from its validation on one later."""
    val = next(j for j in range(i, len(recs)) if recs[j].get("trigger") == "validate")
    for rec in recs[val:]:
        rec["global_step"] += 1
    recs[_next_epoch_line(recs, val)]["payload"]["batches"] += 1


@pytest.mark.parametrize("edit", sorted(EPOCH_EDITS))
@pytest.mark.parametrize(("run", "where"), [("steady", "validate"), ("steady_debug", "validate"),
                                            ("steady_debug", "batch")])
@pytest.mark.parametrize("size", [4, 10**6])
def test_a_changed_line_among_whole_epochs_gets_the_findings_of_a_parsed_one(real_runs: RealRuns, tmp_path: Path,
                                                                              edit: str, run: str, where: str,
                                                                              size: int) -> None:
    """The 8th epoch's move into validation changed, or (at debug level) its second per-batch line."""
    recs = [json.loads(line) for line in read_lines(real_runs.events(run))]
    at = [i for i, r in enumerate(recs) if r["event"] == "transition" and r["trigger"] == "validate"][7]
    EPOCH_EDITS[edit](recs, at if where == "validate" else _batch_indexes(recs)[7 * 3 + 1])
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in recs])), encoding="utf-8")
    fast, parsed = _both_ways(path, size)
    assert auditor_state(fast) == auditor_state(parsed)
    fast_report, parsed_report = fast.finish(), parsed.finish()
    assert _said(fast_report) == _said(parsed_report)
    assert fast_report.explanation == parsed_report.explanation
    assert fast_report.ok_strict == (edit in _QUIET_EDITS), f"{edit}: the change went unseen"
    if size == 10**6:
        assert fast.taken > 0  # the epochs before the changed one, or after it


# The report's epoch table, taken a group of whole epochs at a time (by the audit's columns) and a record at a time,
# against the table written out by hand: an epoch's last record, names in the order a number first appears under
# them, missing as None, numbers as a log writes them.
_KINDS = (("metric", "metrics"), ("phase", "phase_seconds"), ("callback", "callback_seconds"), ("slot", "slots"))


def _flat(values: Any, kind: str) -> dict[str, Any]:
    if type(values) is not dict:
        return {}
    if kind != "slot":
        return values
    return {**values, **{f"{n}.{k}": v for n, inner in values.items() if type(inner) is dict for k, v in inner.items()}}


def _table_by_hand(path: Path) -> tuple[list[int], str]:
    from fsmtrain.core.log_file import log_number

    last: dict[int, dict[str, Any]] = {}
    names: dict[str, dict[str, None]] = {kind: {} for kind, _ in _KINDS}
    for line in read_lines(path):
        rec = json.loads(line)
        if rec["event"] != "epoch" or type(rec["epoch"]) is not int:
            continue
        payload = rec["payload"] if type(rec["payload"]) is dict else {}
        last[rec["epoch"]] = payload
        for kind, key in _KINDS:
            for name, value in _flat(payload.get(key), kind).items():
                if log_number(value) is not None:
                    names[kind].setdefault(name)
    index = sorted(last)
    columns: dict[str, dict[str, list[float | None]]] = {
        kind: {name: [log_number(_flat(last[e].get(key), kind).get(name)) for e in index] for name in names[kind]}
        for kind, key in _KINDS}
    columns["time"] = {"epoch": [log_number(last[e].get("seconds")) or 0.0 for e in index]}
    return index, repr(columns)


def _from(at: int, change: Callable[[dict[str, Any], int], object]) -> Edit:
    """``change`` applied to the payload of every epoch line from the ``at``-th (0-based) on, with its number."""
    def edit(recs: list[dict[str, Any]], _: int) -> None:
        for k, rec in enumerate(r for r in recs if r["event"] == "epoch"):
            if k >= at:
                change(rec["payload"], k)
    return edit


def _relog(recs: list[dict[str, Any]], _: int) -> None:
    """The 6th epoch's line logged again after the 8th's, with other numbers (as a resume that re-ran it)."""
    lines = [i for i, r in enumerate(recs) if r["event"] == "epoch"]
    again = json.loads(json.dumps(recs[lines[5]]))
    again["payload"]["metrics"]["val_loss"] = 9.5
    recs.insert(lines[7] + 1, again)


TABLE_EDITS: dict[str, Edit] = {
    "none": lambda recs, i: None,
    "metric_added": _from(6, lambda p, k: p["metrics"].update(acc=0.5 + k)),
    # two names new in one group: the first in key order has no number in the group's first records
    "metric_named_first_without_number": _from(5, lambda p, k: p["metrics"].update(acc="n/a" if k < 7 else 0.1 * k,
                                                                                    f1=0.2 * k)),
    "metric_gone": _from(5, lambda p, k: p["metrics"].pop("val_loss")),
    "metric_in_one_epoch": _from(8, lambda p, k: k == 8 and p["metrics"].update(acc=1.0)),
    "nan_loss": _from(4, lambda p, k: p["metrics"].update(val_loss="NaN")),
    "mapping_slot": _from(0, lambda p, k: p["slots"].update(
        loss_prediction={"predicted_loss": 1.0 / (k + 1), "neg_log10": 0.1 * k, "fit_ok": k > 3})),
    "int_seconds": _from(3, lambda p, k: p.update(seconds=k)),
    "bool_seconds": _from(3, lambda p, k: p.update(seconds=True)),
    "negative_zero_seconds": _from(3, lambda p, k: p.update(seconds=-0.0)),
    "no_slots": _from(2, lambda p, k: p.pop("slots")),
    "slots_not_a_mapping": _from(2, lambda p, k: p.update(slots=[1, 2])),
    "relogged_epoch": _relog,
}


@pytest.mark.parametrize("edit", sorted(TABLE_EDITS))
def test_the_reports_epoch_table_is_each_epochs_last_record(real_runs: RealRuns, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    from fsmtrain.tools.audit.cycles import EpochCycles
    from fsmtrain.tools.report.run_log import read_run

    recs = [json.loads(line) for line in read_lines(real_runs.events("steady"))]
    TABLE_EDITS[edit](recs, 0)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in recs])), encoding="utf-8")
    taken: list[int] = []
    group = EpochCycles._epoch_group

    def counted(self: EpochCycles, n: int, lines: list[bytes], recs: list[Any], count: int, cycle: Cycle) -> bool:
        ok = group(self, n, lines, recs, count, cycle)
        taken.append(count if ok else 0)
        return ok

    monkeypatch.setattr(EpochCycles, "_epoch_group", counted)
    data = read_run(path)[0]
    assert (data.table.index, repr(data.table.columns)) == _table_by_hand(path)
    assert len(data.table.index) == 12 and sum(taken) >= 3, taken  # some epochs were taken as a group


# Epochs taken together are taken by part where their records' names change (``EpochRun.parts``): each part a column
# at a time. A cut in the wrong place would only be slower (a part whose names differ is read a record at a time),
# so the parts are held to it here.
_RECORDS = st.lists(st.tuples(st.sets(st.sampled_from(["gap", "wait", "norm"])), st.booleans(),
                              st.floats(allow_nan=False, allow_infinity=False)), min_size=1, max_size=40)


@given(_RECORDS)
def test_whole_epochs_are_cut_into_parts_where_their_records_names_change(
        records: list[tuple[set[str], bool, float]]) -> None:
    size = 3
    payloads = [{"metrics": {"val_loss": x, **({"acc": x} if extra else {})}, "slots": dict.fromkeys(sorted(names), x),
                 "phase_seconds": {"val": x}, "callback_seconds": {}, "seconds": x, "batches": 2}
                for names, extra, x in records]
    count = len(payloads)
    steps = [[10 * e + p for e in range(count)] for p in range(size - 1)]
    run = EpochRun(7, 4, count, steps, payloads, record_columns(payloads), 0, 0.0, [], [], [])
    parts = run.parts(size)
    assert [p.payloads[k] for p in parts for k in range(p.count)] == payloads
    assert [(p.n, p.first) for p in parts] == [(7 + size * a, 4 + a) for a in
                                               [sum(q.count for q in parts[:i]) for i in range(len(parts))]]
    assert [s for k in range(size - 1) for s in (x for p in parts for x in p.steps[k])] == [
        s for col in steps for s in col]
    names = [[(tuple(r["slots"]), "acc" in r["metrics"]) for r in p.payloads] for p in parts]
    assert all(len(set(n)) == 1 for n in names)  # each part's records hold the same names
    assert all(a[-1] != b[0] for a, b in pairwise(names))  # and no cut is made without a change
    assert all(p.columns == record_columns(p.payloads) and p.whole() for p in parts)


@given(st.lists(st.one_of(st.tuples(st.just("one"), st.integers(0, 9)),
                          st.tuples(st.just("epochs"), st.integers(0, 9), st.integers(0, 5))), max_size=30))
def test_a_segments_moves_kept_by_whole_epochs_read_as_the_moves_one_at_a_time(
        ops: list[tuple[Any, ...]]) -> None:
    turns = (("next_epoch", "epoch_end", "epoch_begin"), ("validate", "train_step", "val"))
    kept, each = Moves(), []
    for op in ops:
        if op[0] == "one":
            kept.append(("batch", "epoch_begin", "train_step", op[1]))
            each.append(("batch", "epoch_begin", "train_step", op[1]))
        else:
            kept.add_epochs(turns, op[1], op[2])
            each += [(t, s, d, e) for e in range(op[1], op[1] + op[2]) for t, s, d in turns]
    assert list(kept) == each and len(kept) == len(each) and repr(kept) == repr(each)
