"""The hash chain itself: how ``EventLog`` writes it (genesis, append, key), what checkpoints pin,
the audit across resumed segments and cut-back logs, and ``fsmtrain audit --key-file/--json``."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from audit_runs import QUICKSTART_KEY, REPO, QuickstartRuns, _RaiseAt, _trainer, read_lines, rechain
from core_helpers import make_trainer

from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.chain import KEY_ENV, Chain, read_key_file
from fsmtrain.core.events import EventLog, read_events
from fsmtrain.tools.audit import audit_file


def _links_hold(path: Path, chain: Chain, genesis: str) -> bool:
    prev = genesis
    for raw in path.read_bytes().splitlines(keepends=True):
        if json.loads(raw)["prev"] != prev:
            return False
        prev = chain.digest(raw)
    return True


# --- EventLog --------------------------------------------------------------------------------------
def test_every_line_chains_to_the_one_before_and_appending_continues(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    config = {"lr": 0.1, "epochs": 2, "nan": float("nan")}
    log = EventLog(path, "r1", console=None, config=config)
    genesis = log.head
    assert genesis == Chain().genesis("r1", {"lr": 0.1, "epochs": 2, "nan": "NaN"})
    log.emit("run_start", payload={"config": config})
    log.emit("epoch", payload={"metrics": {"val_loss": 0.5}})
    log.close()
    head = log.head
    assert head == Chain().digest(path.read_bytes().splitlines(keepends=True)[-1])
    again = EventLog(path, "r1", console=None, start_seq=2)  # a resumed process appends
    assert again.head == head
    again.emit("run_start", payload={"resumed_from": "checkpoints/latest.pt"})
    again.close()
    assert _links_hold(path, Chain(), genesis)
    assert read_events(path)[0]["payload"]["chain"] == {"scheme": "sha256"}


def test_a_line_cut_by_a_killed_process_is_ended_and_chained_to(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, "r", console=None)
    log.emit("run_start")
    log.close()
    cut = b'{"seq":1,"ts":99999999999.0,"run_id":"r","ev'
    with open(path, "ab") as fh:
        fh.write(cut)
    log = EventLog(path, "r", console=None, start_seq=1)
    log.emit("run_start")
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines[1] == cut + b"\n"
    assert json.loads(lines[2])["prev"] == Chain().digest(cut + b"\n")


def test_timestamps_never_go_back_in_one_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    future = 4102444800.0  # 2100: the clock of the process that wrote the log before was ahead
    path.write_text(json.dumps({"seq": 0, "ts": future, "event": "run_start"}) + "\n", encoding="utf-8")
    log = EventLog(path, "r", console=None, start_seq=1)
    log.emit("run_start")
    log.emit("x")
    log.close()
    assert [e["ts"] for e in read_events(path)[1:]] == [future, future]


def test_a_keyed_log_records_the_scheme_and_key_id_never_the_key(tmp_path: Path) -> None:
    key = b"the-very-secret-key"
    log = EventLog(tmp_path / "events.jsonl", "r", console=None, key=key)
    log.emit("run_start")
    log.emit("y")
    log.close()
    text = (tmp_path / "events.jsonl").read_text(encoding="utf-8")
    assert key.decode() not in text
    chain = Chain(key)
    assert read_events(tmp_path / "events.jsonl")[0]["payload"]["chain"] == {
        "scheme": "hmac-sha256", "key_id": chain.key_id}
    assert _links_hold(tmp_path / "events.jsonl", chain, chain.genesis("r", None))
    assert not _links_hold(tmp_path / "events.jsonl", Chain(b"another"), Chain(b"another").genesis("r", None))


def test_the_trainer_takes_the_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "from-env")
    make_trainer(tmp_path / "env", epochs=1).fit()
    assert audit_file(tmp_path / "env" / "events.jsonl", key=b"from-env").ok_strict
    monkeypatch.delenv(KEY_ENV)
    make_trainer(tmp_path / "arg", epochs=1, log_key=b"from-arg").fit()
    assert audit_file(tmp_path / "arg" / "events.jsonl", key=b"from-arg").ok_strict
    assert not audit_file(tmp_path / "arg" / "events.jsonl").ok  # a key is needed


def test_key_files(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"secret\n")
    assert read_key_file(tmp_path / "k") == b"secret"
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="is empty"):
        read_key_file(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read key file"):
        read_key_file(tmp_path / "missing")


def test_an_unchained_log_is_refused(quickstart_runs: QuickstartRuns, tmp_path: Path) -> None:
    lines = []
    for line in read_lines(quickstart_runs.events()):
        rec = json.loads(line)
        del rec["prev"]
        lines.append(json.dumps(rec) + "\n")
    (tmp_path / "events.jsonl").write_text("".join(lines), encoding="utf-8")
    report = audit_file(tmp_path / "events.jsonl", verify_checkpoints=False)
    assert [(f.line, f.check) for f in report.violations] == [(1, "chain")]
    assert "not hash-chained" in report.violations[0].message and report.chain.ok is False


# --- checkpoints pin the chain ---------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoints_store_the_head_their_event_records(quickstart_runs: QuickstartRuns) -> None:
    run = quickstart_runs.plain
    events = read_events(run / "events.jsonl")
    latest = [e for e in events if e["event"] == "checkpoint" and e["payload"]["kind"] == "latest"][-1]
    state = torch.load(run / latest["payload"]["path"], weights_only=True)
    assert state["chain_head"] == latest["payload"]["chain_head"]
    i = events.index(latest)
    before = read_lines(run / "events.jsonl")
    pinned = [Chain().digest(line.encode()) for line in before[:i]]
    assert latest["payload"]["chain_head"] in pinned  # the digest of a line logged before the event


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst / "events.jsonl"


@pytest.mark.slow
def test_a_log_cut_back_before_a_checkpoint_is_caught_by_its_pinned_head(quickstart_runs: QuickstartRuns,
                                                                          tmp_path: Path) -> None:
    lines = read_lines(quickstart_runs.events())
    recs = [json.loads(x) for x in lines]
    last_start = max(i for i, r in enumerate(recs) if r["trigger"] == "next_epoch")
    last_epoch = recs[last_start]["epoch"]
    # the commit of the last epoch's files (a background write is committed at train_end)
    first_ckpt = min(i for i, r in enumerate(recs)
                     if r["event"] == "checkpoint" and r["payload"]["epoch"] == last_epoch)

    # Cut back to before the last epoch: the files it wrote pin lines this log no longer has.
    log = _copy_run(quickstart_runs.plain, tmp_path / "a")
    log.write_text("".join(lines[:last_start]), encoding="utf-8")
    report = audit_file(log)
    pins = [f for f in report.violations if f.check == "checkpoint"]
    assert pins and all("no line of this log" in f.message for f in pins), report.render()

    # Cut at the last checkpoint and given a made-up ending with a consistent plain chain: the
    # files pin a line the log still has, but the log goes on without committing them.
    end = [r for r in recs[-2:]]
    forged = rechain(lines[:first_ckpt] + [json.dumps(r) + "\n" for r in end])
    log = _copy_run(quickstart_runs.plain, tmp_path / "b")
    log.write_text("".join(forged), encoding="utf-8")
    report = audit_file(log)
    pins = [f for f in report.violations if f.check == "checkpoint"]
    pinned = 1 + next(i for i, line in enumerate(lines)  # the line whose chain head the files store
                      if Chain(None).digest(line.encode()) == recs[first_ckpt]["payload"]["chain_head"])
    assert pins and pins[0].line == pinned + 1 and "goes on without recording it" in pins[0].message

    # Cut exactly there and nothing more: what a process killed during that write leaves.
    log = _copy_run(quickstart_runs.plain, tmp_path / "c")
    log.write_text("".join(lines[:first_ckpt]), encoding="utf-8")
    report = audit_file(log)
    assert {f.check for f in report.violations} == {"end"}, report.render()  # unfinished, and no more
    assert any("uncommitted write" in f.message for f in report.warnings)


# --- resumed runs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("started", "resumed"), [(b"run-key", None), (b"run-key", b"other-key"), (None, b"run-key")])
def test_a_resume_with_another_key_or_none_is_refused_before_it_touches_the_run(
        tmp_path: Path, started: bytes | None, resumed: bytes | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyed run resumed without its key (or with another) is refused: chaining on with plain sha256
    (or the other key) would leave a log no key can verify."""
    from fsmtrain.training.resume import ResumeError

    run = tmp_path / "run"
    if started is not None:
        monkeypatch.setenv(KEY_ENV, started.decode())
    with pytest.raises(KeyboardInterrupt):
        _trainer(run, [CheckpointCallback(run / "checkpoints"), _RaiseAt(2, KeyboardInterrupt())], epochs=4).fit()
    before = sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file())
    monkeypatch.delenv(KEY_ENV, raising=False)
    if resumed is not None:
        monkeypatch.setenv(KEY_ENV, resumed.decode())
    with pytest.raises(ResumeError, match=f"{KEY_ENV}|key id") as info:
        _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=4, resume_from="latest")
    assert str(run / "events.jsonl") in str(info.value)
    assert sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file()) == before
    monkeypatch.delenv(KEY_ENV, raising=False)
    if started is not None:
        monkeypatch.setenv(KEY_ENV, started.decode())
    _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=4, resume_from="latest").fit()
    assert audit_file(run / "events.jsonl", key=started).ok


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, b"resume-key"])
def test_the_chain_runs_across_a_resume(tmp_path: Path, key: bytes | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run interrupted in epoch 2 (a KeyboardInterrupt in a callback), then a real resume
    (``resume_from="latest"``) appending to the same log from the epoch after its latest checkpoint."""
    if key is not None:
        monkeypatch.setenv(KEY_ENV, key.decode())
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _trainer(run, [CheckpointCallback(run / "checkpoints"), _RaiseAt(2, KeyboardInterrupt())], epochs=6).fit()
    first = read_lines(run / "events.jsonl")
    records = [json.loads(x) for x in first]
    latest = [r for r in records if r["event"] == "checkpoint" and r["payload"]["kind"] == "latest"][-1]
    start = latest["payload"]["epoch"] + 1
    trainer = _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=start + 2, resume_from="latest")
    assert trainer.run.epoch == start
    trainer.fit()
    lines = read_lines(run / "events.jsonl")
    assert json.loads(lines[len(first)])["prev"] == Chain(key).digest(first[-1].encode())
    report = audit_file(run / "events.jsonl", key=key)
    assert report.violations == [], report.render()
    assert report.chain.ok and [s.first_line for s in report.segments] == [1, len(first) + 1]
    assert all(s.chain_verified for s in report.segments) and report.explanation.checkpoints_pinned >= 2
    # The second segment's first line edited: named, across the boundary.
    rec = json.loads(lines[len(first)])
    rec["ts"] += 1e-3
    lines[len(first)] = json.dumps(rec, separators=(",", ":")) + "\n"
    (run / "events.jsonl").write_text("".join(lines), encoding="utf-8")
    bad = audit_file(run / "events.jsonl", key=key, verify_checkpoints=False)
    assert (bad.violations[0].line, bad.violations[0].check) == (len(first) + 1, "chain"), bad.render()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_and_resumed_quickstart_chains_across_segments(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsmtrain train`` killed with SIGKILL mid-run, then ``fsmtrain resume``, with a key: the
    audit passes with the key, and the chain runs from the first segment into the second. Then the
    log cut back to before its last epoch is caught by the checkpoints' pinned heads."""
    from fsmtrain.cli import main as cli_main

    key = "kill-and-resume-key"
    env = dict(os.environ, PYTHONPATH=str(REPO), **{KEY_ENV: key})
    settings = ["--set", "epochs=40", "--set", "wandb.enabled=false", "--set", "early_stopping.enabled=false",
                "--set", "scheduler_config.T_max=40"]
    proc = subprocess.Popen([sys.executable, "-m", "fsmtrain", "train", str(REPO / "configs" / "quickstart.yaml"),
                             "--run-dir", str(tmp_path), *settings], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = tmp_path / "mlp-regression-seed0"
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            log = run / "events.jsonl"
            if log.is_file() and log.read_bytes().count(b'"event":"epoch"') >= 3:
                break
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.3))  # a moment anywhere in the next epochs: mid-write included
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    monkeypatch.setenv(KEY_ENV, key)
    assert cli_main(["resume", str(run)]) == 0
    lines = read_lines(run / "events.jsonl")
    starts = [i for i, line in enumerate(lines) if '"event":"run_start"' in line]
    assert len(starts) == 2
    chain = Chain(key.encode())
    assert json.loads(lines[starts[1]])["prev"] == chain.digest(lines[starts[1] - 1].encode())
    report = audit_file(run / "events.jsonl", key=key.encode())
    assert report.violations == [], report.render()
    assert report.chain.ok and report.chain.key_matches and len(report.segments) == 2
    assert report.explanation.epochs_completed == 40 and report.explanation.checkpoints_pinned >= 2

    # Cut back to before the last epoch began: the files that epoch committed pin lines the log lost.
    last_start = max(i for i, line in enumerate(lines) if '"trigger":"next_epoch"' in line)
    (run / "events.jsonl").write_text("".join(lines[:last_start]), encoding="utf-8")
    cut = audit_file(run / "events.jsonl", key=key.encode())
    pins = [f for f in cut.violations if f.check == "checkpoint"]
    assert pins and all("no line of this log" in f.message for f in pins), cut.render()


