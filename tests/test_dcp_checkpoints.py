"""Sharded runs and checkpoints (``distributed.strategy: fsdp``) through ``torch.distributed.checkpoint``, on real
``torchrun`` workers, gloo, 2 CPU ranks: a model of several blocks trains sharded and audits; ``model.pt`` is the
gathered weights and loads into the plain model; a run killed (SIGKILL) mid-epoch resumes on 2 ranks bitwise equal
to an uninterrupted one, and on 1 rank (2 -> 1); each checkpoint is a folder of every rank's shards and state, its
commit carries each file's sha256, retention removes whole folders, and a damaged shard is quarantined with
its folder while the resume falls back to the previous good checkpoint; a run killed after a step checkpoint
resumes from it bitwise (and on one process under strategy ddp, resharded), and so does one stopped by a signal
mid-epoch (every rank saves its last step), after a crash between a folder role's two renames. (A step checkpoint
inside an accumulation window: tests/test_fsdp_params.py, in its one run.)"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_runs import clean as no_faults
from dist_runs import config, events, fsmtrain, run_dir, same_weights, weights
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsmtrain.tools.report import write_run_report
from fsmtrain.training.checkpoint_file import folder_files
from fsmtrain.training.models import MLP

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64, 64]}


def _cfg(folder: Path, extra: tuple[dict[str, Any], ...] = ()) -> Path:
    return config(folder, epochs=4, net_config=NET, scheduler=None, scheduler_config={}, extra=extra,
                  early_stopping={"enabled": False}, checkpoint={"enabled": True, "keep_last_k": 1, "every_n_steps": 6},
                  distributed={"strategy": "fsdp", "agreement_timeout_s": 20.0})


Done = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """A sharded run of 4 epochs of 4 steps, with a checkpoint every 6 steps."""
    folder = tmp_path_factory.mktemp("clean")
    done = fsmtrain("train", str(_cfg(folder)), "--nproc", "2", cwd=folder, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, run_dir(folder)


@pytest.fixture(scope="module")
def clean(clean_run: Done) -> Path:
    return clean_run[1]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Done]:
    """A sharded run killed (SIGKILL, rank 1) mid-epoch, before any step checkpoint: resumed on 2 ranks, and a
    copy of it on 1."""
    folder = tmp_path_factory.mktemp("killed")
    kill = {"target": "tests.dcp_support.KillOnceCommitted",  # in epoch 2's first step, once epoch_1 is committed
            "kwargs": {"rank": 1, "step": 5, "path": "checkpoints/epoch_1", "marker": str(folder / "killed")}}
    first = fsmtrain("train", str(_cfg(folder, (kill,))), "--nproc", "2", cwd=folder, timeout=200)
    assert first.returncode != 0 and (folder / "killed").exists(), first.stdout[-3000:] + first.stderr[-3000:]
    path, copy = run_dir(folder), folder / "copy"
    shutil.copytree(path, copy)
    return {"two": (fsmtrain("resume", str(path), "--nproc", "2", cwd=folder, timeout=200), path),
            "one": (fsmtrain("resume", str(copy), "--nproc", "1", cwd=folder, timeout=200), copy)}


def _audit_ok(path: Path) -> str:
    audit = fsmtrain("audit", str(path), cwd=path, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr
    return audit.stdout


@pytest.mark.timeout(400)
def test_a_sharded_run_of_several_blocks_trains_and_writes_the_gathered_weights(clean_run: Done,
                                                                                 tmp_path: Path) -> None:
    done, path = clean_run
    out = no_faults(done)
    assert "COMPLETED after 4 epoch(s)" in done.stdout, out[-4000:]
    assert "FSDP2 over 2 ranks: 3 unit(s) sharded (net.2, net.4, (root))" in out  # auto: the blocks of >= 10%
    for name in ("events.jsonl", "events-rank1.jsonl"):
        (start,) = events(path / name, "run_start")
        extras = start["payload"]
        assert extras["strategy"] == "fsdp" and extras["sharding"]["units"] == ["net.2", "net.4", ""], extras
        total = extras["sharding"]["bytes_total"]
        assert 0 < extras["sharding"]["bytes_per_rank"] < total, extras["sharding"]
    # model.pt: a plain module's state dict, strict, equal to the gathered state of the last checkpoint
    plain = MLP(**NET)  # type: ignore[arg-type]
    plain.load_state_dict(weights(path / "model.pt"), strict=True)
    assert torch.load(path / "checkpoints" / "latest" / "rank_0.pt", weights_only=True)["epoch"] == 4  # from 1
    dcp_to_torch_save(path / "checkpoints" / "latest", tmp_path / "latest-whole.pt")  # the shards, put together
    last = torch.load(tmp_path / "latest-whole.pt", weights_only=True)
    for k, v in weights(path / "model.pt").items():
        assert torch.equal(v, last["model"][k]), k
    assert set(last["optimizer"]["state"]) == {k for k in plain.state_dict()}  # keyed by name, whole
    assert all(v.shape == plain.state_dict()[k].shape for k, v in last["model"].items())
    # the report and the replay know it: its strategy, its folders' commits
    html = write_run_report(path / "events.jsonl", tmp_path / "report.html").read_text()
    assert "fsdp (FSDP2 over 2 ranks, 3 unit(s) sharded; checkpoints: DCP folders)" in html
    replay = fsmtrain("replay", str(path / "events.jsonl"), cwd=tmp_path, timeout=120)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]


@pytest.mark.timeout(600)
def test_a_killed_sharded_run_resumes_on_two_ranks_bitwise(clean: Path, killed: dict[str, Done]) -> None:
    done, path = killed["two"]
    no_faults(done)
    assert done.returncode == 0 and "COMPLETED after 4 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    same_weights(clean / "model.pt", path / "model.pt")
    _audit_ok(path)
    _from_epoch_1(path)


def _from_epoch_1(path: Path) -> None:
    (resume,) = events(path / "events.jsonl", "resume")
    commits = {c["payload"]["path"]: c["payload"]["sha256"] for c in events(path / "events.jsonl", "checkpoint")}
    assert resume["payload"]["sha256"] == commits["checkpoints/epoch_1"], resume


@pytest.mark.timeout(600)
def test_a_sharded_run_reshards_two_to_one(killed: dict[str, Done]) -> None:
    done, path = killed["one"]
    assert done.returncode == 0 and "COMPLETED after 4 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    assert "on 1 process(es); it ran on 2" in done.stdout
    assert "written by 2 rank(s): torch.distributed.checkpoint reshards it onto 1" in no_faults(done)
    (resume,) = events(path / "events.jsonl", "resume")
    assert (resume["payload"]["world_size_before"], resume["payload"]["world_size"]) == (2, 1)
    assert "segments on 2, 1 ranks; sharded (FSDP2) in segment(s) 1)" in _audit_ok(path)
    _from_epoch_1(path)
    MLP(**NET).load_state_dict(weights(path / "model.pt"), strict=True)  # type: ignore[arg-type]


@pytest.mark.timeout(400)
def test_sharded_checkpoint_folders_commit_retain_and_survive_a_damaged_shard(clean: Path, tmp_path: Path) -> None:
    path = tmp_path / "run"
    shutil.copytree(clean, path)
    folder = path / "checkpoints"
    # retention: keep_last 1, and the newest older state besides; the roles are folders of the same files
    assert sorted(p.name for p in folder.iterdir()) == ["best", "epoch_3", "epoch_4", "latest", "step_12", "step_6"]
    latest = folder / "latest"
    assert {f.name for f in latest.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "rank_0.pt",
                                                  "rank_1.pt"}
    shard = Path("checkpoints", "epoch_4", "__1_0.distcp")  # latest/ holds its hard link
    assert (clean / "checkpoints" / "latest" / shard.name).stat().st_ino == (clean / shard).stat().st_ino
    commits = {c["payload"]["path"]: c["payload"] for c in events(path / "events.jsonl", "checkpoint")}
    shards = commits["checkpoints/epoch_4"]["shards"]
    assert shards == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(latest.iterdir())}
    assert commits["checkpoints/epoch_4"]["sha256"] == hashlib.sha256(json.dumps(shards).encode()).hexdigest()
    assert folder_files(folder / "epoch_4") == shards
    removed = [e["payload"]["path"] for e in events(path / "events.jsonl", "checkpoint_removed")]
    assert removed == ["checkpoints/epoch_1", "checkpoints/epoch_2"]
    assert not events(path / "events-rank1.jsonl", "checkpoint")  # rank 0 commits for all
    audit = _audit_ok(path)
    assert "ranks: 2 ranks agree" in audit and "sharded (FSDP2) in segment(s) 1)" in audit
    # one changed byte in rank 1's shard of the newest state (in both names: the copy lost the hard link)
    data = bytearray((path / shard).read_bytes())
    data[-1] ^= 0xFF
    for name in (path / shard, latest / shard.name):
        name.write_bytes(bytes(data))
    shutil.rmtree(folder / "best")  # best is epoch 4's too: all of the newest state is now bad or gone
    (folder / "step_12" / ".metadata").unlink()  # a missing file fails its folder's digest too
    damaged_audit = fsmtrain("audit", str(path), cwd=path, timeout=120).stdout
    assert "checkpoints/epoch_4 is damaged" in damaged_audit and "(in the folder: __1_0.distcp)" in damaged_audit
    assert "(in the folder: .metadata missing)" in damaged_audit
    resumed = fsmtrain("resume", str(path), "--nproc", "2", "--set", "epochs=5", cwd=path, timeout=200)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    damaged = {frozenset(d["payload"]["paths"]): d for d in events(path / "events.jsonl", "checkpoint_damaged")}
    both = frozenset({"checkpoints/epoch_4", "checkpoints/latest"})
    assert set(damaged) == {both, frozenset({"checkpoints/step_12"})}
    assert {d["payload"]["falls_back_to"] for d in damaged.values()} == {"checkpoints/epoch_3"}
    assert (folder / "damaged" / "step_12" / "rank_1.pt").is_file()
    assert (folder / "damaged" / "epoch_4" / "__1_0.distcp").is_file()
    (resume,) = events(path / "events.jsonl", "resume")
    assert resume["payload"]["checkpoint"] == "checkpoints/epoch_3" and resume["payload"]["next_epoch"] == 3
    assert "COMPLETED after 5 epoch(s)" in resumed.stdout


@pytest.mark.timeout(400)
def test_a_sharded_run_killed_after_a_step_checkpoint_resumes_from_it_bitwise(clean: Path, tmp_path: Path) -> None:
    kill = {"target": "tests.dcp_support.KillOnceCommitted",
            "kwargs": {"rank": 1, "step": 7, "path": "checkpoints/step_6", "marker": str(tmp_path / "killed")}}
    first = fsmtrain("train", str(_cfg(tmp_path, (kill,))), "--nproc", "2", cwd=tmp_path, timeout=200)
    assert first.returncode != 0 and (tmp_path / "killed").exists(), first.stdout[-3000:] + first.stderr[-3000:]
    path, copy = run_dir(tmp_path), tmp_path / "copy"
    shutil.copytree(path, copy)
    done = fsmtrain("resume", str(path), "--nproc", "2", cwd=tmp_path, timeout=200)
    assert done.returncode == 0 and "COMPLETED after 4 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    (resume,) = events(path / "events.jsonl", "resume")
    step6 = next(c for c in events(path / "events.jsonl", "checkpoint") if c["payload"]["path"] == "checkpoints/step_6")
    assert resume["payload"]["sha256"] == step6["payload"]["sha256"] and resume["payload"]["batch"] == 2  # its latest
    same_weights(clean / "model.pt", path / "model.pt")
    audit = fsmtrain("audit", str(path), cwd=path, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:]
    # the step folder on one process (2 -> 1), under strategy ddp: resharded, said, and audited
    done = fsmtrain("resume", str(copy), "--nproc", "1", "--set", "distributed.strategy=ddp", cwd=tmp_path, timeout=200)
    assert done.returncode == 0 and "COMPLETED after 4 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    said = done.stdout + done.stderr
    assert "the sharded checkpoint latest (strategy fsdp) continues under strategy ddp" in said, said[-3000:]
    assert "the sharded checkpoint latest was written by 2 rank(s): torch.distributed.checkpoint reshards it onto 1" \
        in said
    (resume,) = events(copy / "events.jsonl", "resume")  # latest: step_6's files
    assert resume["payload"]["sha256"] == step6["payload"]["sha256"] and resume["payload"]["global_step"] == 6
    assert resume["payload"]["batch"] == 4  # 2 batches of 2 ranks: as many examples as 4 batches of one
    assert (copy / "checkpoints" / "epoch_4.pt").is_file()  # ddp's checkpoints from there on: single files
    audit = fsmtrain("audit", str(copy), cwd=copy, timeout=120)
    assert audit.returncode == 0 and "segments on 2, 1 ranks" in audit.stdout, audit.stdout[-4000:]


@pytest.mark.timeout(400)
def test_a_preempted_sharded_run_saves_every_ranks_last_step_and_resumes_bitwise(clean: Path, tmp_path: Path) -> None:
    signal_ = {"target": "tests.dcp_support.SignalMidEpoch", "kwargs": {"rank": 1, "step": 7}}
    first = fsmtrain("train", str(_cfg(tmp_path, (signal_,))), "--nproc", "2", cwd=tmp_path, timeout=200)
    assert first.returncode == 143, first.stdout[-3000:] + first.stderr[-3000:]
    path = run_dir(tmp_path)
    (saved,) = events(path / "events.jsonl", "checkpoint_preempted")  # where the ranks agreed to stop
    step = saved["payload"]["step"]
    assert step == 7  # agreed before the next batch: batch 3 of epoch 2's 4
    ck = path / "checkpoints"
    assert (ck / f"step_{step}" / "rank_1.pt").is_file()
    # a crash between the role's two renames: no latest/, its old and new folders left behind
    shutil.copytree(ck / "latest", ck / ".latest.new.tmp")
    (ck / "latest").rename(ck / ".latest.old.tmp")
    done = fsmtrain("resume", str(path), "--nproc", "2", cwd=tmp_path, timeout=200)
    assert done.returncode == 0 and "COMPLETED after 4 epoch(s)" in done.stdout, done.stdout[-3000:] + done.stderr
    (resume,) = events(path / "events.jsonl", "resume")
    assert resume["payload"]["global_step"] == step and resume["payload"]["checkpoint"] == f"checkpoints/step_{step}"
    assert sorted(resume["payload"]["removed"]) == ["checkpoints/.latest.new.tmp", "checkpoints/.latest.old.tmp"]
    assert (ck / "latest" / "rank_0.pt").is_file() and not (ck / ".latest.old.tmp").exists()
    same_weights(clean / "model.pt", path / "model.pt")

