"""A kill-and-resume harness over real ``fsmtrain`` processes (used by tests/test_resume.py and by
``benchmarks/kill_resume.py``).

``run_with_kills`` starts ``fsmtrain train CONFIG``, kills it with SIGKILL at chosen moments (some
while a checkpoint file is being written, found by watching for the writer's temp file), then
``fsmtrain resume``s it, killing again, until a process finishes. The final ``model.pt`` is then
compared bit for bit with an uninterrupted run of the same config.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from forked_cli import ForkedProcess, zygote

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "CI": "true"}


def fsmtrain(*args: str, cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "fsmtrain", *args], cwd=cwd, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def forked(*args: str, cwd: Path) -> ForkedProcess:
    """``fsmtrain(*args)`` forked from a zygote (tests/forked_cli.py): for the tests that start dozens."""
    environ = env()
    return zygote(environ).start(list(args), cwd, environ)


@dataclass
class Kill:
    """When to kill: once the log holds ``epochs`` epoch lines, ``delay`` seconds later, or
    (``mid_write``) as soon as a checkpoint temp file exists after that."""

    epochs: int
    delay: float = 0.0
    mid_write: bool = False


@dataclass
class KillReport:
    kills: list[str] = field(default_factory=list)
    processes: int = 0


def _checkpoint_tmp(run_dir: Path, since: float) -> bool:
    """A checkpoint temp file this process made (one a killed process left is not a write in progress)."""
    try:
        return any(e.name.endswith(".tmp") and e.stat().st_mtime >= since
                   for e in os.scandir(run_dir / "checkpoints"))
    except FileNotFoundError:
        return False


def _committed(run_dir: Path) -> bool:
    try:
        return b'"event":"checkpoint"' in (run_dir / "events.jsonl").read_bytes()
    except FileNotFoundError:
        return False


def _epochs_logged(run_dir: Path) -> int:
    try:
        return (run_dir / "events.jsonl").read_bytes().count(b'"event":"epoch"')
    except FileNotFoundError:
        return 0


def _run_until(proc: ForkedProcess, kill: Kill, run_dir: Path, deadline: float) -> str | None:
    """Kill ``proc`` as ``kill`` says; None when it finished first."""
    started = time.time()  # the process was just started: its writes come seconds later
    armed: float | None = None
    while proc.poll() is None:
        now = time.monotonic()
        if now > deadline:
            proc.kill()
            raise TimeoutError("the training process did not finish in time")
        if armed is None and _epochs_logged(run_dir) >= kill.epochs:
            armed = now
        if armed is not None and now - armed >= kill.delay:
            writing = _checkpoint_tmp(run_dir, started)
            if not kill.mid_write or writing or now - armed > 30:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                where = " during a checkpoint write" if writing else ""
                return f"SIGKILL after {kill.epochs} logged epochs + {now - armed:.3f}s{where}"
            time.sleep(0.0002)
            continue
        time.sleep(0.005)
    return None


def run_with_kills(config: Path, cwd: Path, run_dir: Path, kills: list[Kill], *overrides: str,
                   timeout: float = 400) -> KillReport:
    """Train with ``kills``, then resume until a process completes; returns what happened."""
    report = KillReport()
    deadline = time.monotonic() + timeout
    sets = [a for o in overrides for a in ("--set", o)]
    proc = forked("train", str(config), *sets, cwd=cwd)
    queue = list(kills)
    while True:
        report.processes += 1
        kill = queue.pop(0) if queue else None
        if kill is None:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise AssertionError(f"the last process failed ({proc.returncode}): {err.decode()[-3000:]}")
            return report
        what = _run_until(proc, kill, run_dir, deadline)
        if what is None:  # finished before the kill
            if proc.returncode != 0:
                raise AssertionError(f"process failed ({proc.returncode}): {proc.stderr.read().decode()[-3000:]}"
                                     if proc.stderr else "process failed")
            return report
        report.kills.append(what)
        if _committed(run_dir):
            proc = forked("resume", str(run_dir), *sets, cwd=cwd)
            continue
        # Killed before the run committed a checkpoint: `train --resume` starts it over in its own
        # folder (a `restart` in its log), or starts it when the kill came before its log did.
        proc = forked("train", str(config), *sets, "--resume", cwd=cwd)


def random_kills(n: int, seed: int, epochs: int = 12, *, mid_write_every: int = 3) -> list[Kill]:
    """``n`` kills spread over a run of ``epochs`` epochs; every ``mid_write_every``-th one lands in a
    checkpoint write."""
    rng = random.Random(seed)
    marks = sorted(rng.randrange(0, epochs - 1) for _ in range(n))
    return [Kill(m, rng.uniform(0.0, 0.25), mid_write=(i % mid_write_every == 1)) for i, m in enumerate(marks)]


def same_weights(a: Path, b: Path) -> bool:
    sa = torch.load(a, weights_only=True)
    sb = torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
