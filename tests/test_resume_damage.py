"""Resume verifies before it trusts, and continue means continue.

- A damaged newest checkpoint (truncated, a flipped byte, another file's bytes in its place) is
  announced once (the file, both digests, the checkpoint the run continues from), moved to
  ``checkpoints/damaged/`` and logged as ``checkpoint_damaged``; the run resumes from the older
  state the store always keeps, even with ``keep_last_k: 1``, ends with the weights of a run that
  was never damaged, and passes the audit.
- A run with no committed checkpoint (killed before its first one, or never started) is started
  over in its own run directory: a ``restart`` event, one run dir, and the audit accepts it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import torch
from core_helpers import tiny_model, tiny_task
from resume_harness import REPO, env, forked, same_weights
from torch import nn

from fsmtrain import Trainer
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core import ledger
from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file
from fsmtrain.training import checkpoint_file
from fsmtrain.training.checkpoint import sha256_of
from fsmtrain.training.resume import find_resumption

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


def _trainer(run_dir: Path, epochs: int, keep: int, **kw: Any) -> Trainer:
    torch.set_num_threads(1)
    model = tiny_model(0)
    train, val = tiny_task(0)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val, max_epochs=epochs,
                   # written before each epoch ends, so every epoch's state reaches the disk and the older one
                   # is epoch 2 (a background writer slower than these epochs leaves states out, by design)
                   callbacks=[CheckpointCallback(run_dir / "checkpoints", keep_last_k=keep, background=False)],
                   run_dir=run_dir,
                   console_level="warning", default_callbacks=False, **kw)


def _damage(path: Path, way: str, other: Path) -> None:
    """Damage ``path`` in place (its inode, so every hard link of it too)."""
    if way == "truncate":
        os.truncate(path, 1000)
    elif way == "flip":
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x01]))
    else:  # another (valid) checkpoint's bytes written over it
        data = other.read_bytes()
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(data)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[int, Path]]:
    """Once for the module: the weights of an undamaged 4-epoch run, and a 3-epoch run per keep_last_k."""
    root = tmp_path_factory.mktemp("damage")
    full = _trainer(root / "full", 4, 1)
    full.fit()
    parts = {}
    for keep in (1, 3):
        parts[keep] = root / f"part-{keep}"
        _trainer(parts[keep], 3, keep).fit()
    return {k: v.clone() for k, v in full.model.state_dict().items()}, parts


def _copy_run(source: Path, target: Path) -> None:
    """A copy of a run dir that keeps its hard links (latest.pt, best.pt and epoch_<n>.pt: one file)."""
    inodes: dict[int, Path] = {}
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        first = inodes.setdefault(path.stat().st_ino, dest)
        if first == dest:
            shutil.copy2(path, dest)
        else:
            os.link(first, dest)


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("way", ["truncate", "flip", "replace"])
def test_a_damaged_newest_checkpoint_is_kept_aside_and_the_run_resumes_from_the_older_one(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], trained: tuple[dict[str, torch.Tensor], dict[int, Path]],
        way: str, keep: int) -> None:
    """A damaged latest.pt is moved aside and announced, never deleted, and with keep_last_k: 1 the
    older state is still there to resume from."""
    undamaged, parts = trained
    run = tmp_path / "part"
    _copy_run(parts[keep], run)
    ck = run / "checkpoints"
    latest = ck / "latest.pt"
    committed = sha256_of(latest)
    names = sorted(p.name for p in ck.iterdir() if p.stat().st_ino == latest.stat().st_ino)
    assert "epoch_3.pt" in names and (ck / "epoch_2.pt").is_file()  # the older state, kept whatever keep_last_k
    _damage(latest, way, ck / "epoch_2.pt")
    found = sha256_of(latest)
    assert found != committed
    capfd.readouterr()

    resumed = _trainer(run, 4, keep, resume_from="latest")
    resumed.fit()

    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "checkpoint_damaged" in line]
    assert len(said) == 1, err  # one warning for the state, whatever its number of names
    assert "checkpoint checkpoints/latest.pt (and " in said[0] and committed in said[0] and found in said[0]
    assert "the run continues from checkpoints/epoch_2.pt (epoch 2)" in said[0]
    events = read_events(run / "events.jsonl")
    damaged = [e["payload"] for e in events if e["event"] == "checkpoint_damaged"]
    assert len(damaged) == 1 and sorted(Path(p).name for p in damaged[0]["paths"]) == names
    assert damaged[0]["committed_sha256"] == committed and set(damaged[0]["found_sha256"]) == {found}
    assert sorted(damaged[0]["moved_to"]) == sorted(f"checkpoints/damaged/{n}" for n in names)
    assert sorted(p.name for p in (ck / "damaged").iterdir()) == names  # kept, not deleted
    assert all(sha256_of(ck / "damaged" / n) == found for n in names)
    resume = next(e["payload"] for e in events if e["event"] == "resume")
    assert resume["checkpoint"] == "checkpoints/epoch_2.pt" and resume["removed"] == []
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(undamaged[name], value)  # the epoch redone from the older state ends where it did
    report = audit_file(run / "events.jsonl")
    assert report.ok and not report.warnings, report.render()
    assert report.explanation.checkpoints_damaged == 1


def test_a_missing_newest_state_is_said_on_the_console_and_in_the_resume_event(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], trained: tuple[dict[str, torch.Tensor], dict[int, Path]]
) -> None:
    """Every name of the newest committed state deleted: the resume names what is missing and the
    epoch it falls back to, on the console and in its ``resume`` event."""
    undamaged, parts = trained
    run = tmp_path / "part"
    _copy_run(parts[1], run)
    ck = run / "checkpoints"
    newest = (ck / "latest.pt").stat().st_ino
    gone = sorted(p.name for p in ck.iterdir() if p.is_file() and p.stat().st_ino == newest)
    assert "epoch_3.pt" in gone
    for name in gone:
        (ck / name).unlink()
    before = audit_file(run / "events.jsonl").render()
    assert "the newest committed state (epoch 3: " in before and "is missing" in before, before
    capfd.readouterr()

    resumed = _trainer(run, 4, 1, resume_from="latest")
    resumed.fit()

    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "is missing" in line]
    assert len(said) == 1 and "checkpoints/epoch_3.pt" in said[0], err
    assert "falls back to checkpoints/epoch_2.pt (epoch 2)" in said[0]
    resume = next(e["payload"] for e in read_events(run / "events.jsonl") if e["event"] == "resume")
    assert sorted(Path(p).name for p in resume["missing"]) == gone
    assert resume["missing_epoch"] == 2 and resume["falls_back_to_epoch"] == 1 == resume["checkpoint_epoch"]
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(undamaged[name], value)


@pytest.mark.parametrize("stray", ["epoch_9.pt", "step_999.pt"])
def test_a_stray_file_in_checkpoints_is_set_aside_and_said_not_deleted(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], trained: tuple[dict[str, torch.Tensor], dict[int, Path]],
        stray: str) -> None:
    """A file of ours the log never committed is moved to ``checkpoints/uncommitted/``, said on the
    console and in the ``resume`` event; a temp file a write left is removed."""
    _, parts = trained
    run = tmp_path / "part"
    _copy_run(parts[3], run)
    ck = run / "checkpoints"
    (ck / stray).write_bytes(b"planted")
    (ck / ".latest.pt.1.2.tmp").write_bytes(b"a write cut short")
    before = audit_file(run / "events.jsonl").render()
    assert f"checkpoints/{stray} is in the checkpoint folder, but the log does not commit it" in before, before
    capfd.readouterr()

    _trainer(run, 4, 3, resume_from="latest").fit()

    err = capfd.readouterr().err
    assert f"checkpoints/uncommitted/{stray}" in err and "never committed" in err, err
    assert (ck / "uncommitted" / stray).read_bytes() == b"planted"
    resume = next(e["payload"] for e in read_events(run / "events.jsonl") if e["event"] == "resume")
    assert resume["uncommitted_moved_to"] == [f"checkpoints/uncommitted/{stray}"]
    assert resume["removed"] == ["checkpoints/.latest.pt.1.2.tmp", f"checkpoints/{stray}"]  # out of the folder


class _CountingHash:
    """``hashlib.sha256`` that records how many bytes each hash was fed."""

    def __init__(self, fed: list[int], data: bytes = b"") -> None:
        self.inner = hashlib.sha256(data)
        self.fed = fed
        fed.append(len(data))
        self.at = len(fed) - 1

    def update(self, data: bytes) -> None:
        self.fed[self.at] += memoryview(data).nbytes
        self.inner.update(data)

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


def test_resume_hashes_each_committed_file_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: tuple[dict[str, torch.Tensor], dict[int, Path]]
) -> None:
    """One hash pass per committed file (per inode: hard links are one file), the loaded one included."""
    _, parts = trained
    run = tmp_path / "part"
    _copy_run(parts[3], run)
    fed: list[int] = []
    counting = types.SimpleNamespace(sha256=lambda data=b"": _CountingHash(fed, data))
    for hashing in (checkpoint_file, ledger):  # a file is hashed as it loads, and by sha256_of
        monkeypatch.setattr(hashing, "hashlib", counting)
    smallest = min(p.stat().st_size for p in (run / "checkpoints").glob("*.pt"))

    found = find_resumption(run)

    assert int(found.state["epoch"]) == 3  # epoch_3.pt: its content counts from 1, as its name
    inodes = {(run / s).stat().st_ino for s in found.tail.ledger.live}
    assert len([n for n in fed if n >= smallest]) == len(inodes), fed


def test_a_checkpoint_loads_without_holding_its_bytes_in_memory(tmp_path: Path) -> None:
    """The load streams the hash and maps the file: Python never holds the file's bytes whole."""
    path = tmp_path / "checkpoints" / "big.pt"
    path.parent.mkdir()
    digest = checkpoint_file.save_state(path, {"format": checkpoint_file.FORMAT_VERSION,
                                               "w": torch.zeros(16 << 20, dtype=torch.uint8)})
    tracemalloc.start()
    try:
        state = checkpoint_file.load_checkpoint(path, expected_sha256=digest)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert state["w"].numel() == 16 << 20
    assert peak < (16 << 20) // 4, peak  # a few read chunks, never the file


