"""Pre-emption: SIGTERM or SIGUSR1 (SLURM's ``--signal``) in the middle of an epoch, with no periodic
checkpoint due, stops the run at the next batch boundary: it saves the state after that step,
writes its ``result`` (INTERRUPTED, naming the signal), exits 143, and ``fsmtrain resume`` gives
the weights of an uninterrupted run bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from steps_support import (
    KILL_ENV,
    PIDS_ENV,
    REPO,
    RUN,
    TESTS,
    events,
    fsmtrain,
    preempted,
    same_bits,
    weights,
    write_config,
)

from fsmtrain.tools.audit.auditor import audit_file


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_signal_saves_the_last_step_exits_143_and_resumes_bit_identical(
        tmp_path: Path, signum: signal.Signals) -> None:
    config = write_config(tmp_path, **{"checkpoint.background": False})
    (tmp_path / "ref").mkdir()
    done = fsmtrain(tmp_path / "ref", "train", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "run").mkdir()
    proc, seconds = preempted(tmp_path / "run", config, signum, at_step=8)
    out = proc.output()[1]  # its stderr
    assert proc.returncode == 143, out[-3000:]
    run_dir = tmp_path / "run" / RUN
    log = events(run_dir)
    result = next(e for e in log if e["event"] == "result")["payload"]
    assert result["stop_reason"] == "interrupted" and result["stop_source"] == f"signal {signum.name}"
    end_step = next(e for e in log if e["event"] == "transition" and e["to"] == "train_end")["global_step"]
    saved = [e["payload"] for e in log if e["event"] == "checkpoint" and e["payload"].get("kind") == "step"]
    assert [s["step"] for s in saved] == [end_step] and end_step % 26, "the state after the last step, mid-epoch"
    assert f"step_{end_step}.pt" in out and "fsmtrain resume" in out  # said on the console
    assert not audit_file(run_dir / "events.jsonl").violations
    print(f"{signum.name}: signal to exit {seconds:.2f} s, stopped after step {end_step}")
    resumed = fsmtrain(tmp_path / "run", "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resume = next(e for e in events(run_dir) if e["event"] == "resume")["payload"]
    assert resume["global_step"] == end_step
    assert same_bits(weights(tmp_path / "ref" / RUN), weights(run_dir))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_of_two_ranks_stops_both_at_the_same_step_and_resumes_bit_identical(tmp_path: Path) -> None:
    # 52 batches a rank an epoch: the signal (some 20 steps in) is agreed within 2 x 8 steps, mid-epoch
    config = write_config(tmp_path, **{"checkpoint.background": False, "epochs": 2, "data_config.n_samples": 8192})
    (tmp_path / "ref").mkdir()
    done = fsmtrain(tmp_path / "ref", "train", str(config), "--nproc", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    folder, pids = tmp_path / "run", tmp_path / "pids"
    folder.mkdir()
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1", KILL_ENV: "slow:50", PIDS_ENV: str(pids)}
    proc = subprocess.Popen([sys.executable, "-m", "fsmtrain", "train", str(config), "--nproc", "2"], cwd=folder,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not (pids / "rank1").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "rank 1 did not start"
        time.sleep(0.05)
    time.sleep(1.0)
    sent = time.monotonic()
    os.kill(int((pids / "rank1").read_text()), signal.SIGTERM)  # rank 1 only
    out, _ = proc.communicate(timeout=180)
    seconds = time.monotonic() - sent
    assert proc.returncode == 143, out[-3000:]
    run_dir = folder / RUN
    ends = [next(e for e in events(run_dir, name) if e["event"] == "transition" and e["to"] == "train_end")
            for name in ("events.jsonl", "events-rank1.jsonl")]
    assert ends[0]["global_step"] == ends[1]["global_step"], "both ranks stop after the same step"
    step = ends[0]["global_step"]
    saved = [e["payload"]["step"] for e in events(run_dir) if e["event"] == "checkpoint"
             and e["payload"].get("kind") == "step"]
    assert saved == [step] and step % 52, "the state after the last step, mid-epoch"
    print(f"2 ranks, SIGTERM to rank 1: signal to exit {seconds:.2f} s, both stopped after step {step}")
    resumed = fsmtrain(folder, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert same_bits(weights(tmp_path / "ref" / RUN), weights(run_dir))