_KILL_AFTER_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from audit_runs import _trainer
    from fsmtrain.callbacks import CheckpointCallback
    from fsmtrain.core.hooks import TrainingCallback

    class KillAfterCommit(TrainingCallback):
        priority = 99  # after CheckpointCallback (95) committed the epoch, before its epoch event
        def on_epoch_end(self, epoch):
            if epoch.index == {epoch}:
                os.kill(os.getpid(), signal.SIGKILL)

    run_dir = Path(sys.argv[1])
    # written and committed before the epoch ends: the window a background write does not have
    _trainer(run_dir, [CheckpointCallback(run_dir / "checkpoints", background=False), KillAfterCommit()],
             epochs=5).fit()
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("epoch", [2, 4])
def test_killed_between_the_commit_and_the_epoch_event(tmp_path: Path, epoch: int) -> None:
    """The checkpoint of an epoch is committed, the epoch event never written: a resume from it is
    legal, the epoch counts, and the audit says what the log lacks. The last epoch (4 of 5) too: the
    resume goes straight to train_end, and the result's last_val_loss is that unlogged epoch's."""
    script = tmp_path / "kill.py"
    script.write_text(_KILL_AFTER_COMMIT.format(tests=str(Path(__file__).resolve().parent), epoch=epoch),
                      encoding="utf-8")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(KEY_ENV, None)
    done = subprocess.run([sys.executable, str(script), str(run)], cwd=REPO, env=env, timeout=200, check=False)
    assert done.returncode == -signal.SIGKILL
    events = read_events(run / "events.jsonl")
    assert [e["payload"]["epoch"] for e in events if e["event"] == "checkpoint"][-1] == epoch
    assert not [e for e in events if e["event"] == "epoch" and e["epoch"] == epoch]
    _trainer(run, [CheckpointCallback(run / "checkpoints")], epochs=5, resume_from="latest").fit()
    report = audit_file(run / "events.jsonl")
    assert report.violations == [], report.render()
    assert report.explanation.epochs_completed == 5 and report.chain.ok
    assert any("killed before it logged the epoch" in f.message for f in report.warnings)


