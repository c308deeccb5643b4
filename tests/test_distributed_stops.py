"""Multi-process runs that stop on one rank's account pass ``fsmtrain audit``, and one rank's
exception ends every rank at once, each log naming it.

When every rank's early stopping asks in the same epoch, the ranks agree on rank 0's request and
rank 1 logs it in place of its own: the audit reads that as the agreed stop, not as an override of a
request never accepted. The same for NaN on one rank (it reaches every rank's losses through DDP and
the summed metrics). An exception on rank 1 is named as rank 1's, in every log and on the console,
not as rank 0's gloo error ("Connection closed by peer").

Each case is one real ``fsmtrain train --nproc 2`` (gloo, two CPU processes), run once per module.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean, config, events, fsmtrain, log, run_dir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

_CASES: dict[str, dict[str, Any]] = {
    # lr 0: the val loss never improves, so every rank's early stopping asks at epoch index 1
    "early_stop": {"optimizer_config": {"lr": 0.0}, "early_stopping": {"enabled": True, "patience": 1}},
    "nan": {"extra": [{"target": "tests.dist_support.NaNWeightsOnRank", "kwargs": {"rank": 1, "epoch": 1}}]},
    "error": {"extra": [{"target": "tests.dist_support.RaiseOnRank", "kwargs": {"rank": 1, "epoch": 1}}]},
}


class _Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[subprocess.CompletedProcess[str], float, Path]] = {}

    def get(self, case: str) -> tuple[subprocess.CompletedProcess[str], float, Path]:
        if case not in self.done:
            folder = self.root / case
            cfg = config(folder, **_CASES[case])
            start = time.monotonic()
            done = fsmtrain("train", str(cfg), "--nproc", "2", cwd=folder, timeout=200)
            self.done[case] = (done, time.monotonic() - start, run_dir(folder))
        return self.done[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("stops"))


def _audit(run: Path) -> subprocess.CompletedProcess[str]:
    return fsmtrain("audit", str(run), cwd=run, timeout=60)


def _last(path: Path) -> dict[str, Any]:
    return log(path)[-1]


def _replays(run: Path) -> None:
    """Each rank's log replays as it ran: the other rank's part comes back through the agreement."""
    for name in ("events.jsonl", "events-rank1.jsonl"):
        done = fsmtrain("replay", str(run / name), cwd=run, timeout=120)
        assert done.returncode == 0, name + "\n" + done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.timeout(400)
def test_an_agreed_early_stop_passes_the_audit(runs: _Runs) -> None:
    done, _, run = runs.get("early_stop")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    clean(done)
    told = [r["payload"] for r in events(run / "events-rank1.jsonl", "stop_request")]
    # rank 1's own request, then rank 0's agreed one in its place: the case the audit refused
    assert [(p["reason"], p.get("rank"), p.get("overrides")) for p in told] == [
        ("early_stop", None, None), ("early_stop", 0, "early_stop")]
    audit = _audit(run)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "2 ranks agree" in audit.stdout
    assert "ended: early_stop from rank 0 (EarlyStoppingCallback: val_loss did not improve" in audit.stdout
    _replays(run)


@pytest.mark.timeout(400)
def test_nan_on_one_rank_passes_the_audit(runs: _Runs) -> None:
    done, _, run = runs.get("nan")
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    clean(done)
    # Rank 1's weights went NaN; DDP carried it to rank 0 a batch later: the stop names rank 1.
    told = [r["payload"] for r in events(run / "events.jsonl", "stop_request") if r["payload"]["accepted"]]
    assert (told[-1]["reason"], told[-1].get("rank")) == ("nan", 1), told
    for name in ("events.jsonl", "events-rank1.jsonl"):
        result = _last(run / name)["payload"]
        assert result["stop_reason"] == "nan" and "first on rank 1" in result["stop_message"], (name, result)
    assert "first on rank 1" in done.stdout and "from rank 0" not in done.stdout, done.stdout[-3000:]
    audit = _audit(run)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "ended: nan from rank 1 (NaNDetectionCallback" in audit.stdout
    _replays(run)


@pytest.mark.timeout(400)
def test_an_error_on_one_rank_ends_every_rank_promptly_and_names_it(runs: _Runs) -> None:
    done, seconds, run = runs.get("error")
    out = clean(done)
    assert done.returncode == 1, out[-4000:]  # rank 1's status: the first failure
    ends = {name: _last(run / name) for name in ("events.jsonl", "events-rank1.jsonl")}
    for name, last in ends.items():
        assert last["event"] == "result", name
        assert last["payload"]["stop_source"] == "RaiseOnRank.on_train_step_end on rank 1", name
        assert last["payload"]["stop_message"] == "ValueError: injected on rank 1 at epoch 1, batch 1", name
    assert [ends[n]["payload"]["stop_reason"] for n in ends] == ["interrupted", "error"]
    (failure,) = events(run / "events-rank1.jsonl", "exception")
    (stopped,) = events(run / "events.jsonl", "exception")
    assert stopped["payload"]["type"] == "RankFailed" and stopped["payload"]["failed_rank"] == 1
    # Both ranks ended within 30 s of the exception: no rank waited for distributed.timeout_s.
    assert ends["events.jsonl"]["ts"] - failure["ts"] < 30, (failure["ts"], ends["events.jsonl"]["ts"])
    assert seconds < 150
    # The console (rank 0's) names rank 1's own exception, not the collective's symptom.
    assert "rank 1 failed: ValueError: injected on rank 1 at epoch 1, batch 1" in done.stdout
    assert "Connection closed" not in done.stdout
    audit = _audit(run)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert ("ended: rank 1 failed (ValueError: injected on rank 1 at epoch 1, batch 1, in "
            "RaiseOnRank.on_train_step_end on rank 1); every other rank was interrupted") in audit.stdout
    # Rank 0's log replays as it ran: the failure comes back from the board, the broken collective
    # at the same step. (Rank 1's own exception, raised inside a batch, is a replay limit of any run.)
    replay = fsmtrain("replay", str(run / "events.jsonl"), cwd=run, timeout=120)
    assert replay.returncode == 0 and "replay reproduces the recorded trace" in replay.stdout, replay.stdout[-3000:]
