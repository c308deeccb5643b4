"""The forkserver of ``fsmtrain hpo --workers 2`` killed while both workers train: the study ends
cleanly (no trial RUNNING, no process left, one line, exit 1) instead of taking both workers for dead."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from hpo_support import journal, load, popen, study_config, wait_for
from optuna.trial import TrialState

SLOW_TRIALS: dict[str, Any] = {
    "epochs": 200, "early_stopping": {"enabled": False},
    "callbacks": {"extra": [{"target": "tests.hpo_callbacks.SlowEpochs", "kwargs": {"seconds": 0.1}}]},
}


def _stat(pid: str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(p) or ["", ""])[1] == str(pid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _live_in_group(pgid: int) -> list[int]:
    live = []
    for p in os.listdir("/proc"):
        fields = _stat(p) if p.isdigit() else None
        if fields is not None and fields[2] == str(pgid) and fields[0] != "Z":
            live.append(int(p))
    return live


def _kill_group(pgid: int) -> None:
    for pid in _live_in_group(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_the_forkserver_ends_the_study_cleanly(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 4, "sampler": "RandomSampler", "pruner": "NopPruner"}, **SLOW_TRIALS)
    path = tmp_path / "runs" / "quickstart" / "s" / "study.journal"
    log = tmp_path / "hpo.log"
    parent = popen("hpo", cfg, "--workers", "2", cwd=tmp_path, log=log, session=True)
    try:
        def both_training() -> bool:
            if not path.exists():
                return False
            try:
                trials = load(journal(path)).get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            except KeyError:
                return False
            return len([t for t in trials if len(t.intermediate_values) >= 2]) == 2

        wait_for(both_training, 180, "both workers training", (log,))
        servers = [p for p in _children(parent.pid) if "multiprocessing.forkserver" in _cmdline(p)]
        assert len(servers) == 1, [(p, _cmdline(p)) for p in _children(parent.pid)]
        os.kill(servers[0], signal.SIGKILL)
        code = parent.wait(timeout=150)
        # multiprocessing's resource tracker ends when it reads EOF from the returned command: allow it 2 s
        end = time.monotonic() + 2
        while _live_in_group(parent.pid) and time.monotonic() < end:
            time.sleep(0.05)
        left = [(p, _cmdline(p)) for p in _live_in_group(parent.pid)]
        size = path.stat().st_size
        time.sleep(3)  # an orphaned worker would go on writing the journal
        grew = path.stat().st_size - size
    finally:
        _kill_group(parent.pid)  # the group's leftovers, after they were counted
    out = log.read_text()
    assert code == 1, out
    assert "Traceback" not in out and "FileNotFoundError" not in out, out
    said = [line for line in out.splitlines() if "forkserver" in line]
    assert len(said) == 1 and "stopped" in said[0], out
    assert "ended with code 255" not in out, out  # no live worker is taken for dead
    study = load(journal(path))
    states = {t.number: t.state for t in study.trials}
    assert set(states.values()) <= {TrialState.FAIL, TrialState.COMPLETE}, states
    assert left == [], left
    assert grew == 0
