"""The 2-rank kill matrix of issue 41: real ``fsmtrain train --nproc 2`` (torchrun's elastic agent,
gloo, ``DistributedSampler``) with ``checkpoint.every_n_steps: 5``, the whole run (launcher and both
ranks) killed by SIGKILL at 10 steps drawn from a seeded RNG, 5 with gradient accumulation and 5
without; and SIGTERM to one rank mid-epoch with no periodic checkpoint due.

The cheapest honest design: one uninterrupted reference run per config, and the kills chained, each
``fsmtrain resume`` the next killed launch (one launch per kill). After each kill the next resume
must start at most 5 steps back; every step checkpoint a resumed launch commits holds the model and
optimizer of the reference's file of that step, bit for bit (so each resume is checked, not only the
last), and the final weights are the reference's; every log audits clean."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import torch
import yaml
from steps2_support import GROUP_ENV, PIDS_ENV
from steps_support import REPO, RUN, TESTS, events, same_bits, weights

from fsmtrain.tools.audit.auditor import audit_file

STEPS = 39  # 3 epochs of 13 batches a rank
SEED = 4141


def _config(folder: Path, accumulation: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg.update(epochs=3, wandb={"enabled": False}, early_stopping={"enabled": False}, scheduler_config={"T_max": 3},
               grad_accumulation=accumulation, callbacks={"extra": [{"target": "steps2_support.KillGroupAt"}]},
               checkpoint={"every_n_steps": 5, "background": False, "keep_last_k": 100},
               preemption={"rounds_every": 8})  # the SIGTERM case's bound: 2 x 8 steps
    folder.mkdir(parents=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(folder: Path, *args: str, group: str = "") -> subprocess.CompletedProcess[str]:
    pids, temp = folder / "pids", folder / "tmp"
    pids.mkdir(parents=True, exist_ok=True)
    temp.mkdir(exist_ok=True)  # a launcher killed with SIGKILL leaves its agent's folder: here, not in /tmp
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1", GROUP_ENV: group, PIDS_ENV: str(pids),
           "TMPDIR": str(temp)}
    # the launcher forked from a zygote (tests/forked_cli.py) in a session of its own, and its workers from its own
    proc = forked_cli.zygote(env).start(list(args), folder, env, session=True)
    try:
        done = proc.run(300)
    finally:
        left = _outliving([int(p.read_text()) for p in pids.glob("rank*")], pids)
        for pid in left:  # a worker that outlived its launch (a hang, a timeout): killed, and a failure
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for p in pids.glob("rank*"):
            p.unlink()
    assert not left, f"workers {left} outlived their launch"
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, "")


def _outliving(ranks: list[int], pids: Path, grace: float = 10.0) -> list[int]:
    """The workers still running ``grace`` seconds after their launch ended (a worker killed with the launcher
    may still be dying as its launch is seen to end)."""
    end = time.monotonic() + grace
    while (left := [pid for pid in ranks if _ours(pid, pids)]) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _ours(pid: int, pids: Path) -> bool:
    """``pid`` is still a worker of this test (a pid the system gave to another process is not): it works in the
    launch's folder (a forked worker's ``/proc/PID/environ`` is its zygote's first environment, not its own)."""
    try:
        return os.readlink(f"/proc/{pid}/cwd") == str(pids.parent.resolve())
    except OSError:
        return False


