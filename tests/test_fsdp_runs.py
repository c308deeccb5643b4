"""FSDP2 runs (``distributed.strategy: fsdp``) on real ``torchrun`` workers, gloo, 2 CPU ranks: a
1-process run of the quickstart's own net continues on 2 ranks (1 -> 2); an exception inside one
rank's forward ends both ranks within ``distributed.agreement_timeout_s``. (The clean and killed
runs, 2 -> 1 and ``model.pt``: tests/test_dcp_checkpoints.py, sharing its clean run.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean, config, events, fsmtrain, log, run_dir, weights

from fsmtrain.training.models import MLP

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

# four Linear blocks: auto shards apart the two holding >= 10% of the parameters
NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64, 64]}
QUICK_NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64]}  # the quickstart's own
BOUND_S = 20.0


def _cfg(folder: Path, epochs: int = 3, extra: tuple[dict[str, Any], ...] = (), net: dict[str, Any] = NET) -> Path:
    return config(folder, extra=extra, epochs=epochs, net_config=net, scheduler=None, scheduler_config={},
                  early_stopping={"enabled": False}, checkpoint={"enabled": True, "keep_last_k": 2},
                  distributed={"strategy": "fsdp", "agreement_timeout_s": BOUND_S})


class _Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def get(self, name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        if name not in self.done:
            getattr(self, f"_{name}")(self.root / name)
        return self.done[name]

    def _one_to_two(self, folder: Path) -> None:
        first = fsmtrain("train", str(_cfg(folder, epochs=2, net=QUICK_NET)), cwd=folder, timeout=200)  # its own net
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        path = run_dir(folder)
        self.done["one_to_two"] = (fsmtrain("resume", str(path), "--nproc", "2", "--set", "epochs=3", cwd=folder,
                                            timeout=200), path)

    def _forward_error(self, folder: Path) -> None:
        raise_ = {"target": "tests.fsdp_support.RaiseInForwardOnRank", "kwargs": {"rank": 1, "epoch": 1, "batch": 1}}
        done = fsmtrain("train", str(_cfg(folder, extra=(raise_,))), "--nproc", "2", cwd=folder, timeout=200)
        self.done["forward_error"] = (done, run_dir(folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("fsdp"))


def _audit_ok(path: Path) -> str:
    audit = fsmtrain("audit", str(path), cwd=path, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr
    return audit.stdout


@pytest.mark.timeout(600)
def test_a_one_process_run_continues_sharded_on_two_ranks(runs: _Runs) -> None:
    done, path = runs.get("one_to_two")
    clean(done)
    assert done.returncode == 0 and "COMPLETED after 3 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    assert "on 2 process(es); it ran on 1" in done.stdout
    assert "written by 1 rank(s): torch.distributed.checkpoint reshards it onto 2" in clean(done)
    assert "segments on 1, 2 ranks; sharded (FSDP2) in segment(s) 2)" in _audit_ok(path)
    MLP(**QUICK_NET).load_state_dict(weights(path / "model.pt"), strict=True)  # type: ignore[arg-type]


@pytest.mark.timeout(400)
def test_an_exception_inside_one_ranks_forward_ends_both_ranks_within_the_bound(runs: _Runs) -> None:
    done, path = runs.get("forward_error")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (failure,) = events(path / "events-rank1.jsonl", "exception")
    assert failure["payload"]["message"] == "injected in forward on rank 1"
    for name in ("events.jsonl", "events-rank1.jsonl"):
        last = log(path / name)[-1]
        assert last["event"] == "result", name
        assert last["ts"] - failure["ts"] < BOUND_S, (name, last["ts"] - failure["ts"])
    assert "rank 1 failed: ValueError: injected in forward on rank 1" in done.stdout
    assert not (path / "model.pt").exists()