# --- CLI -------------------------------------------------------------------------------------------
def _audit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "fsmtrain", "audit", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_key_file_and_json_verdict(quickstart_runs: QuickstartRuns, tmp_path: Path) -> None:
    events = str(quickstart_runs.events(keyed=True))
    (tmp_path / "key").write_bytes(QUICKSTART_KEY + b"\n")
    (tmp_path / "wrong").write_bytes(b"guess\n")
    ok = _audit_cli(events, "--key-file", str(tmp_path / "key"), "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    verdict = json.loads(ok.stdout)
    assert verdict["ok"] and verdict["chain"]["ok"] and verdict["chain"]["key_used"]
    assert verdict["chain"]["schemes"] == ["hmac-sha256"] and verdict["chain"]["key_matches"] is True
    assert verdict["segments"][0]["end_reason"] == "early_stop" and verdict["violations"] == []
    assert any("early_stop" in line for line in verdict["story"])
    wrong = _audit_cli(events, "--key-file", str(tmp_path / "wrong"))
    assert wrong.returncode == 1 and "key does not match" in wrong.stdout and "altered" not in wrong.stdout
    blind = _audit_cli(events)
    assert blind.returncode == 1 and "key is needed" in blind.stdout
    missing = _audit_cli(events, "--key-file", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "cannot read key file" in missing.stderr
    plain = _audit_cli(str(quickstart_runs.events()))
    assert plain.returncode == 0 and "proves consistency only (no key)" in plain.stdout