def test_a_trainer_resumed_with_nothing_committed_starts_over_in_place(tmp_path: Path) -> None:
    """resume_from="latest" on a run that committed no checkpoint starts it over in its own folder."""
    run = tmp_path / "run"
    torch.set_num_threads(1)
    model = tiny_model(0)
    train, val = tiny_task(0)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val, max_epochs=2,
            run_dir=run, console_level="error", default_callbacks=False).fit()  # no checkpoints
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".latest.pt.1234.tmp").write_bytes(b"a write cut short")
    again = _trainer(run, 2, 1, resume_from="latest")
    assert again.restart is not None and again.resumption is None
    again.fit()
    events = read_events(run / "events.jsonl")
    restarts = [e for e in events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["payload"]["from_epoch"] == 0
    assert restarts[0]["payload"]["removed"] == ["checkpoints/.latest.pt.1234.tmp"]
    starts = [e for e in events if e["event"] == "run_start"]
    assert len(starts) == 2 and starts[1]["payload"]["start_epoch"] == 0
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render()
    assert report.explanation.restarts == 1 and report.explanation.epochs_completed == 2
    assert report.explanation.segments == 2


# --- the command line, with real processes -------------------------------------------------------
def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return forked_cli.run(list(args), cwd, env(), timeout=timeout)


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


FAST = ("epochs=3", "wandb.enabled=false", "checkpoint.keep_last_k=1")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsmtrain_resume_of_a_flipped_latest_with_keep_last_k_1_resumes_and_the_audit_passes(tmp_path: Path) -> None:
    """`fsmtrain resume` after one flipped byte in latest.pt (keep_last_k: 1) resumes from the older state."""
    done = _cli("train", str(QUICK), *_sets(*FAST), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    latest = tmp_path / RUN / "checkpoints" / "latest.pt"
    committed = sha256_of(latest)
    # The fallback is the newest other epoch file: epoch 2's, unless the background writer, still busy
    # with epoch 1 on a loaded machine, left epoch 2's state out (it says so; the folder shows it).
    older = [p for p in latest.parent.glob("epoch_*.pt") if not p.samefile(latest)]
    assert len(older) == 1, sorted(p.name for p in latest.parent.iterdir())
    fallback = int(older[0].stem.split("_")[1])
    _damage(latest, "flip", latest)
    again = _cli("resume", str(RUN), "--set", "epochs=4", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    said = [line for line in again.stderr.splitlines() if "checkpoint_damaged" in line]
    assert len(said) == 1 and committed in said[0], said
    assert f"continues from checkpoints/{older[0].name} (epoch {fallback})" in said[0], said
    assert (tmp_path / RUN / "checkpoints" / "damaged" / "latest.pt").is_file()
    audit = _cli("audit", str(RUN), cwd=tmp_path)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "1 damaged state(s) moved to damaged/" in audit.stdout
    replay = _cli("replay", str(RUN), cwd=tmp_path)
    assert replay.returncode == 0, replay.stdout + replay.stderr


def _kill_before_the_first_checkpoint(tmp_path: Path, config: Path) -> Path:
    """Start `fsmtrain train` and SIGKILL it once its run has started, before anything is committed
    (the config's first epoch waits a second: a window no loaded machine misses)."""
    proc = forked("train", str(config), *_sets("wandb.enabled=false", "epochs=3"), cwd=tmp_path)
    log = tmp_path / RUN / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (log.is_file() and b'"run_start"' in log.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()[-3000:]
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert b'"event":"checkpoint"' not in log.read_bytes()
    return tmp_path / RUN


def _held_config(tmp_path: Path) -> Path:
    """The quickstart with a callback that holds the first epoch of each process a second."""
    config = tmp_path / "held.yaml"
    config.write_text(QUICK.read_text() + "\ncallbacks:\n  extra: [{target: resume_support.HoldFirstEpoch}]\n")
    return config


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("route", ["resume", "train --resume"])
def test_a_run_killed_before_its_first_checkpoint_starts_over_in_its_own_run_dir(tmp_path: Path, route: str) -> None:
    """Every resume route starts such a run over in its own run dir, not in a new `…-seed0-2`."""
    config = _held_config(tmp_path)
    ref = tmp_path / "reference"
    ref.mkdir()
    done = _cli("train", str(config), *_sets("wandb.enabled=false", "epochs=3"), cwd=ref)
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    run = _kill_before_the_first_checkpoint(work, config)
    args = ["resume", str(RUN)] if route == "resume" else ["train", str(config), "--resume"]
    again = _cli(*args, *_sets("wandb.enabled=false", "epochs=3"), cwd=work)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "starts over from epoch 0, in the same run directory" in again.stderr
    assert sorted(p.name for p in (work / RUN).parent.iterdir()) == [RUN.name]  # no -2
    assert same_weights(run / "model.pt", ref / RUN / "model.pt")
    events = read_events(run / "events.jsonl")
    assert [e["event"] for e in events].count("restart") == 1
    audit = _cli("audit", str(RUN), cwd=work)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "1 restart(s) from epoch 1" in audit.stdout
    replay = _cli("replay", str(RUN), cwd=work)
    assert replay.returncode == 0, replay.stdout + replay.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_of_a_run_that_never_started_starts_it_in_place(tmp_path: Path) -> None:
    """`train --resume` (and `resume`) of a run dir holding only .lock and an empty events.jsonl
    (killed before its first line) starts the run there."""
    run = tmp_path / RUN
    run.mkdir(parents=True)
    (run / ".lock").write_bytes(b"")
    (run / "events.jsonl").write_bytes(b"")
    done = _cli("train", str(QUICK), *_sets("epochs=1", "wandb.enabled=false"), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(p.name for p in run.parent.iterdir()) == [RUN.name]
    first = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert first["event"] == "run_start" and first["seq"] == 0
    assert _cli("audit", str(RUN), cwd=tmp_path).returncode == 0

    other = tmp_path / "runs" / "quickstart" / "again-seed0"
    other.mkdir()
    (other / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    (other / ".lock").write_bytes(b"")
    (other / "events.jsonl").write_bytes(b'{"seq": 0, "event": "run_st')  # a first line cut by the kill
    again = _cli("resume", str(other), cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "starts over from epoch 0" in again.stderr
    assert _cli("audit", str(other), cwd=tmp_path).returncode == 0
