"""Every byte of every line is under the chain and the key.

Each line carries in ``seal`` the digest (HMAC with a key) of its own bytes without the seal, and
the next line carries in ``prev`` the digest of the whole line: the last line, which has no
successor, is sealed like every other. The property test edits one field of one event of a real
keyed log (every event kind, every field, nested payload fields included) and the audit with the
key must name the edited line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from audit_runs import KEYED_RUN_KEY, read_lines, rechain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsmtrain.cli import main as cli_main
from fsmtrain.core.chain import Chain
from fsmtrain.tools.audit import AuditReport, audit_file

Path_ = tuple[Any, ...]  # a field's path in a record: keys and list indices


def _dump(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"


@pytest.fixture(scope="module")
def keyed_lines(keyed_run: Path) -> list[str]:
    lines = read_lines(keyed_run / "events.jsonl")
    assert all(_dump(json.loads(x)) == x for x in lines)  # re-encoding an unchanged record gives its bytes
    return lines


def _write(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "events.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _chain_names(report: AuditReport, line: int) -> bool:
    """The audit fails, the chain is broken, and its first finding names ``line``."""
    chain = [f for f in report.violations if f.check == "chain"]
    return (not report.ok and report.chain.ok is False and bool(chain) and chain[0].line == line
            and report.chain.first_break == line)


# --- found -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit", ["ts_plus_an_hour", "level", "payload_field_added"])
def test_the_result_line_cannot_be_edited_unnoticed(keyed_run: Path, keyed_lines: list[str], tmp_path: Path,
                                                    edit: str, capsys: pytest.CaptureFixture[str]) -> None:
    """With a log key, changing the result line's ts by an hour, its level, or adding a payload field
    fails ``fsmtrain audit RUN --key-file k.key``: the last line's seal covers every byte of it."""
    rec = json.loads(keyed_lines[-1])
    assert rec["event"] == "result"
    if edit == "ts_plus_an_hour":
        rec["ts"] += 3600.0
    elif edit == "level":
        rec["level"] = "warning"
    else:
        rec["payload"]["note"] = "edited"
    path = _write(tmp_path / "run", [*keyed_lines[:-1], _dump(rec)])
    (tmp_path / "k.key").write_bytes(KEYED_RUN_KEY + b"\n")
    code = cli_main(["audit", str(path.parent), "--key-file", str(tmp_path / "k.key"), "--no-checkpoints"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "proves consistency and authorship" not in out
    last = len(keyed_lines)
    assert f"line {last} [chain] line {last} was altered after it was written" in out, out
    assert _chain_names(audit_file(path, key=KEYED_RUN_KEY, verify_checkpoints=False), last)


def test_the_untouched_keyed_log_passes_and_every_line_is_sealed(keyed_run: Path, keyed_lines: list[str]) -> None:
    report = audit_file(keyed_run / "events.jsonl", key=KEYED_RUN_KEY)
    assert report.ok_strict, report.render()
    assert report.chain.ok and report.chain.sealed and len(report.segments) == 2
    assert "proves consistency and authorship" in report.render()
    chain = Chain(KEYED_RUN_KEY)
    prev = chain.genesis("keyed", json.loads(keyed_lines[0])["payload"].get("config"))
    for line in keyed_lines:  # the seal is the digest of the line without it; prev, of the whole line before
        rec = json.loads(line)
        seal = rec.pop("seal")
        assert list(rec)[-1] == "prev" and rec["prev"] == prev
        assert seal == chain.digest(_dump(rec).encode())
        prev = chain.digest(line.encode())


def test_a_keyed_log_without_its_key_cannot_prove_authorship(keyed_run: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSMTRAIN_LOG_KEY", raising=False)
    for strict in ([], ["--strict"]):
        code = cli_main(["audit", str(keyed_run), "--no-checkpoints", *strict])
        out = capsys.readouterr().out
        assert code == 1, out
        assert "cannot prove authorship" in out and "NOT VERIFIED" in out, out
    report = audit_file(keyed_run / "events.jsonl", verify_checkpoints=False)
    assert not report.ok_strict and report.chain.ok is None


def test_a_log_of_the_older_format_audits_and_says_its_last_line_is_not_sealed(keyed_lines: list[str],
                                                                                 tmp_path: Path) -> None:
    """Logs written before lines were sealed: the chain is checked as it was, and the audit says
    that the last line is not under it (a warning: --strict fails)."""
    old = rechain(keyed_lines, KEYED_RUN_KEY, sealed=False)
    assert all('"seal"' not in line for line in old)
    report = audit_file(_write(tmp_path, old), key=KEYED_RUN_KEY, verify_checkpoints=False)
    assert report.ok and not report.ok_strict, report.render()
    assert report.chain.ok is True and report.chain.sealed is False
    (warning,) = report.warnings
    assert warning.line == len(old) and "not sealed" in warning.message
    assert "last line not sealed" in report.render()


# --- every field of every event --------------------------------------------------------------------
def _paths(value: Any, at: Path_ = ()) -> list[Path_]:
    """Every field of a record, nested ones included (a dict's keys, a list's items)."""
    out: list[Path_] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append((*at, k))
        out += _paths(v, (*at, k))
    return out


def _get(rec: Any, path: Path_) -> Any:
    for k in path:
        rec = rec[k]
    return rec


_JSON = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))


def _replaced(old: Any) -> Any:
    """A plausible other value of the same kind: what an editor would write."""
    if type(old) is bool:
        return not old
    if type(old) in (int, float):
        return old + 1
    if type(old) is str:
        return old + "x" if len(old) != 64 else old[:-1] + ("0" if old[-1] != "0" else "1")  # a digest
    if isinstance(old, list):
        return [*old, 0]
    if isinstance(old, dict):
        return {**old, "x": 0}
    return 0


def _other_value(old: Any, draw: Any) -> Any:
    """A value whose encoding differs from ``old``'s: a plausible edit (an hour for a ts), or any
    JSON value."""
    choice = draw(st.sampled_from(["plausible", "nudge", "any"]))
    if choice == "nudge" and type(old) in (int, float):
        return old + draw(st.sampled_from([-1, 3600.0, 1e-6]))
    new = draw(_JSON) if choice == "any" else _replaced(old)
    return new if json.dumps(new) != json.dumps(old) else _replaced(old)


def _mutate(rec: dict[str, Any], path: Path_, how: str, draw: Any) -> None:
    """``draw`` None: the plausible replacement (the sweep)."""
    parent, key = _get(rec, path[:-1]), path[-1]
    if how == "delete":
        del parent[key]
    elif how == "add":  # a field beside this one (an item after it, in a list)
        if isinstance(parent, dict):
            parent[f"{key}_x"] = draw(_JSON)
        else:
            parent.insert(key + 1, draw(_JSON))
    else:
        parent[key] = _replaced(parent[key]) if draw is None else _other_value(parent[key], draw)


def _one_edit(lines: list[str], index: int, path: Path_, how: str, draw: Any = None) -> list[str]:
    rec = json.loads(lines[index])
    _mutate(rec, path, how, draw)
    edited = _dump(rec)
    assert edited != lines[index]
    return [*lines[:index], edited, *lines[index + 1:]]


@pytest.fixture(scope="module")
def by_kind(keyed_lines: list[str]) -> dict[str, list[int]]:
    """The indices of the log's lines, by event kind."""
    out: dict[str, list[int]] = {}
    for i, line in enumerate(keyed_lines):
        out.setdefault(json.loads(line)["event"], []).append(i)
    return out


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_one_field_edited_in_any_event_is_named_with_the_key(keyed_lines: list[str], by_kind: dict[str, list[int]],
                                                                 tmp_path_factory: pytest.TempPathFactory,
                                                                 data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(by_kind)), label="kind")
    index = data.draw(st.sampled_from(by_kind[kind]), label="line index")
    path = data.draw(st.sampled_from(_paths(json.loads(keyed_lines[index]))), label="field")
    how = data.draw(st.sampled_from(["replace", "delete", "add"]), label="edit")
    edited = _one_edit(keyed_lines, index, path, how, data.draw)
    folder = tmp_path_factory.getbasetemp() / "seal-property"
    report = audit_file(_write(folder, edited), key=KEYED_RUN_KEY, verify_checkpoints=False)
    assert _chain_names(report, index + 1), report.render()


