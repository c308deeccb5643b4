"""User callbacks and helpers for the tests that signal real ``fsmtrain`` processes
(tests/test_teardown_signals.py): named in a config's ``callbacks.extra``, found through PYTHONPATH."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from forked_cli import ForkedProcess

from fsmtrain import TrainingCallback
from fsmtrain.core.context import RunContext


class SlowTeardown(TrainingCallback):
    """Holds the teardown open for ``seconds`` (in ``on_train_end``), so a signal can land inside it."""

    def __init__(self, seconds: float = 1.5) -> None:
        self.seconds = seconds

    def on_train_end(self, run: RunContext) -> None:
        time.sleep(self.seconds)


class SlowExit(TrainingCallback):
    """Adds an exit handler that takes ``seconds`` (as W&B's or a user's own can), registered at the
    end of the run: the process stays alive after its ``result`` line while it exits, so a signal
    sent right after that line surely lands before the process is gone."""

    def __init__(self, seconds: float = 1.5) -> None:
        self.seconds = seconds

    def on_train_end(self, run: RunContext) -> None:
        atexit.register(time.sleep, self.seconds)


def catches_signals(pid: int) -> bool:
    """The process catches SIGTERM (its default kills): a command caught its signals. Read from
    /proc, so the test waits for the real handler, not for a time that depends on the load."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def wait_for(predicate: object, proc: object, timeout: float = 240.0, poll: float = 0.001) -> None:
    """Poll ``predicate()`` until it holds; fail when the process ended first or time ran out."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if proc.poll() is not None:  # type: ignore[attr-defined]
            raise AssertionError(f"the process ended first ({proc.returncode})")  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError("waited too long")
        time.sleep(poll)


def log_has(run_dir: Path, needle: bytes) -> bool:
    try:
        return needle in (run_dir / "events.jsonl").read_bytes()
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class SlowStart(TrainingCallback):
    """Takes ``seconds`` to build: a start-up that holds its run directory before the run starts."""

    def __init__(self, seconds: float = 5.0) -> None:
        time.sleep(seconds)


def _stopped(pid: int) -> bool:
    """Whether ``pid``, just sent SIGSTOP, stopped (True) or exited first (False), for a process that is
    not our child (forked by tests/forked_cli.py's zygote), which ``waitid`` cannot wait for."""
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        if state in ("T", "t"):
            return True
        if state in ("Z", "X"):
            return False
        time.sleep(0.0005)


def signal_if_alive(proc: subprocess.Popen[bytes] | ForkedProcess, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``proc`` unless it has already exited: False then. The process is stopped
    while this is decided (a process about to exit could otherwise exit between a check and the
    signal, and its status 0 would read as a signal ignored without a word)."""
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # Until it is stopped or has exited (a process already on its way out is not stopped by SIGSTOP)
        if isinstance(proc, subprocess.Popen):
            state = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WSTOPPED | os.WNOWAIT)
            if state is None or state.si_code != os.CLD_STOPPED:  # it exited first: the moment has passed
                return False
        elif not _stopped(proc.pid):
            return False
        os.kill(proc.pid, sig)
        return True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
