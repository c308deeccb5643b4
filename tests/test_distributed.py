"""Multi-process training on real ``torchrun`` (gloo, 2 CPU processes): one run, several ranks, the
same transitions at the same time on every rank, and no hang when one rank alone decides to stop."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import torch
import yaml
from dist_runs import torchrun_command

from fsmtrain.core.consensus import agreement_points, decide, proposal_of
from fsmtrain.core.context import StopRequest
from fsmtrain.core.ledger import read_ledger
from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.stop import StopReason

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(WANDB_MODE="offline", OMP_NUM_THREADS="1", WANDB_SILENT="true")
    env.pop("WANDB_SERVICE", None)
    return env


def _config(tmp: Path, *, extra: Sequence[dict[str, Any]] = (), **changes: Any) -> Path:
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg.update(epochs=5, wandb={"enabled": False})
    cfg["data_config"]["n_samples"] = 512
    cfg["scheduler_config"]["T_max"] = 5
    cfg["callbacks"] = {"extra": list(extra)}
    cfg.update(changes)
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fsmtrain(*args: str, cwd: Path, timeout: float = 150, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**_env(), **extra_env}
    return forked_cli.run(list(args), cwd, env, timeout, stop=signal.SIGTERM)  # see tests/forked_cli.py


def _torchrun(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    cmd = torchrun_command(cwd, "--standalone", "--nproc-per-node", "2", "-m", "fsmtrain", *args)
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


def _run_dir(tmp: Path) -> Path:
    (found,) = [p.parent for p in (tmp / "runs").rglob("events.jsonl")]
    return found


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ending(path: Path) -> tuple[str, str, int, int]:
    """(from, reason, epoch, global_step) of the move into train_end."""
    (end,) = [r for r in _log(path) if r["event"] == "transition" and r["to"] == "train_end"]
    return end["from"], end["payload"]["reason"], end["epoch"], end["global_step"]


def _moves(path: Path) -> list[tuple[str, str, str, int]]:
    return [(r["trigger"], r["from"], r["to"], r["epoch"]) for r in _log(path)
            if r["event"] == "transition" and r["from"] != r["to"]]


def _audit_ok(run_dir: Path, cwd: Path) -> str:
    done = _fsmtrain("audit", str(run_dir), cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks agree" in done.stdout
    return done.stdout


# --- the agreement rule, without processes ------------------------------------------------------
def test_verdict_prefers_precedence_then_epoch_phase_rank() -> None:
    early = StopRequest(StopReason.EARLY_STOP, "es", "", False, 3, 0, Phase.EPOCH_END)
    nan = StopRequest(StopReason.NAN, "nan", "", False, 3, 0, Phase.EPOCH_END)
    earlier = StopRequest(StopReason.EARLY_STOP, "es", "", False, 2, 0, Phase.EPOCH_END)
    assert decide([proposal_of(early, None), proposal_of(nan, None)]).stop_rank == 1  # NaN outranks
    assert decide([proposal_of(early, None), proposal_of(earlier, None)]).stop_rank == 1  # first by epoch
    assert decide([proposal_of(early, None), proposal_of(early, None)]).stop_rank == 0  # then by rank
    verdict = decide([proposal_of(None, None), proposal_of(None, signal.SIGTERM)])
    assert (verdict.signal, verdict.signal_rank, verdict.reason) == (signal.SIGTERM, 1, None)


def test_agreement_points_come_from_the_table() -> None:
    # val: resume_train and cut_epoch (after a validation inside an epoch) read can_continue
    assert agreement_points(False) == {Phase.TRAIN_BEGIN, Phase.VAL, Phase.EPOCH_END}
    assert agreement_points(True) == {Phase.TRAIN_BEGIN, Phase.EPOCH_BEGIN, Phase.TRAIN_STEP, Phase.VAL,
                                      Phase.EPOCH_END}


# --- real torchrun ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_train_the_quickstart_as_one_run(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg.update(epochs=4)
    save = {"target": "tests.dist_support.SaveFinalWeights", "kwargs": {"folder": str(weights)}}
    cfg["callbacks"] = {"extra": [save]}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(cfg))
    done = _torchrun("train", "q.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("seed 0: COMPLETED") == 1  # one console: rank 0's
    run_dir = _run_dir(tmp_path)
    rank0, rank1 = (torch.load(weights / f"weights-rank{r}.pt") for r in (0, 1))
    final = torch.load(run_dir / "model.pt")
    assert rank0.keys() == rank1.keys() == final.keys()
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
        assert torch.equal(rank0[k], final[k]), k
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == [  # no .lock once it ended
        "config.yaml", "events-rank1.jsonl", "events.jsonl", "lifecycle.mmd", "metrics.csv", "model.pt"]
    assert len(list((tmp_path / "runs").rglob("config.yaml"))) == 1
    # Rank 0 alone wrote them, and the folder holds what its log commits: the two newest periodic
    # files written (epoch 3's state may be left out behind a slow write: checkpoint_skipped says so).
    files = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert files == sorted(Path(f).name for f in read_ledger(run_dir / "events.jsonl").live), files
    skipped = {r["payload"]["epoch"] + 1 for r in _log(run_dir / "events.jsonl")  # files count from 1
               if r["event"] == "checkpoint_skipped"}
    periodic = sorted(e for e in (1, 2, 3) if e not in skipped)[-1:]
    assert files == ["best.pt", *(f"epoch_{e}.pt" for e in periodic), "epoch_4.pt", "latest.pt"], (files, skipped)
    assert not any(r["event"].startswith("checkpoint") for r in _log(run_dir / "events-rank1.jsonl"))
    starts = [next(r for r in _log(run_dir / name) if r["event"] == "run_start")["payload"]
              for name in ("events.jsonl", "events-rank1.jsonl")]
    assert [(s["rank"], s["world_size"]) for s in starts] == [(0, 2), (1, 2)]
    assert _moves(run_dir / "events.jsonl") == _moves(run_dir / "events-rank1.jsonl")
    _audit_ok(run_dir, tmp_path)
    diagram = _fsmtrain("diagram", "--run", str(run_dir), cwd=tmp_path, timeout=60)
    assert "on 2 ranks" in diagram.stdout
    _audit_names_missing_and_stray_rank_logs(run_dir, tmp_path)


def _audit_names_missing_and_stray_rank_logs(run_dir: Path, tmp: Path) -> None:
    """A copy of the run without rank 1's log, or with a log of a rank beyond the world size, fails
    the audit of the run directory; rank 0's log alone is audited as that log only."""
    missing, stray = tmp / "missing", tmp / "stray"
    for copy in (missing, stray):
        shutil.copytree(run_dir, copy)
    (missing / "events-rank1.jsonl").unlink()
    shutil.copy(run_dir / "events-rank1.jsonl", stray / "events-rank5.jsonl")
    done = _fsmtrain("audit", str(missing), "--strict", cwd=tmp, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run_start says world_size 2; events-rank1.jsonl is missing" in done.stdout
    done = _fsmtrain("audit", str(stray), cwd=tmp, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run_start says world_size 2; events-rank5.jsonl is beyond it (no such rank)" in done.stdout
    done = _fsmtrain("audit", str(missing / "events.jsonl"), "--strict", cwd=tmp, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 of 2: this log only" in done.stdout and "== ranks" not in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("callback", "kwargs", "reason", "code"), [
    ("NaNLossOnRank", {"rank": 1, "epoch": 2}, "nan", 3),
    ("StopOnRank", {"rank": 0, "epoch": 1, "reason": "early_stop"}, "early_stop", 0),
])
def test_a_stop_on_one_rank_moves_every_rank(tmp_path: Path, callback: str, kwargs: dict[str, Any], reason: str,
                                             code: int) -> None:
    config = _config(tmp_path, extra=[{"target": f"tests.dist_support.{callback}", "kwargs": kwargs}])
    done = _fsmtrain("train", str(config), "--nproc", "2", cwd=tmp_path, timeout=100)
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    ends = [_ending(run_dir / name) for name in ("events.jsonl", "events-rank1.jsonl")]
    assert ends[0] == ends[1]
    assert ends[0][:3] == ("epoch_end", reason, kwargs["epoch"] + 1)
    other = 1 - kwargs["rank"]
    told = [r for r in _log(run_dir / ("events.jsonl" if other == 0 else "events-rank1.jsonl"))
            if r["event"] == "stop_request"]
    assert [(r["payload"]["reason"], r["payload"]["rank"]) for r in told] == [(reason, kwargs["rank"])]
    _audit_ok(run_dir, tmp_path)
    _replays(run_dir, tmp_path)


def _replays(run_dir: Path, cwd: Path) -> None:
    """Each rank's log replays as it ran: the other ranks' part comes back through the agreement."""
    for name in ("events.jsonl", "events-rank1.jsonl"):
        done = _fsmtrain("replay", str(run_dir / name), cwd=cwd, timeout=60)
        assert done.returncode == 0, name + "\n" + done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_immediate_stop_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path: Path) -> None:
    config = _config(tmp_path, extra=[{"target": "tests.dist_support.ImmediateStopOnRank",
                                       "kwargs": {"rank": 1, "epoch": 1, "batch": 2}}])
    temp = tmp_path / "temp"
    temp.mkdir()
    done = _fsmtrain("train", str(config), "--nproc", "2", cwd=tmp_path, timeout=100, TMPDIR=str(temp))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    left = [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "fsmtrain-launch-"))]
    assert not left  # the agent's folder for the workers' error files is gone (torch's default one stays)
    run_dir = _run_dir(tmp_path)
    ends = [_ending(run_dir / name) for name in ("events.jsonl", "events-rank1.jsonl")]
    batches = 512 * 8 // 10 // 2 // 64 + 1  # train rows per rank, in batches of 64
    assert ends[0] == ends[1] == ("train_step", "early_stop", 1, batches + 3)
    _audit_ok(run_dir, tmp_path)
    _replays(run_dir, tmp_path)


