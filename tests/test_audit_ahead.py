"""A long log's second half read ahead in a second process (a real fork, in a fresh process: ``ahead_check.py``):
the audit and the report leave the same state, find and say the same and draw the same page as one process
reading it all, wherever the second process starts and whatever it meets there: a changed, removed, repeated or
tampered line, a NaN, a slot of the wrong type, records whose names change. The pins a long log's lines leave
(kept as they came until one is looked up) are the dict that filing each at once gives."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from audit_runs import read_lines, rechain
from hypothesis import given
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent
EPOCHS, BLOCK = 600, 16 * 1024
AT = ("0.2", "0.45", "0.5", "0.55", "0.85")  # where the second process starts: a share of what is left
Edit = Callable[[list[dict[str, Any]], int], object]  # changes the records of the epoch whose first line is at i


def _epoch_line(recs: list[dict[str, Any]], i: int) -> dict[str, Any]:
    return next(r for r in recs[i:] if r["event"] == "epoch")


EDITS: dict[str, Edit] = {
    "seq": lambda recs, i: recs[i + 1].update(seq=recs[i + 1]["seq"] + 5),
    "step": lambda recs, i: recs[i + 2].update(global_step=recs[i + 2]["global_step"] + 1),
    "removed": lambda recs, i: recs.pop(i + 1),
    "duplicated": lambda recs, i: recs.insert(i, dict(recs[i])),
    "ts_back": lambda recs, i: recs[i].update(ts=recs[i]["ts"] - 10.0),
    "illegal": lambda recs, i: recs[i + 1].update({"to": "epoch_end", "phase": "epoch_end"}),
    "nan_loss": lambda recs, i: _epoch_line(recs, i)["payload"]["metrics"].update(val_loss="NaN"),
    "slot_type": lambda recs, i: _epoch_line(recs, i)["payload"]["slots"].update(early_stopping_wait="x"),
    "metric_added": lambda recs, i: [r["payload"]["metrics"].update(acc=0.5) for r in recs[i:]
                                     if r["event"] == "epoch"],
}


_STOPPING = {"seq", "step", "removed", "duplicated", "ts_back", "illegal", "slot_type"}  # (the others say nothing
# as the epoch is read: a NaN loss is found at the end, a metric added is legal)


@pytest.fixture(scope="module", params=["info", "debug"])
def long_log(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The benchmark's epochs log (a real run with the default callbacks' slots, its epoch re-emitted with a loss
    curve; some epochs record one slot more), 600 epochs long: its records. At debug level each epoch holds a line
    for each batch but the last (7), as the benchmark's steps log does."""
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    try:
        from long_logs import real_run, synthetic_epoch, write_log
    finally:
        sys.path.remove(str(TESTS.parent / "benchmarks"))
    root = tmp_path_factory.mktemp("ahead")
    write_log(real_run(root / "real", request.param, 3, 8), EPOCHS, root / "events.jsonl", synthetic_epoch(EPOCHS))
    return [json.loads(line) for line in read_lines(root / "events.jsonl")]


def _checked(path: Path, at: tuple[str, ...] = AT) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, str(TESTS / "ahead_check.py"), str(path), str(BLOCK), *at],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and not out.stderr, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def _written(recs: list[dict[str, Any]], path: Path, *, chained: bool = True) -> Path:
    lines = [json.dumps(r, separators=(",", ":")) + "\n" for r in recs]
    path.write_text("".join(rechain(lines) if chained else lines), encoding="utf-8")
    return path


@pytest.mark.timeout(180)
def test_an_intact_long_log_reads_alike_with_a_second_process_wherever_it_starts(long_log: list[dict[str, Any]],
                                                                                tmp_path: Path) -> None:
    path = _written(long_log, tmp_path / "events.jsonl")
    for case in _checked(path):
        assert case["state"] and case["said"] and case["page"], case
        assert case["findings"] == 0 and case["ahead_lines"] > 0.9 * (1 - case["at"]) * len(long_log), case


