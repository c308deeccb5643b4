"""Twelve forgeries, made from one real quickstart log, against the hash chain and
the audit's content checks.

Three forgers:

- *naive*: edits lines and leaves the chain alone. The chain names the first bad line.
- *consistent, no key*: recomputes the whole plain chain (and the checkpoint events' pinned heads).
  A plain chain proves consistency only, so what catches these is content: timestamps, batches,
  guards, the stop request, the recomputed result, and the heads the checkpoint files store. Two
  forgeries are content-consistent (a non-best val loss, the final train loss): they pass without
  a key, and the second one even with the checkpoint files (it comes after the last checkpoint).
- *keyed log, forger without the key*: rebuilds the chain from the edit on with plain sha256 (all
  one can do without the key). The audit with the key names the first bad line, every time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from audit_runs import QUICKSTART_KEY, QuickstartRuns, read_lines, rechain

from fsmtrain.core.chain import Chain
from fsmtrain.tools.audit import AuditReport, audit_file

pytestmark = pytest.mark.slow  # the session fixture trains the quickstart twice (~10 s, once)

Lines = list[str]


def _dump(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"


def _recs(lines: Lines) -> list[dict[str, Any]]:
    return [json.loads(x) for x in lines]


def _edit(lines: Lines, line: int, fn: Callable[[dict[str, Any]], None]) -> Lines:
    out = list(lines)
    rec = json.loads(out[line - 1])
    fn(rec)
    out[line - 1] = _dump(rec)
    return out


def _renumber(lines: Lines) -> Lines:
    """seq = position again, as a forger who inserts or deletes a line does (one segment)."""
    out = []
    for i, line in enumerate(lines):
        rec = json.loads(line)
        out.append(line if rec["seq"] == i else _dump(dict(rec, seq=i)))
    return out


def _where(lines: Lines, pred: Callable[[dict[str, Any]], bool]) -> list[int]:
    return [i for i, r in enumerate(_recs(lines), 1) if pred(r)]


def _epoch_lines(lines: Lines) -> list[int]:
    return _where(lines, lambda r: r["event"] == "epoch")


def _val(rec: dict[str, Any]) -> float:
    value: float = rec["payload"]["metrics"]["val_loss"]
    return value


# --- the forgeries: each returns the forged lines and the first line that differs --------------
def non_best_val_loss(lines: Lines) -> tuple[Lines, int]:
    recs = _recs(lines)
    best = min(_val(recs[i - 1]) for i in _epoch_lines(lines))
    line = next(i for i in _epoch_lines(lines)[:-1] if _val(recs[i - 1]) > best)
    better = (_val(recs[line - 1]) + best) / 2  # looks better, still not the best
    return _edit(lines, line, lambda r: r["payload"]["metrics"].update(val_loss=better)), line


def final_train_loss(lines: Lines) -> tuple[Lines, int]:
    line = _epoch_lines(lines)[-1]
    return _edit(lines, line, lambda r: r["payload"]["metrics"].update(
        train_loss=r["payload"]["metrics"]["train_loss"] / 2)), line


def metrics_swapped(lines: Lines) -> tuple[Lines, int]:
    recs = _recs(lines)
    epochs = _epoch_lines(lines)
    best = min(epochs, key=lambda i: _val(recs[i - 1]))
    other = epochs[1] if epochs[1] != best else epochs[0]
    a, b = recs[other - 1]["payload"]["metrics"], recs[best - 1]["payload"]["metrics"]
    out = _edit(lines, other, lambda r: r["payload"].update(metrics=b))
    return _edit(out, best, lambda r: r["payload"].update(metrics=a)), min(other, best)


def batch_inserted(lines: Lines) -> tuple[Lines, int]:
    k = _where(lines, lambda r: r["trigger"] == "batch" and r["epoch"] == 1)[0]
    rec = json.loads(lines[k - 1])
    rec.update({"from": "train_step", "level": "debug", "global_step": rec["global_step"] + 1})
    return _renumber([*lines[:k], _dump(rec), *lines[k:]]), k + 1


def line_deleted(lines: Lines) -> tuple[Lines, int]:
    k = _where(lines, lambda r: r["to"] == "epoch_end" and r["epoch"] == 1)[0]
    return _renumber(lines[: k - 1] + lines[k:]), k


def extra_epoch(lines: Lines) -> tuple[Lines, int]:
    """The last epoch once more before train_end, with epochs, steps and the result moved on."""
    recs = _recs(lines)
    end = _where(lines, lambda r: r["to"] == "train_end")[0]
    last = recs[end - 1]["epoch"] - 1
    block = [r for r in recs if r["epoch"] == last and r["event"] in ("transition", "epoch")
             and not (r["event"] == "transition" and r["to"] == "train_end")]
    batches = next(r for r in block if r["event"] == "epoch")["payload"]["batches"]
    ts = recs[end - 1]["ts"]
    added = [_dump(dict(r, epoch=last + 1, global_step=r["global_step"] + batches, ts=ts)) for r in block]
    tail = []
    for r in recs[end - 1:]:
        r = dict(r, epoch=r["epoch"] + 1, global_step=r["global_step"] + batches)
        if r["event"] == "result":
            r["payload"] = dict(r["payload"], epochs_completed=r["payload"]["epochs_completed"] + 1,
                                global_step=r["payload"]["global_step"] + batches)
        tail.append(_dump(r))
    return _renumber([*lines[: end - 1], *added, *tail]), end


def stop_source(lines: Lines) -> tuple[Lines, int]:
    k = _where(lines, lambda r: r["event"] == "stop_request")[0]
    return _edit(lines, k, lambda r: r["payload"].update(source="OverfitDetectionCallback")), k


def stop_message(lines: Lines) -> tuple[Lines, int]:
    k = _where(lines, lambda r: r["event"] == "stop_request")[0]
    return _edit(lines, k, lambda r: r["payload"].update(message="validation loss diverged")), k


def ts_back(seconds: float) -> Callable[[Lines], tuple[Lines, int]]:
    def forge(lines: Lines) -> tuple[Lines, int]:
        k = _epoch_lines(lines)[1]
        return _edit(lines, k, lambda r: r.update(ts=r["ts"] - seconds)), k
    forge.__name__ = f"ts_back_{int(seconds)}"
    return forge


@dataclass(frozen=True)
class Case:
    forge: Callable[[Lines], tuple[Lines, int]]
    content: str | None  # the check that catches the consistent forger without key or files (None: none does)
    files: bool  # whether the checkpoint files (their pinned heads) catch the consistent forger


CASES = {
    "non_best_val_loss": Case(non_best_val_loss, None, True),
    "final_train_loss": Case(final_train_loss, None, False),
    "metrics_swapped": Case(metrics_swapped, "result", True),
    "batch_inserted": Case(batch_inserted, "level", True),
    "line_deleted": Case(line_deleted, "phase", True),
    "extra_epoch": Case(extra_epoch, "guard", False),
    "stop_source": Case(stop_source, "stop", True),
    "stop_message": Case(stop_message, "stop", True),
    "ts_back_an_hour": Case(ts_back(3600.0), "ts", True),
    "ts_back_a_year": Case(ts_back(365 * 86400.0), "ts", True),
}


def _first(report: AuditReport) -> tuple[int | None, str]:
    assert report.violations, report.render()
    f = report.violations[0]
    return f.line, f.check


def _write(tmp: Path, lines: Lines) -> Path:
    path = tmp / "events.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture()
def plain(quickstart_runs: QuickstartRuns) -> Lines:
    return read_lines(quickstart_runs.events())


@pytest.fixture()
def keyed(quickstart_runs: QuickstartRuns) -> Lines:
    return read_lines(quickstart_runs.events(keyed=True))


def test_the_untouched_logs_pass(quickstart_runs: QuickstartRuns, plain: Lines, keyed: Lines) -> None:
    report = audit_file(quickstart_runs.events())
    assert report.ok_strict, report.render()
    assert report.chain.ok and report.chain.schemes == ["sha256"]
    assert report.explanation.stop_reason == "early_stop" and report.explanation.checkpoints_pinned >= 3
    assert audit_file(quickstart_runs.events(keyed=True), key=QUICKSTART_KEY).ok_strict
    # The chain is over exactly the bytes EventLog wrote: recomputing it reproduces the file.
    assert rechain(plain) == plain and rechain(keyed, QUICKSTART_KEY) == keyed
    assert all(set(CASES[name].forge(plain)[0]) != set(plain) for name in CASES)  # every forgery changes the log


@pytest.mark.parametrize("name", list(CASES))
def test_naive_forgery_is_named_by_the_chain(plain: Lines, tmp_path: Path, name: str) -> None:
    forged, first_bad = CASES[name].forge(plain)
    report = audit_file(_write(tmp_path, forged), verify_checkpoints=False)
    assert _first(report)[0] == first_bad, report.render()
    chain = [f for f in report.violations if f.check == "chain"]
    assert [f.line for f in chain] == [first_bad] and report.chain.first_break == first_bad
    assert report.chain.ok is False


@pytest.mark.parametrize("name", list(CASES))
def test_consistent_forgery_without_a_key(quickstart_runs: QuickstartRuns, plain: Lines, tmp_path: Path,
                                          name: str) -> None:
    """The plain chain recomputed: it holds, so only content (and the checkpoint files) can tell."""
    case = CASES[name]
    forged, first_bad = case.forge(plain)
    path = _write(tmp_path, rechain(forged))
    report = audit_file(path, verify_checkpoints=False)
    assert report.chain.ok is True
    if case.content is None:
        assert report.ok, report.render()  # a plain chain proves consistency, not authorship
    else:
        line, check = _first(report)
        assert check == case.content, report.render()
        if check != "result":  # the result names the line it disagrees with, not the one edited
            assert line == first_bad, report.render()
    # With the run's checkpoint files beside the log, the heads they store pin the original chain.
    for ck in (quickstart_runs.plain / "checkpoints").iterdir():
        (tmp_path / "checkpoints").mkdir(exist_ok=True)
        (tmp_path / "checkpoints" / ck.name).write_bytes(ck.read_bytes())
    with_files = audit_file(path)
    pinned = [f for f in with_files.violations if f.check == "checkpoint"]
    assert bool(pinned) == case.files, with_files.render()
    assert all("stores chain head" in f.message for f in pinned)


def _rebuild_without_key(forged: Lines, original: Lines, first_bad: int) -> Lines:
    """What a forger without the key can do to a keyed log: keep the valid prefix (and the valid
    digest the first bad line's position carried), and rebuild the rest with plain sha256."""
    plain = Chain()
    out = forged[: first_bad - 1]
    prev = json.loads(original[first_bad - 1])["prev"]
    for line in forged[first_bad - 1:]:
        rec = json.loads(line)
        rec["prev"] = prev
        text = _dump(rec)
        out.append(text)
        prev = plain.digest(text.encode())
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_keyed_forgery_is_named_with_the_key(keyed: Lines, tmp_path: Path, name: str) -> None:
    forged, first_bad = CASES[name].forge(keyed)
    path = _write(tmp_path, _rebuild_without_key(forged, keyed, first_bad))
    report = audit_file(path, key=QUICKSTART_KEY, verify_checkpoints=False)
    assert _first(report) == (first_bad, "chain"), report.render()
    assert "rebuilt without the key" in report.violations[0].message
    # Without the key nothing about this chain can be said, and the audit says so.
    blind = audit_file(path, verify_checkpoints=False)
    assert blind.chain.ok is None and any("key is needed" in f.message for f in blind.violations)


def test_a_forger_who_rebuilds_the_whole_keyed_chain_without_the_key(keyed: Lines, tmp_path: Path) -> None:
    forged, _ = non_best_val_loss(keyed)
    for scheme_kept in (True, False):
        lines = rechain(forged)  # plain sha256 from the genesis on
        if not scheme_kept:  # ... and claiming the run had no key
            lines = rechain(_edit(lines, 1, lambda r: r["payload"].update(chain={"scheme": "sha256"})))
        report = audit_file(_write(tmp_path, lines), key=QUICKSTART_KEY, verify_checkpoints=False)
        line, check = _first(report)
        assert line == 1 and not report.ok
        if scheme_kept:
            assert check == "chain" and "rebuilt without the key" in report.violations[0].message
        else:
            assert check == "key" and "without one" in report.violations[0].message


def test_wrong_key_is_not_called_tampering(quickstart_runs: QuickstartRuns) -> None:
    report = audit_file(quickstart_runs.events(keyed=True), key=b"not-the-key")
    assert [(f.line, f.check) for f in report.violations] == [(1, "key")]
    message = report.violations[0].message
    assert "key does not match" in message and "altered" not in message and "tamper" not in message
    assert report.chain.ok is None and report.chain.key_matches is False
    assert "NOT VERIFIED" in report.render() and "key does not match" in report.render()


# --- accidental damage the audit caught before the chain: still caught, on the quickstart log ------
def _deleted(lines: Lines) -> tuple[Lines, int, str]:
    k = _epoch_lines(lines)[1]
    return lines[: k - 1] + lines[k:], k, "seq"


def _duplicated(lines: Lines) -> tuple[Lines, int, str]:
    k = _epoch_lines(lines)[1]
    return [*lines[:k], lines[k - 1], *lines[k:]], k + 1, "seq"


def _truncated(lines: Lines) -> tuple[Lines, int, str]:
    return [*lines[:-1], lines[-1][: len(lines[-1]) // 2]], len(lines), "json"


def _illegal_move(lines: Lines) -> tuple[Lines, int, str]:
    k = _where(lines, lambda r: r["to"] == "val" and r["epoch"] == 1)[0]
    return _edit(lines, k, lambda r: r.update(to="epoch_end", phase="epoch_end")), k, "transition"


def _other_run(lines: Lines) -> tuple[Lines, int, str]:
    return _edit(lines, 6, lambda r: r.update(run_id="someone-else")), 6, "run_id"


def _epoch_gap(lines: Lines) -> tuple[Lines, int, str]:
    k = _epoch_lines(lines)[1]
    return _edit(lines, k, lambda r: r.update(epoch=2)), k, "epochs"


def _reason_edited(lines: Lines) -> tuple[Lines, int, str]:
    k = _where(lines, lambda r: r["to"] == "train_end")[0]
    out = _edit(lines, k, lambda r: r["payload"].update(reason="completed"))
    return _edit(out, len(out), lambda r: r["payload"].update(stop_reason="completed")), k, "stop_reason"


def _cut(lines: Lines) -> tuple[Lines, int, str]:
    k = _where(lines, lambda r: r["to"] == "train_end")[0]
    return lines[: k - 1], k - 1, "end"


def _two_runs(lines: Lines) -> tuple[Lines, int, str]:
    second = [_dump(dict(json.loads(x), seq=json.loads(x)["seq"] + len(lines))) for x in lines]
    return lines + second, len(lines) + 1, "resume"


DAMAGE = [_deleted, _duplicated, _truncated, _illegal_move, _other_run, _epoch_gap, _reason_edited, _cut, _two_runs]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__.strip("_"))
def test_accidental_damage_is_still_caught(plain: Lines, tmp_path: Path,
                                           damage: Callable[[Lines], tuple[Lines, int, str]]) -> None:
    damaged, first_bad, check = damage(plain)
    report = audit_file(_write(tmp_path, damaged), verify_checkpoints=False)
    assert report.violations and report.violations[0].line == first_bad, report.render()
    assert check in {f.check for f in report.violations if f.line == first_bad}, report.render()


def test_a_checkpoint_changed_after_the_run_is_still_caught(quickstart_runs: QuickstartRuns, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(quickstart_runs.plain, run)
    lines = read_lines(run / "events.jsonl")
    k = _where(lines, lambda r: r["event"] == "checkpoint" and r["payload"]["kind"] == "latest")[-1]
    with open(run / json.loads(lines[k - 1])["payload"]["path"], "ab") as fh:
        fh.write(b"\0")
    report = audit_file(run / "events.jsonl")
    assert [(f.line, f.check) for f in report.violations] == [(k, "checkpoint")], report.render()


def test_slot_values_of_the_wrong_type(plain: Lines, tmp_path: Path) -> None:
    """Slots declare their types (``fsmtrain.core.slots``): a logged value of another type is named."""
    a, b = _epoch_lines(plain)[:2]
    forged = _edit(plain, a, lambda r: r["payload"]["slots"].update(max_grad_norm="large"))
    forged = _edit(forged, b, lambda r: r["payload"]["slots"].update(
        loss_prediction={"predicted_loss": 0.1, "neg_log10": 1.0, "fit_ok": "yes"}))
    report = audit_file(_write(tmp_path, rechain(forged)), verify_checkpoints=False)
    assert [(f.line, f.check) for f in report.violations] == [(a, "slot"), (b, "slot")], report.render()
    assert "declared as a number" in report.violations[0].message
    assert "fit_ok (true or false)" in report.violations[1].message


def test_a_line_appended_after_the_result(plain: Lines, tmp_path: Path) -> None:
    """Only a resume's run_start may follow a result: an appended, correctly chained line is named."""
    last = json.loads(plain[-1])
    assert last["event"] == "result"
    extra = dict(last, seq=last["seq"] + 1, event="warning", level="WARNING",
                 payload={"message": "val_loss 0.01 (re-evaluated)"})
    report = audit_file(_write(tmp_path, rechain([*plain, _dump(extra)])), verify_checkpoints=False)
    assert report.chain.ok is True
    assert [(f.line, f.check) for f in report.violations] == [(len(plain) + 1, "end")], report.render()
    assert "after the result" in report.violations[0].message
