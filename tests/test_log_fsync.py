"""Durable commits: the log is fsync'd once per checkpoint commit (after the last of
its ``checkpoint`` lines) and after ``result`` (``log.fsync: commits``, the default), after every
line (``every``) or never (``never``).

The real ``os.fsync`` runs; a wrapper around it counts the calls made on the log's own file
descriptor (which no other file can hold while the log is open)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from core_helpers import DiskKeepsUp, make_trainer

from fsmtrain.app.config import ConfigError, config_from_dict
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.events import read_events


def _fsyncs_of_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool = True,
                       slow_disk: float = 0.0, **kw: Any) -> tuple[int, list[dict[str, Any]]]:
    calls: list[int] = []
    real = os.fsync
    log_fd = -1

    def counting(fd: int) -> None:
        calls.append(fd)
        if fd != log_fd:
            time.sleep(slow_disk)  # a slow disk for the checkpoint files only
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    run = tmp_path / "run"
    store = CheckpointCallback(run / "checkpoints", keep_last_k=1, background=background)
    trainer = make_trainer(run, [store], epochs=3, **kw)
    assert trainer.events is not None and trainer.events._file is not None
    log_fd = trainer.events._file.fileno()
    trainer.fit()
    monkeypatch.undo()
    return calls.count(log_fd), read_events(run / "events.jsonl")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("background", "slow_disk"), [(False, 0.0), (True, 0.0), (True, 0.5)],
                         ids=["foreground", "writer-thread", "writer-thread-slow-disk"])
def test_the_log_is_fsynced_at_each_checkpoint_commit_and_at_the_result_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool, slow_disk: float) -> None:
    """events.jsonl is fsync'd at each checkpoint commit, once after the commit's last line (else
    after a power loss a durable checkpoint could lose its commit line, and resume would delete it),
    and at result.

    With the writer thread, epoch 1's state may be dropped for epoch 2's while epoch 0's write is
    still in flight (the documented ``checkpoint_skipped``), so the commits are counted from the log
    there; the foreground store commits every epoch, and a slow disk (each checkpoint fsync 0.5 s,
    against epochs of milliseconds) always drops epoch 1."""
    synced, events = _fsyncs_of_the_log(tmp_path, monkeypatch, background=background, slow_disk=slow_disk)
    lines = [e for e in events if e["event"] == "checkpoint"]
    commits = {e["payload"]["epoch"] for e in lines}  # one commit per epoch: its file and the links to it
    skipped = {e["payload"]["epoch"] for e in events if e["event"] == "checkpoint_skipped"}
    assert commits | skipped == {0, 1, 2} and not commits & skipped
    assert {0, 2} <= commits and (background or len(commits) == 3)  # the first and the last are never dropped
    assert not slow_disk or skipped == {1}
    assert len(lines) > len(commits) and events[-1]["event"] == "result"
    assert synced == len(commits) + 1


@pytest.mark.parametrize("policy", ["every", "never"])
def test_log_fsync_every_line_or_never(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    synced, events = _fsyncs_of_the_log(tmp_path, monkeypatch, log_fsync=policy)
    assert synced == (len(events) if policy == "every" else 0)


def test_log_fsync_is_a_config_option_checked_like_any_other() -> None:
    base = {"net": "fsmtrain.training.models.MLP", "net_config": {"in_features": 8, "out_features": 1},
            "data": "fsmtrain.training.data.synthetic_regression", "epochs": 5, "batch_size": 32}
    assert config_from_dict(base).log.fsync == "commits"
    assert config_from_dict({**base, "log": {"fsync": "every"}}).log.fsync == "every"
    with pytest.raises(ConfigError) as info:
        config_from_dict({**base, "log": {"fsync": "sometimes"}})
    found = {p.path: p for p in info.value.problems}
    assert "log.fsync" in found and "commits" in found["log.fsync"].expected
    with pytest.raises(ValueError, match="fsync must be one of commits, every, never"):
        make_trainer(None, [], log_fsync="always")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("background", "policy", "slow_disk"),
                         [(True, "commits", 0.0), (False, "commits", 0.0), (True, "every", 0.0),
                          (True, "commits", 0.2)],
                         ids=["writer-thread", "foreground", "writer-thread-every-line", "writer-thread-slow-disk"])
def test_no_line_is_durable_before_the_names_it_commits_with_one_folder_fsync_a_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool, policy: str, slow_disk: float) -> None:
    """The real calls, in order: each rename into the checkpoint folder, each fsync of that folder, and
    each fsync of the log with the log's length then. Every ``checkpoint`` line inside a synced length
    names a file renamed before a folder fsync that came before that log fsync. With roles to link and
    the log synced at commits, one folder fsync a write makes the epoch file's rename and its links
    durable at once (the removals ride on the next write's); it was three a write (the file's, the
    links', the removal's). A log that syncs every line as it is written needs the file's own.

    Every epoch's state is written (``DiskKeepsUp``): on a busy machine or disk the writer thread
    otherwise leaves the waiting ones out, by design, and with epochs 1 and 2 left out nothing is
    removed (seen in CI; the slow disk makes it certain)."""
    trace: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace
    run = tmp_path / "run"
    folder = run / "checkpoints"
    log_fd = -1

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if fd == log_fd:
            trace.append(("log", os.fstat(fd).st_size))
        elif folder.exists() and os.path.samestat(os.fstat(fd), os.stat(folder)):
            time.sleep(slow_disk)  # a busy disk: the writer falls behind epochs of milliseconds
            trace.append(("folder", None))

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if Path(dst).parent == folder:
            trace.append(("named", Path(dst).name))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store = CheckpointCallback(folder, keep_last_k=1, background=background)
    trainer = make_trainer(run, [store, DiskKeepsUp(store)], epochs=4, log_fsync=policy)
    assert trainer.events is not None and trainer.events._file is not None
    log_fd = trainer.events._file.fileno()
    trainer.fit()
    monkeypatch.undo()

    text = (run / "events.jsonl").read_bytes()
    durable: set[str] = set()  # names made durable by a folder fsync so far
    named: set[str] = set()
    checked = 0
    for op, arg in trace:
        if op == "named":
            named.add(arg)
        elif op == "folder":
            durable |= named
        else:  # the log's fsync: every checkpoint line it makes durable names a durable file
            # The length is read after the fsync, and the other thread may be writing a line meanwhile: the
            # kernel grows the size a page at a time, so the length can end inside that line, which is not
            # one this fsync made durable (seen under load, with every line synced).
            synced = text[:arg]
            for line in synced[:synced.rfind(b"\n") + 1].decode().splitlines():
                if '"event": "checkpoint"' in line or '"event":"checkpoint"' in line:
                    checked += 1
                    name = Path(json.loads(line)["payload"]["path"]).name
                    assert name in durable, f"{name} committed by a synced line before a folder fsync named it"
    events = read_events(run / "events.jsonl")
    commits = {e["payload"]["epoch"] for e in events if e["event"] == "checkpoint"}
    removals = [e for e in events if e["event"] == "checkpoint_removed"]
    assert checked and removals and len(commits) >= 2
    folder_syncs = sum(op == "folder" for op, _ in trace)
    assert folder_syncs == len(commits) * (2 if policy == "every" else 1) + 1  # + the last removals', once