@pytest.mark.timeout(180)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_changed_epoch_reads_alike_with_a_second_process_before_it_at_it_or_past_it(
        long_log: list[dict[str, Any]], tmp_path: Path, edit: str) -> None:
    recs = [json.loads(json.dumps(r)) for r in long_log]
    begins = [i for i, r in enumerate(recs) if r.get("trigger") == "next_epoch"]
    EDITS[edit](recs, begins[len(begins) // 2])  # the middle epoch
    cases = _checked(_written(recs, tmp_path / "events.jsonl"))
    for case in cases:
        assert case["state"] and case["said"] and case["page"], case
        assert case["findings"] > 0 or edit == "metric_added", case
    before, past = cases[0]["ahead_lines"], cases[-1]["ahead_lines"]  # from a fifth of the log on; from 85%
    if edit in _STOPPING:  # the second process stops at the changed epoch: the auditor reads it, and the rest
        assert 0.2 * len(recs) < before < 0.4 * len(recs), cases
    else:  # it goes on: its records are taken a line at a time where they must be
        assert before > 0.7 * len(recs), cases
    # A seq jump: the lines up to it are not replayed. At info level they are the epoch's moves, and no epoch after
    # it is where the run can be; at debug level they are per-batch lines, and the epochs after it are as before.
    if edit == "seq" and all(r["level"] != "debug" for r in recs):
        assert past == 0, cases
    else:  # the second process starts past the changed epoch: its epochs are taken
        assert past > 0.1 * len(recs), cases


TAMPERS: dict[str, Callable[[list[str], int], object]] = {
    "altered": lambda lines, at: lines.__setitem__(at, lines[at].replace('"epoch":', '"epoch": ', 1)),
    "inserted": lambda lines, at: lines.insert(at, lines[at - 7]),  # an older line again, its link kept
    "removed": lambda lines, at: lines.pop(at),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_line_tampered_with_past_the_second_process_start_reads_alike(long_log: list[dict[str, Any]],
                                                                        tmp_path: Path, tamper: str) -> None:
    lines = rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in long_log])
    TAMPERS[tamper](lines, int(len(lines) * 0.8))  # the chain no longer holds there
    path = tmp_path / "events.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    cases = _checked(path)
    for case in cases:
        assert case["state"] and case["said"] and case["page"] and case["findings"] > 0, case
    assert 0.4 * len(lines) < cases[0]["ahead_lines"] < 0.7 * len(lines), cases  # up to the tampered line


def _later(lines: list[str], cut: int) -> None:
    """The line before the second process's start stamped after the line it starts at (the chain rebuilt)."""
    rec = json.loads(lines[cut - 1])
    rec["ts"] = json.loads(lines[cut])["ts"] + 5.0
    lines[cut - 1] = json.dumps(rec, separators=(",", ":")) + "\n"
    lines[:] = rechain(lines)


BEFORE_START: dict[str, Callable[[list[str], int], object]] = {
    "ts_later": _later,
    # its link breaks on the line before the start: what broke is named from the line after, the second process's
    "link_broken": lambda lines, cut: lines.__setitem__(cut - 2, lines[cut - 2].replace('"epoch":', '"epoch": ', 1)),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("change", sorted(BEFORE_START))
def test_the_second_process_epochs_are_not_taken_where_the_run_before_them_is_not_as_they_assumed(
        long_log: list[dict[str, Any]], tmp_path: Path, change: str) -> None:
    lines = rechain([json.dumps(r, separators=(",", ":")) + "\n" for r in long_log])
    path = tmp_path / "events.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    (intact,) = _checked(path, ("0.5",))
    last_epoch = max(i for i, r in enumerate(long_log) if r["event"] == "epoch")
    cut = last_epoch + 1 - intact["ahead_lines"]  # the second process's first line (0-based)
    assert long_log[cut]["trigger"] == "next_epoch", cut
    BEFORE_START[change](lines, cut)
    path.write_text("".join(lines), encoding="utf-8")
    (case,) = _checked(path, ("0.5",))
    assert case["state"] and case["said"] and case["page"] and case["findings"] > 0, case
    assert case["ahead_lines"] == 0, case  # the auditor read them itself



# The pins of the lines that follow a save phase's line, kept as they came until one is looked up: the dict that
# filing each at once gives, repeated digests (a line copied) included, however they came.
_Op = tuple[str, list[tuple[int, int]]]  # "one", "run" or "raw", and (digest number, line) pairs


@given(st.lists(st.tuples(st.sampled_from(["one", "run", "raw"]),
                          st.lists(st.tuples(st.integers(0, 5), st.integers(1, 99)), min_size=1, max_size=4)),
                max_size=8), st.integers(0, 50))
def test_the_pins_kept_as_they_came_are_the_dict_filed_in_order(ops: list[_Op], shift: int) -> None:
    from fsmtrain.tools.audit.chain import _EndPins

    pins, by_hand = _EndPins(), {}
    for how, pairs in ops:
        hexes = [f"{d:064x}" for d, _ in pairs]
        if how == "one":
            for digest, (_, line) in zip(hexes, pairs, strict=True):
                pins[digest] = line
                by_hand[digest] = line
        else:
            pins.add(bytes.fromhex("".join(hexes)) if how == "raw" else hexes, [line for _, line in pairs], shift)
            by_hand.update((digest, line + shift) for digest, (_, line) in zip(hexes, pairs, strict=True))
    assert list(pins.mapping().items()) == list(by_hand.items())


# The commands, each noting each fork it makes in a file (os.fork wrapped: the fork is real).
_COUNTING_FORKS = ("import os, runpy, sys\nmark, real = sys.argv.pop(1), os.fork\n"
                   "def fork():\n    pid = real()\n    if pid:\n        open(mark, 'a').write('fork\\n')\n"
                   "    return pid\n"
                   "os.fork = fork\nsys.argv[0] = 'fsmtrain'\nrunpy.run_module('fsmtrain', run_name='__main__')\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_audit_and_report_commands_read_a_long_log_with_a_second_process_as_one_process_does(
        tmp_path: Path) -> None:
    """Past ``Ahead.min_bytes`` (48 MB after the first read) the commands fork: what they print and draw is what
    one process reads."""
    from fsmtrain.tools.audit import auditor
    from fsmtrain.tools.audit.ahead import AHEAD
    from fsmtrain.tools.report.run import run_sections

    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    try:
        from long_logs import real_run, synthetic_epoch, write_log
    finally:
        sys.path.remove(str(TESTS.parent / "benchmarks"))
    run, events, epochs = tmp_path / "run", tmp_path / "run" / "events.jsonl", 30_000
    run.mkdir()
    write_log(real_run(tmp_path / "real", "info", 3, 8), epochs, events, synthetic_epoch(epochs))
    assert events.stat().st_size > AHEAD.min_bytes + 2 * AHEAD.block

    def command(*args: str) -> tuple[subprocess.CompletedProcess[str], str]:
        mark = tmp_path / f"forks-{args[0]}"
        out = subprocess.run([sys.executable, "-c", _COUNTING_FORKS, str(mark), *args], capture_output=True,
                             text=True, timeout=120, check=False)
        return out, mark.read_text() if mark.exists() else ""

    (audit, audit_forks), (page, page_forks) = (command("audit", str(events), "--json"),
                                                command("report", str(run), "--out", str(tmp_path / "r.html")))
    assert audit.returncode == 0 and page.returncode == 0 and not audit.stderr and not page.stderr, (audit, page)
    assert audit_forks == page_forks == "fork\n"
    one = auditor.audit_file(events, ahead=None)
    assert json.loads(audit.stdout) == json.loads(json.dumps(one.to_dict(False))) and one.lines > 150_000
    defaults = auditor.read_log.__kwdefaults__
    assert defaults is not None
    defaults["ahead"] = None  # (restored below: the report read in one process here)
    try:
        _, summary, sections = run_sections(events)
    finally:
        defaults["ahead"] = AHEAD
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert f"completed after {epochs} epoch(s); audit OK" in summary and all(s in html for s in sections)


@pytest.mark.timeout(120)
def test_a_long_log_read_where_other_threads_run_is_read_in_one_process_and_says_so(long_log: list[dict[str, Any]],
                                                                                   tmp_path: Path) -> None:
    path = _written(long_log, tmp_path / "events.jsonl")
    code = ("import sys, threading, time\nfrom fsmtrain.tools.audit.ahead import Ahead\n"
            "from fsmtrain.tools.audit.auditor import read_log\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            f"a = read_log(sys.argv[1], ahead=Ahead(min_bytes=0, block={BLOCK}))\n"
            "print(a.ahead_lines, a.finish().ok_strict)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0 and out.stdout.split() == ["0", "True"], out
    assert f"{path} (" in out.stderr and "MB) is read in one process (other threads run here: a fork is not safe)" \
        in out.stderr, out.stderr