def test_every_field_of_every_event_kind_in_turn(keyed_lines: list[str], tmp_path: Path) -> None:
    """The sweep: for each event kind, its first and its last line, each field replaced in turn."""
    recs = [json.loads(x) for x in keyed_lines]
    kinds = sorted({r["event"] for r in recs})
    assert {"run_start", "transition", "epoch", "checkpoint", "checkpoint_removed", "warning", "exception",
            "stop_request", "resume", "result"} <= set(kinds)
    cases = 0
    for kind in kinds:
        where = [i for i, r in enumerate(recs) if r["event"] == kind]
        for index in sorted({where[0], where[-1]}):
            for path in _paths(recs[index]):
                edited = _one_edit(keyed_lines, index, path, "replace")
                report = audit_file(_write(tmp_path, edited), key=KEYED_RUN_KEY, verify_checkpoints=False)
                assert _chain_names(report, index + 1), (kind, path, report.render())
                cases += 1
    assert cases > 200


@pytest.mark.parametrize(("where", "path", "value"), [
    ("first", ("payload",), True),  # found by the property test: the audit raised AttributeError
    ("last_run_start", ("payload", "callbacks", 2, "name"), None),  # ... and TypeError (EarlyStopping)
])
def test_an_edit_the_audit_once_crashed_on_is_named(keyed_lines: list[str], by_kind: dict[str, list[int]],
                                                    tmp_path: Path, where: str, path: Path_, value: Any) -> None:
    index = 0 if where == "first" else by_kind["run_start"][-1]
    rec = json.loads(keyed_lines[index])
    _get(rec, path[:-1])[path[-1]] = value
    edited = [*keyed_lines[:index], _dump(rec), *keyed_lines[index + 1:]]
    report = audit_file(_write(tmp_path, edited), key=KEYED_RUN_KEY, verify_checkpoints=False)
    assert _chain_names(report, index + 1), report.render()
