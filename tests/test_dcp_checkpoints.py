"""Sharded checkpoints (``distributed.strategy: fsdp``) through ``torch.distributed.checkpoint``, on real
``torchrun`` workers, gloo, 2 CPU ranks: each checkpoint is a folder of every rank's shards and state, its
commit carries each file's sha256, retention removes whole folders, and a damaged shard is quarantined with
its folder while the resume falls back to the previous good checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from dist_runs import config, events, fsmtrain, run_dir

from fsmtrain.training.checkpoint_file import folder_files

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")]

NET = {"in_features": 8, "out_features": 1, "hidden": [64, 64, 64]}


def _cfg(folder: Path, epochs: int) -> Path:
    return config(folder, epochs=epochs, net_config=NET, scheduler=None, scheduler_config={},
                  early_stopping={"enabled": False}, checkpoint={"enabled": True, "keep_last_k": 1},
                  distributed={"strategy": "fsdp", "agreement_timeout_s": 20.0})


@pytest.mark.timeout(400)
def test_sharded_checkpoint_folders_commit_retain_and_survive_a_damaged_shard(tmp_path: Path) -> None:
    done = fsmtrain("train", str(_cfg(tmp_path, 4)), "--nproc", "2", cwd=tmp_path, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = run_dir(tmp_path)
    folder = path / "checkpoints"
    # retention: keep_last 1, and the newest older state besides; the roles are folders of the same files
    assert sorted(p.name for p in folder.iterdir()) == ["best", "epoch_3", "epoch_4", "latest"]
    latest = folder / "latest"
    assert {f.name for f in latest.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "rank_0.pt",
                                                  "rank_1.pt"}
    assert (latest / "__1_0.distcp").stat().st_ino == (folder / "epoch_4" / "__1_0.distcp").stat().st_ino
    commits = {c["payload"]["path"]: c["payload"] for c in events(path / "events.jsonl", "checkpoint")}
    shards = commits["checkpoints/epoch_4"]["shards"]
    assert shards == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(latest.iterdir())}
    assert commits["checkpoints/epoch_4"]["sha256"] == hashlib.sha256(json.dumps(shards).encode()).hexdigest()
    assert folder_files(folder / "epoch_4") == shards
    removed = [e["payload"]["path"] for e in events(path / "events.jsonl", "checkpoint_removed")]
    assert removed == ["checkpoints/epoch_1", "checkpoints/epoch_2"]
    assert not events(path / "events-rank1.jsonl", "checkpoint")  # rank 0 commits for all
    audit = fsmtrain("audit", str(path), cwd=path, timeout=120)
    assert audit.returncode == 0, audit.stdout[-4000:]
    # one changed byte in rank 1's shard of the newest state: its folder (every name) is quarantined
    shard = folder / "epoch_4" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.rmtree(folder / "best")  # best is epoch 4's too: all of the newest state is now bad or gone
    resumed = fsmtrain("resume", str(path), "--nproc", "2", "--set", "epochs=5", cwd=tmp_path, timeout=200)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (damaged,) = events(path / "events.jsonl", "checkpoint_damaged")
    assert set(damaged["payload"]["paths"]) == {"checkpoints/epoch_4", "checkpoints/latest"}
    assert damaged["payload"]["falls_back_to"] == "checkpoints/epoch_3"
    assert (folder / "damaged" / "epoch_4" / "__1_0.distcp").is_file()
    (resume,) = events(path / "events.jsonl", "resume")
    assert resume["payload"]["checkpoint"] == "checkpoints/epoch_3" and resume["payload"]["next_epoch"] == 3
    assert "COMPLETED after 5 epoch(s)" in resumed.stdout
