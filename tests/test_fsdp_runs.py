"""FSDP2 runs (``distributed.strategy: fsdp``) on real ``torchrun`` workers, gloo, 2 CPU ranks: a
model of several blocks trains sharded and audits; ``model.pt`` is the gathered weights and loads
into the plain model; a run killed (SIGKILL) mid-epoch resumes on 2 ranks bitwise equal to an
uninterrupted one, and on 1 rank (2 -> 1); a 1-process run continues on 2 ranks (1 -> 2); an
exception inside one rank's forward ends both ranks within ``distributed.agreement_timeout_s``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean, config, events, fsmtrain, log, run_dir, same_weights, weights
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsmtrain.training.models import MLP

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

# four Linear blocks: auto shards apart the two holding >= 10% of the parameters
NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64, 64]}
BOUND_S = 20.0


def _cfg(folder: Path, epochs: int = 3, extra: tuple[dict[str, Any], ...] = ()) -> Path:
    return config(folder, extra=extra, epochs=epochs, net_config=NET, scheduler=None, scheduler_config={},
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

    def _clean(self, folder: Path) -> None:
        done = fsmtrain("train", str(_cfg(folder)), "--nproc", "2", cwd=folder, timeout=200)
        self.done["clean"] = (done, run_dir(folder))

    def _killed(self, folder: Path) -> None:
        kill = {"target": "tests.fsdp_support.KillOnRank",
                "kwargs": {"rank": 1, "epoch": 1, "batch": 1, "marker": str(folder / "killed")}}
        first = fsmtrain("train", str(_cfg(folder, extra=(kill,))), "--nproc", "2", cwd=folder, timeout=200)
        assert first.returncode != 0 and (folder / "killed").exists(), first.stdout[-3000:] + first.stderr[-3000:]
        path = run_dir(folder)
        copy = self.root / "killed-copy"
        shutil.copytree(path, copy)
        self.done["killed"] = (fsmtrain("resume", str(path), "--nproc", "2", cwd=folder, timeout=200), path)
        self.done["two_to_one"] = (fsmtrain("resume", str(copy), "--nproc", "1", cwd=folder, timeout=200), copy)

    _two_to_one = _killed

    def _one_to_two(self, folder: Path) -> None:
        first = fsmtrain("train", str(_cfg(folder, epochs=2)), cwd=folder, timeout=200)
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


@pytest.mark.timeout(400)
def test_a_sharded_run_of_several_blocks_trains_audits_and_writes_the_gathered_weights(runs: _Runs) -> None:
    done, path = runs.get("clean")
    out = clean(done)
    assert done.returncode == 0 and "COMPLETED after 3 epoch(s)" in done.stdout, out[-4000:]
    assert "FSDP2 over 2 ranks: 3 unit(s) sharded (net.2, net.4, (root))" in out
    for name in ("events.jsonl", "events-rank1.jsonl"):
        (start,) = events(path / name, "run_start")
        extras = start["payload"]
        assert extras["strategy"] == "fsdp" and extras["sharding"]["units"] == ["net.2", "net.4", ""], extras
        total = extras["sharding"]["bytes_total"]
        assert 0 < extras["sharding"]["bytes_per_rank"] < total, extras["sharding"]
    assert "ranks: 2 ranks agree" in (audit := _audit_ok(path)) and "sharded (FSDP2) in segment(s) 1)" in audit
    # model.pt: a plain module's state dict, strict, equal to the gathered state of the last checkpoint
    plain = MLP(**NET)  # type: ignore[arg-type]
    plain.load_state_dict(weights(path / "model.pt"), strict=True)
    assert torch.load(path / "checkpoints" / "latest" / "rank_0.pt", weights_only=True)["epoch"] == 3  # from 1
    dcp_to_torch_save(path / "checkpoints" / "latest", path / "latest-whole.pt")  # the shards, put together
    last = torch.load(path / "latest-whole.pt", weights_only=True)
    for k, v in weights(path / "model.pt").items():
        assert torch.equal(v, last["model"][k]), k
    assert set(last["optimizer"]["state"]) == {k for k in plain.state_dict()}  # keyed by name, whole
    assert all(v.shape == plain.state_dict()[k].shape for k, v in last["model"].items())


@pytest.mark.timeout(600)
def test_a_killed_sharded_run_resumes_on_two_ranks_bitwise(runs: _Runs) -> None:
    done, path = runs.get("killed")
    clean(done)
    assert done.returncode == 0 and "COMPLETED after 3 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    same_weights(runs.get("clean")[1] / "model.pt", path / "model.pt")
    _audit_ok(path)


@pytest.mark.timeout(600)
def test_a_sharded_run_reshards_two_to_one(runs: _Runs) -> None:
    done, path = runs.get("two_to_one")
    assert done.returncode == 0 and "COMPLETED after 3 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    assert "on 1 process(es); it ran on 2" in done.stdout
    assert "written by 2 rank(s): torch.distributed.checkpoint reshards it onto 1" in clean(done)
    (resume,) = events(path / "events.jsonl", "resume")
    assert (resume["payload"]["world_size_before"], resume["payload"]["world_size"]) == (2, 1)
    assert "segments on 2, 1 ranks; sharded (FSDP2) in segment(s) 1)" in _audit_ok(path)
    MLP(**NET).load_state_dict(weights(path / "model.pt"), strict=True)  # type: ignore[arg-type]


@pytest.mark.timeout(600)
def test_a_one_process_run_continues_sharded_on_two_ranks(runs: _Runs) -> None:
    done, path = runs.get("one_to_two")
    clean(done)
    assert done.returncode == 0 and "COMPLETED after 3 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    assert "on 2 process(es); it ran on 1" in done.stdout
    assert "written by 1 rank(s): torch.distributed.checkpoint reshards it onto 2" in clean(done)
    assert "segments on 1, 2 ranks; sharded (FSDP2) in segment(s) 2)" in _audit_ok(path)
    MLP(**NET).load_state_dict(weights(path / "model.pt"), strict=True)  # type: ignore[arg-type]


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
