"""The audit names what it finds: a checkpoint file damaged on disk, a file that
is an older write the log committed, a process killed between two lines, and a torn last line that
a resume cut off are distinct verdicts, each with its own words."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from audit_runs import REPO, _trainer, read_lines

from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.chain import KEY_ENV
from fsmtrain.tools.audit import AuditReport, Finding, Verdict, audit_file


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with three periodic checkpoints and latest.pt (committed after each epoch)."""
    run = tmp_path_factory.mktemp("verdicts") / "run"
    # Written in the foreground: a writer thread on a busy disk may skip a state (latest wins), and
    # these cases need each epoch's file.
    _trainer(run, [CheckpointCallback(run / "checkpoints", keep_last_k=3, background=False)], epochs=3).fit()
    return run


def _commits(run: Path) -> dict[str, list[int]]:
    """The lines (1-based) of each path's checkpoint events."""
    out: dict[str, list[int]] = {}
    for n, line in enumerate(read_lines(run / "events.jsonl"), 1):
        rec = json.loads(line)
        if rec["event"] == "checkpoint":
            out.setdefault(rec["payload"]["path"], []).append(n)
    return out


def _checkpoint_findings(report: AuditReport) -> list[Finding]:
    return [f for f in report.findings if f.check == "checkpoint"]


def _middle_of_largest_entry(path: Path) -> int:
    """The offset of a byte in the middle of the stored data of the file's largest zip entry:
    deep inside, away from every header."""
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    return info.header_offset + 30 + name_len + extra_len + info.compress_size // 2


def test_a_byte_flipped_deep_inside_a_checkpoint_is_damaged(checkpointed: Path, tmp_path: Path) -> None:
    """A byte flipped deep inside a checkpoint is damage, not "an older write"."""
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    file = run / "checkpoints" / "latest.pt"
    data = bytearray(file.read_bytes())
    data[_middle_of_largest_entry(file)] ^= 0xFF
    file.write_bytes(bytes(data))
    report = audit_file(run / "events.jsonl")
    (found,) = _checkpoint_findings(report)
    assert found.verdict is Verdict.DAMAGED and found in report.violations, report.render()
    assert found.line == _commits(run)["checkpoints/latest.pt"][-1]
    assert "is damaged" in found.message and "matches no write the log committed" in found.message
    assert "fails its CRC" in found.message and "older write" not in found.message


def test_a_checkpoint_that_is_an_older_committed_write_is_named_as_one(checkpointed: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    shutil.copyfile(run / "checkpoints" / "epoch_2.pt", run / "checkpoints" / "latest.pt")
    report = audit_file(run / "events.jsonl")
    (found,) = _checkpoint_findings(report)
    commits = _commits(run)
    committed_at = commits["checkpoints/epoch_2.pt"][0]
    assert found.verdict is Verdict.OLDER_WRITE and found in report.violations, report.render()
    assert found.line == commits["checkpoints/latest.pt"][-1]
    assert f"older write: the one line {committed_at} committed" in found.message, found.message
    assert "damaged" not in found.message
    assert json.loads(json.dumps(report.to_dict()))["violations"][0]["verdict"] == "older_write"


_KILL_AFTER_EPOCH_1 = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from audit_runs import _trainer
    from fsmtrain.callbacks import CheckpointCallback
    from fsmtrain.core.hooks import TrainingCallback

    class KillAtEpochEnd(TrainingCallback):
        priority = 99  # after CheckpointCallback (95) committed the epoch
        def on_epoch_end(self, epoch):
            if epoch.index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    run_dir = Path(sys.argv[1])
    _trainer(run_dir, [CheckpointCallback(run_dir / "checkpoints", background=False), KillAtEpochEnd()],
             epochs=4).fit()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_torn_line_repaired_by_resume_is_not_called_a_kill(tmp_path: Path) -> None:
    """A run whose torn last line was repaired by resume is told apart from "the process was killed".
    A real SIGKILL ends the first process; one copy of its run gets a torn last line (a line cut mid-write),
    the other none; both are resumed and audited."""
    script = tmp_path / "kill.py"
    script.write_text(_KILL_AFTER_EPOCH_1.format(tests=str(Path(__file__).resolve().parent)), encoding="utf-8")
    killed = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(KEY_ENV, None)
    done = subprocess.run([sys.executable, str(script), str(killed)], cwd=REPO, env=env, timeout=200, check=False)
    assert done.returncode == -signal.SIGKILL
    lines = read_lines(killed / "events.jsonl")
    last = json.loads(lines[-1])
    torn = json.dumps({**last, "seq": last["seq"] + 1, "event": "epoch"}, separators=(",", ":"))[:57].encode()
    verdicts: dict[str, AuditReport] = {}
    for name in ("torn", "clean"):
        run = tmp_path / name
        shutil.copytree(killed, run)
        if name == "torn":
            with open(run / "events.jsonl", "ab") as fh:
                fh.write(torn)
        _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=4, resume_from="latest").fit()
        verdicts[name] = report = audit_file(run / "events.jsonl")
        assert report.violations == [], report.render()
        assert report.explanation.epochs_completed == 4

    said = {name: {f.verdict for f in r.warnings} for name, r in verdicts.items()}
    assert Verdict.TORN_LINE_REPAIRED in said["torn"] and Verdict.KILLED not in said["torn"], verdicts["torn"].render()
    assert Verdict.KILLED in said["clean"] and Verdict.TORN_LINE_REPAIRED not in said["clean"]
    (repaired,) = [f for f in verdicts["torn"].warnings if f.verdict is Verdict.TORN_LINE_REPAIRED]
    assert f"torn line ({len(torn)} bytes)" in repaired.message and "process was killed" not in repaired.message
    assert repaired.line == len(lines) + 1  # the resume's run_start
    (kill,) = [f for f in verdicts["clean"].warnings if f.verdict is Verdict.KILLED]
    assert "killed between two lines" in kill.message and "cut off" not in kill.message


_KILL_IN_TEARDOWN = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from audit_runs import _trainer
    from fsmtrain.callbacks import CheckpointCallback
    from fsmtrain.core.hooks import TrainingCallback

    class KillInTeardown(TrainingCallback):
        priority = 99  # after CheckpointCallback (95) committed the final state
        def on_train_end(self, run):
            os.kill(os.getpid(), signal.SIGKILL)

    run_dir = Path(sys.argv[1])
    _trainer(run_dir, [CheckpointCallback(run_dir / "checkpoints", background=False), KillInTeardown()],
             epochs=2).fit()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kill_in_the_teardown_then_a_resume_is_a_kill_not_a_violation(tmp_path: Path) -> None:
    """A SIGKILL after ``train_end`` cannot write the ``result``: alone, the log is unfinished (a violation);
    resumed, the run's result is written by the resume and the killed teardown is a KILLED warning."""
    script = tmp_path / "kill.py"
    script.write_text(_KILL_IN_TEARDOWN.format(tests=str(Path(__file__).resolve().parent)), encoding="utf-8")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(KEY_ENV, None)
    done = subprocess.run([sys.executable, str(script), str(run)], cwd=REPO, env=env, timeout=200, check=False)
    assert done.returncode == -signal.SIGKILL
    alone = audit_file(run / "events.jsonl")
    assert any("no result event after train_end" in f.message for f in alone.violations), alone.render()
    _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=2, resume_from="latest").fit()
    report = audit_file(run / "events.jsonl")
    assert report.violations == [], report.render()
    (kill,) = [f for f in report.warnings if f.verdict is Verdict.KILLED]
    assert "killed in its teardown" in kill.message, kill.message
    assert report.explanation.epochs_completed == 2