def _wait_for(path: Path, epoch: int, proc: forked_cli.ForkedProcess, limit: float = 90) -> int:
    """Wait until ``path`` says the run reached epoch index ``epoch``; the writer's pid."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            index, pid = path.read_text().split()
        except (OSError, ValueError):
            index, pid = "-1", "0"
        if int(index) >= epoch:
            return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached epoch {epoch}")


def _start(tmp: Path, config: Path) -> forked_cli.ForkedProcess:
    """``fsmtrain train CONFIG --nproc 2`` in a session of its own, forked from the zygote (tests/forked_cli.py); its
    temporary folders in ``tmp`` (a launcher the test kills with SIGKILL leaves its agent's folder there)."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {**_env(), "TMPDIR": str(tmp / "tmp")}
    return forked_cli.zygote(env).start(["train", str(config), "--nproc", "2"], tmp, env, session=True)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigterm_to_one_worker_ends_every_rank_and_the_run_resumes(tmp_path: Path) -> None:
    marker = tmp_path / "reached"
    config = _config(tmp_path, extra=[{"target": "tests.dist_support.SlowEpochs",
                                       "kwargs": {"seconds": 0.2, "marker": str(marker)}}])
    proc = _start(tmp_path, config)
    pid = _wait_for(Path(f"{marker}-rank1"), 1, proc)
    os.kill(pid, signal.SIGTERM)  # rank 1 only
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 143, out[-3000:]
    run_dir = _run_dir(tmp_path)
    ends = [_ending(run_dir / name) for name in ("events.jsonl", "events-rank1.jsonl")]
    assert ends[0] == ends[1] and ends[0][1] == "interrupted"
    _replays(run_dir, tmp_path)
    resumed = _fsmtrain("resume", str(run_dir), cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "COMPLETED after 5 epoch(s)" in resumed.stdout
    _audit_ok(run_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_after_kill_9_of_every_process_is_bit_identical(tmp_path: Path) -> None:
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    for folder in (clean, killed):
        folder.mkdir()
    extra = [{"target": "tests.dist_support.SlowEpochs", "kwargs": {"seconds": 0.15, "marker": "reached"}}]
    done = _fsmtrain("train", str(_config(clean, extra=extra)), "--nproc", "2", cwd=clean, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    proc = _start(killed, _config(killed, extra=extra))
    _wait_for(killed / "reached-rank0", random.randint(0, 3), proc)
    # The agent starts each worker in a session of its own, so the launcher's group holds neither:
    # each worker is killed by the pid its marker holds, then the launcher.
    pids = [_wait_for(killed / f"reached-rank{rank}", 0, proc) for rank in (0, 1)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    run_dir = _run_dir(killed)
    assert not (run_dir / "model.pt").exists()
    resumed = _fsmtrain("resume", str(run_dir), cwd=killed, timeout=150)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want, got = torch.load(_run_dir(clean) / "model.pt"), torch.load(run_dir / "model.pt")
    for k in want:
        assert torch.equal(want[k], got[k]), k
    _audit_ok(run_dir, killed)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("epoch", [2, 4])
def test_every_rank_killed_after_the_commit_before_its_epoch_line_audits_clean(tmp_path: Path, epoch: int) -> None:
    """Both ranks killed once rank 0 has committed an epoch's checkpoint and before either logged that
    epoch (the kill -9 test above meets this about 1 run in 6). Rank 1's log holds no checkpoint lines
    (rank 0 writes them), so its resume to the next epoch must be checked against what its resume
    line records and rank 0's log; and when that epoch was the last, the result's last_val_loss is
    an epoch the log never got."""
    extra = [{"target": "tests.dist_support.KillAfterCommit", "kwargs": {"epoch": epoch}}]
    proc = _start(tmp_path, _config(tmp_path, extra=extra))
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode != 0, out[-3000:]
    assert list((tmp_path / "runs").rglob("events.jsonl")), out[-3000:]  # killed, not failed before its run began
    run_dir = _run_dir(tmp_path)
    for name in ("events.jsonl", "events-rank1.jsonl"):
        assert not [r for r in _log(run_dir / name) if r["event"] == "epoch" and r["epoch"] == epoch], name
    resumed = _fsmtrain("resume", str(run_dir), cwd=tmp_path, timeout=150)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    said = _audit_ok(run_dir, tmp_path)
    assert said.count(f"epoch {epoch + 1} was committed") == 2, said  # each rank says what its log lacks
    if epoch == 2:
        _forged_resume_records_fail(run_dir, tmp_path)


def _forged_resume_records_fail(run_dir: Path, tmp: Path) -> None:
    """What the audit holds a resume record to: each forgery, rechained as someone with write access
    would, is named (checkpoint files left out: they pin the original chain)."""
    from audit_runs import read_lines, rechain

    from fsmtrain.tools.audit.ranks import audit_run_dir

    def forged(name: str, **changes: Any) -> list[str]:
        copy = tmp / f"forged-{len(list(tmp.glob('forged-*')))}"
        shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
        recs = [json.loads(line) for line in read_lines(copy / name)]
        (resume,) = [r for r in recs if r["event"] == "resume"]
        resume["payload"].update(changes)
        (copy / name).write_text("".join(rechain([json.dumps(r) + "\n" for r in recs])), encoding="utf-8")
        audit = audit_run_dir(copy, verify_checkpoints=False)
        return [f.message for f in audit.findings] + [f.message for r in audit.reports.values() for f in r.violations]

    other, (name, sha) = "0" * 64, _resumed_from(run_dir)
    assert forged("events-rank1.jsonl", sha256=other) == [
        f"segment 2: rank 1 resumed from {name} (sha256 {other[:12]}..., epoch 3), rank 0 from {name} (sha256 "
        f"{sha[:12]}..., epoch 3)"]
    found = forged("events-rank1.jsonl", checkpoint_epoch=1)
    assert any(m.startswith("segment 2: rank 1 resumed from") for m in found), found
    assert any(m.startswith("resume starts at epoch 4, but the log never logged epoch 3, and the resume event")
               for m in found), found
    found = forged("events.jsonl", sha256=other)
    assert any(m.startswith(f"the resume loaded {name} with sha256 000000000000... (epoch 3), but line")
               for m in found), found


def _resumed_from(run_dir: Path) -> tuple[str, str]:
    """The checkpoint name and sha256 rank 0's resume event records."""
    (resume,) = [r for r in _log(run_dir / "events.jsonl") if r["event"] == "resume"]
    return str(resume["payload"]["checkpoint"]), str(resume["payload"]["sha256"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_epoch_metrics_are_global_means_over_uneven_shards(tmp_path: Path) -> None:
    from fsmtrain.training.data import synthetic_regression
    from fsmtrain.training.distributed import shard_train_loader

    # 205 rows: 51 validation rows (shards of 26 and 25), 154 training rows; no learning (lr 0), so
    # every figure is a function of the data and the initial weights alone.
    changes: dict[str, Any] = dict(data_config={"n_samples": 205, "n_features": 8, "val_fraction": 0.25}, epochs=1,
                   optimizer="torch.optim.SGD", optimizer_config={"lr": 0.0}, scheduler=None, scheduler_config={},
                   metrics={"val_mae": "torch.nn.functional.l1_loss"}, batch_size=16)
    single, multi = tmp_path / "one", tmp_path / "two"
    for folder, nproc in ((single, "1"), (multi, "2")):
        folder.mkdir()
        done = _fsmtrain("train", str(_config(folder, **changes)), "--nproc", nproc, cwd=folder, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, two = (next(r for r in _log(_run_dir(f) / "events.jsonl") if r["event"] == "epoch")["payload"]["metrics"]
                for f in (single, multi))
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    assert two["val_mae"] == pytest.approx(one["val_mae"], rel=1e-6)
    # Training data: every rank's padded shard, the same rows the ranks trained on.
    weights = torch.load(_run_dir(multi) / "model.pt")
    from fsmtrain.training.models import MLP

    model = MLP(in_features=8, out_features=1, hidden=[64, 64])
    model.load_state_dict(weights)
    loaders = synthetic_regression(batch_size=16, seed=0, n_samples=205, n_features=8, val_fraction=0.25)
    rows = [i for r in (0, 1) for i in shard_train_loader(loaders.train, r, 2, 0).sampler]
    data = loaders.train.dataset
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(data[i][0][None]), data[i][1][None]).item() for i in rows]
    assert len(rows) == 154
    assert two["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; none here (CPU-only machine)"))])
def test_cuda_ranks(tmp_path: Path, device: str) -> None:
    """On CUDA where a GPU is lent; on CPU (gloo) everywhere, so CI runs all of it but the CUDA calls."""
    nproc = "2" if device == "cpu" or torch.cuda.device_count() >= 2 else "1"
    config = _config(tmp_path, device=device)
    done = _fsmtrain("train", str(config), "--nproc", nproc, cwd=tmp_path, timeout=250)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_data_seed_near_2_to_the_64_shuffles_every_epoch() -> None:
    """DistributedSampler seeds with seed + epoch, which overflows for seed -1 (data seed 2**64 - 1)
    at epoch 1 ("Overflow when unpacking long long"): the sum wraps; in range, it is torch's order."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from fsmtrain.training.distributed import shard_train_loader

    data = TensorDataset(torch.arange(20.0))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    for seed in (2**64 - 1, 2**64 - 2, 0, 12345):
        for rank in (0, 1):
            sampler = shard_train_loader(loader, rank, 2, seed).sampler
            assert isinstance(sampler, DistributedSampler)
            for epoch in range(3):
                sampler.set_epoch(epoch)
                got = list(sampler)
                if seed + epoch < 2**64:  # the range torch takes: exactly its order
                    plain: DistributedSampler[int] = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True,
                                                                        seed=seed)
                    plain.set_epoch(epoch)
                    assert got == list(plain)
                else:
                    twin: DistributedSampler[int] = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True,
                                                                       seed=(seed + epoch) % 2**64)
                    assert got == list(twin)
                assert sampler.seed == seed  # the wrap is local to the draw