def _state(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True, map_location="cpu")


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    flat_a, flat_b = _tensors(a), _tensors(b)
    return flat_a.keys() == flat_b.keys() and same_bits(flat_a, flat_b)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)  # a 0-d tensor (Adam's step) has no byte view


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _flat(v) for k, v in state["model"].items()}
    for i, s in state["optimizer"]["state"].items():
        out.update({f"optimizer.{i}.{k}": _flat(v) for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _resumes(run_dir: Path) -> list[dict[str, Any]]:
    return [e["payload"] for e in events(run_dir) if e["event"] == "resume"]


def _check_step_files(ref: Path, run_dir: Path, said: str, signalled: int | None) -> None:
    """Every step file of the run holds the reference's state of that step (the signal's own step
    has none in the reference: its state is checked through what the resume from it commits)."""
    ref_files = {p.name: p for p in (ref / "checkpoints").glob("step_*.pt")}
    mine = [p for p in (run_dir / "checkpoints").glob("step_*.pt") if p.name != f"step_{signalled}.pt"]
    assert len(mine) >= 5, (said, mine)
    for path in sorted(mine, key=lambda p: int(p.stem[5:])):
        assert path.name in ref_files, f"{said}: {path.name} has no counterpart in the reference"
        assert _same_state(_state(ref_files[path.name]), _state(path)), f"{said}: {path.name} differs"


def _audit(run_dir: Path, said: str) -> None:
    for name in ("events.jsonl", "events-rank1.jsonl"):
        report = audit_file(run_dir / name)
        assert not report.violations, (said, name, [f.message for f in report.violations])


def _kill_chain(root: Path, config: Path, kills: list[int], first: str = "train") -> Path:
    """Kill the launches at ``kills`` in turn (the first one ``fsmtrain train`` unless ``first`` is
    ``resume``), checking after each that the next resume lost at most 5 steps; then resume to the end."""
    run_dir, folder = root / "run" / RUN, root / "run"
    said = f"2 ranks, kills at {kills} (random.Random({SEED}))"
    before = len(_resumes(run_dir)) if run_dir.is_dir() else 0
    for n, at in enumerate(kills):
        args = ("train", str(config), "--nproc", "2") if n == 0 and first == "train" else ("resume", str(run_dir))
        done = _launch(folder, *args, group=f"kill:{at}")
        assert done.returncode == -signal.SIGKILL, (said, at, done.stdout[-3000:])
    done = _launch(folder, "resume", str(run_dir))
    assert done.returncode == 0, (said, done.stdout[-3000:])
    resumed = _resumes(run_dir)[before + (first == "resume"):]  # a first resume continues a run not killed
    assert len(resumed) == len(kills), (said, resumed)
    for at, resume in zip(kills, resumed, strict=True):
        assert 0 <= at - resume["global_step"] <= 5, f"{said}: killed at step {at}, resumed from {resume}"
    return run_dir


_REFERENCES: dict[bytes, Path] = {}


def _reference(root: Path, config: Path) -> Path:
    """The uninterrupted run of ``config``: run once for the module, per config's contents."""
    key = config.read_bytes()
    if key not in _REFERENCES:
        done = _launch(root / "ref", "train", str(config), "--nproc", "2")
        assert done.returncode == 0, done.stdout[-3000:]
        _REFERENCES[key] = root / "ref" / RUN
    return _REFERENCES[key]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_kill_9_of_every_process_at_5_random_steps_resumes_bit_identical_on_2_ranks(
        tmp_path: Path, accumulation: int) -> None:
    config = _config(tmp_path / "run", accumulation)
    ref = _reference(tmp_path, config)
    kills = sorted(random.Random(SEED + accumulation).sample(range(1, STEPS), 5))
    said = f"2 ranks, grad_accumulation {accumulation}, kills at {kills}"
    first, stop = "train", None
    if accumulation == 1:  # SIGTERM mid-epoch 2 first: rank 1 signals itself before batch 16, no checkpoint due
        done = _launch(tmp_path / "run", "train", str(config), "--nproc", "2", group="term:15")
        assert done.returncode == 143, done.stdout[-3000:]
        run_dir = tmp_path / "run" / RUN
        ends = [next(e for e in events(run_dir, name) if e["event"] == "transition" and e["to"] == "train_end")
                for name in ("events.jsonl", "events-rank1.jsonl")]
        stop = ends[0]["global_step"]
        assert ends[1]["global_step"] == stop and 15 <= stop <= 15 + 16, "both ranks stop within 16 steps"
        assert stop % 5 and stop % 13, "mid-epoch, with no step checkpoint due"
        saved = [e["payload"]["step"] for e in events(run_dir) if e["event"] == "checkpoint"
                 and e["payload"].get("kind") == "step"]
        assert saved[-1] == stop
        result = next(e for e in events(run_dir) if e["event"] == "result")["payload"]
        assert result["stop_reason"] == "interrupted" and result["stop_source"].startswith("signal SIGTERM")
        kills = sorted(random.Random(SEED).sample(range(stop + 1, STEPS), 5))
        said, first = f"2 ranks, SIGTERM before step 16 (stopped after {stop}), then kills at {kills}", "resume"
    run_dir = _kill_chain(tmp_path, config, kills, first)
    if first == "resume":
        assert _resumes(run_dir)[0]["global_step"] == stop, "the resume after SIGTERM loses no step"
    _check_step_files(ref, run_dir, said, stop)
    assert same_bits(weights(ref), weights(run_dir)), said
    _audit(run_dir, said)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_during_an_epochs_last_validation_on_one_rank_ends_that_epoch_on_both_and_resumes_at_the_next(
        tmp_path: Path) -> None:
    config = _config(tmp_path / "run", 1)
    ref = _reference(tmp_path, config)
    done = _launch(tmp_path / "run", "train", str(config), "--nproc", "2", group="termval:1")
    assert done.returncode == 143, done.stdout[-3000:]
    run_dir = tmp_path / "run" / RUN
    for name in ("events.jsonl", "events-rank1.jsonl"):
        log = events(run_dir, name)
        assert [e["epoch"] for e in log if e["event"] == "epoch"] == [0, 1], name  # the signalled epoch ended
        end = next(e for e in log if e["event"] == "transition" and e["to"] == "train_end")
        assert (end["from"], end["global_step"]) == ("epoch_end", 26), (name, end)
    done = _launch(tmp_path / "run", "resume", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:]
    (resume,) = _resumes(run_dir)
    assert (resume["global_step"], resume["next_epoch"]) == (26, 2), resume  # epoch 2's validation is not redone
    assert [e["epoch"] for e in events(run_dir) if e["event"] == "epoch"] == [0, 1, 2]
    assert same_bits(weights(ref), weights(run_dir))
    _audit(run_dir, "SIGTERM during epoch 2's validation on rank 1")
