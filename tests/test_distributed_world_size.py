"""Resume on another world size: a run recorded on N ranks continues on M ranks
from its newest committed checkpoint (here, an epoch's).

- A 2-rank run killed (``kill -9`` of the launcher and its workers) at epoch 3 is resumed with
  ``fsmtrain resume RUN --nproc 1``: it completes, the audit accepts its segments of 2 and 1 ranks,
  and its weights equal, bitwise, a 1-rank run resumed from the same checkpoint (a copy of the run
  directory, resumed by ``train_seed`` in a plain process). The same holds 1 -> 2 (the reference:
  the copy resumed by ``torchrun --nproc-per-node 2``).
- From the resume on, each rank's batches are those a fresh M-rank run of the same config draws in
  those epochs (every rank records a digest of each batch it trains on).
- The ``resume`` event records the world size before and now.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean, config, env, events, finish, fsmtrain, run_dir, same_weights, torchrun_command

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

EPOCHS = 6
KILL_AT = 2  # epoch index: killed once the run reached epoch 3


def _config(folder: Path) -> Path:
    extra = [{"target": "tests.dist_support.SlowEpochs", "kwargs": {"seconds": 0.2, "marker": str(folder / "at")}},
             {"target": "tests.dist_support.RecordBatches", "kwargs": {"folder": str(folder / "batches")}}]
    return config(folder, extra=extra, epochs=EPOCHS, early_stopping={"enabled": False})


def _killed_at_epoch_3(folder: Path, nproc: int) -> Path:
    """Train on ``nproc`` ranks, kill every process (``kill -9``) once epoch index KILL_AT is done;
    the run dir."""
    cfg = _config(folder)
    (folder / "tmp").mkdir(exist_ok=True)  # the killed launcher's agent folder stays here, not in /tmp
    proc = subprocess.Popen([sys.executable, "-m", "fsmtrain", "train", str(cfg), "--nproc", str(nproc)], cwd=folder,
                            env=env(TMPDIR=str(folder / "tmp")), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    marker = folder / "at-rank0"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            reached = int(marker.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            reached = -1
        if reached >= KILL_AT:
            break
        time.sleep(0.05)
    # The agent starts each worker in a session of its own: the workers are killed by their pids
    # (each rank's marker holds its pid), then the launcher's group.
    for rank in range(nproc):
        pid = int((folder / f"at-rank{rank}").read_text().split()[1])
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found = run_dir(folder)
    assert not (found / "model.pt").exists()
    shutil.rmtree(folder / "batches")  # what the resumed run draws is what the test compares
    return found


def _batches(folder: Path) -> dict[tuple[int, int], list[str]]:
    """(rank, epoch index) -> the digests of the batches that rank trained on in that epoch."""
    out: dict[tuple[int, int], list[str]] = defaultdict(list)
    for path in sorted((folder / "batches").glob("batches-rank*.txt")):
        rank = int(path.stem.removeprefix("batches-rank"))
        for line in path.read_text().splitlines():
            epoch, digest = line.split()
            out[(rank, int(epoch))].append(digest)
    return dict(out)


_RESUME_IN_PROCESS = """
import sys
from pathlib import Path
from fsmtrain.app.config import load_config
from fsmtrain.app.job import train_seed
run_dir = Path(sys.argv[1])
run = train_seed(load_config(run_dir / "config.yaml", []), 0, run_dir, resume=True)
assert run.error is None, run.error
"""


class _Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Any] = {}

    def fresh(self, nproc: int) -> dict[tuple[int, int], list[str]]:
        """The batches a fresh ``nproc``-rank run of the config draws in every epoch."""
        key = f"fresh{nproc}"
        if key not in self.made:
            folder = self.root / key
            done = fsmtrain("train", str(_config(folder)), "--nproc", str(nproc), cwd=folder, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            self.made[key] = _batches(folder)
        batches: dict[tuple[int, int], list[str]] = self.made[key]
        return batches

    def resumed(self, before: int, after: int) -> tuple[Path, Path, subprocess.CompletedProcess[str], Any]:
        """A ``before``-rank run killed at epoch 3 and resumed on ``after`` ranks (A), a copy of it
        resumed on ``after`` ranks another way (B), and the batches A drew."""
        key = f"{before}to{after}"
        if key not in self.made:
            folder = self.root / key
            killed = _killed_at_epoch_3(folder, before)
            copy = self.root / f"{key}-reference"
            shutil.copytree(killed, copy)
            done = fsmtrain("resume", str(killed), "--nproc", str(after), cwd=folder, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            drawn = _batches(folder)
            shutil.rmtree(folder / "batches")  # the reference's config records into the same folder
            if after == 1:
                cmd = [sys.executable, "-c", _RESUME_IN_PROCESS, str(copy)]
            else:
                cmd = torchrun_command(self.root, "--standalone", "--nproc-per-node", str(after), "-m", "fsmtrain",
                                       "resume", str(copy))
            ref = subprocess.Popen(cmd, cwd=self.root, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
            out, err = finish(ref, 300)
            assert ref.returncode == 0, out[-3000:] + err[-3000:]
            self.made[key] = (killed, copy, done, drawn)
        made: tuple[Path, Path, subprocess.CompletedProcess[str], Any] = self.made[key]
        return made


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("world_size"))


def _check(runs: _Runs, before: int, after: int) -> None:
    resumed, reference, done, drawn = runs.resumed(before, after)
    clean(done)
    assert f"COMPLETED after {EPOCHS} epoch(s)" in done.stdout
    assert f"on {after} process(es); it ran on {before}" in done.stdout
    (resume,) = events(resumed / "events.jsonl", "resume")
    assert (resume["payload"]["world_size_before"], resume["payload"]["world_size"]) == (before, after)
    audit = fsmtrain("audit", str(resumed), cwd=resumed, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr
    assert f"segments on {before}, {after} ranks" in audit.stdout
    same_weights(reference / "model.pt", resumed / "model.pt")
    # From the resume on, the batches of a fresh run on `after` ranks, rank by rank, epoch by epoch.
    start = resume["payload"]["next_epoch"]
    fresh = runs.fresh(after)
    later = {k: v for k, v in fresh.items() if k[1] >= start}
    assert later and drawn == later


@pytest.mark.timeout(1200)
def test_a_two_rank_run_continues_on_one(runs: _Runs) -> None:
    _check(runs, 2, 1)


@pytest.mark.timeout(1200)
def test_a_one_rank_run_continues_on_two(runs: _Runs) -> None:
    _check(runs, 1, 2)
