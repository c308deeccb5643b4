"""Trials whose process stopped under them: FAILed as *lost* and retried with their parameters, each
seed resuming from its checkpoint. A RUNNING trial is failed only when its process is provably gone
(same host, boot and pid namespace); any doubt is left to the heartbeat."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsmtrain.app.hpo.storage import WORKER_ATTR, retry_callback

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = ["LOST_ATTR", "fail_orphaned_trials", "lost_why", "process_gone", "reclaim", "running", "say", "start_time",
           "worker_identity"]

LOST_ATTR = "lost"
"""Trial user attribute ``{trial, why}``; ``trial`` tells the lost trial from a retry that inherited it."""


def say(*lines: str) -> None:
    """Tell the person running the study, on stderr (the monitor owns stdout)."""
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _where() -> dict[str, Any]:
    """This host, boot and pid namespace: within them a pid names one process."""
    pidns = None
    with contextlib.suppress(OSError):
        pidns = os.readlink("/proc/self/ns/pid")
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of ``pid``, from ``/proc``; None without it."""
    text = _read(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def worker_identity(launch: str) -> dict[str, Any]:
    """Which process runs a trial: enough to tell later, on this host, that it is gone."""
    pid = os.getpid()
    return {**_where(), "pid": pid, "launch": launch, "started": start_time(pid)}


def process_gone(who: Mapping[str, Any]) -> bool:
    """Whether the process ``who`` names (a :func:`worker_identity`) is provably gone from here."""
    pid = who.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    here = _where()
    if None in here.values() or any(who.get(key) != value for key, value in here.items()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, as another user's
    return _proc_stat(pid) is not None and not running(pid, who.get("started"))


def running(pid: int, started: Any = None) -> bool:
    """Whether ``pid`` runs here (not a zombie) and, with ``started``, is the process that started then."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and (not isinstance(started, int) or stat[1] == started)


def start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def lost_why(trial: FrozenTrial) -> str | None:
    """Why ``trial`` was lost, if it was (its own ``lost`` attribute, not one a retry inherited)."""
    lost = trial.user_attrs.get(LOST_ATTR)
    if isinstance(lost, Mapping) and lost.get("trial") == trial.number:
        return str(lost.get("why") or "lost")
    return None


def _fail_lost(study: optuna.study.Study, trial: FrozenTrial, why: str) -> bool:
    """FAIL a RUNNING trial as lost; False when another process ended it first. (Optuna has no public
    call to fail another process's trial; this is what its ``fail_stale_trials`` does.)"""
    from optuna.trial import TrialState
    storage = study._storage
    with contextlib.suppress(Exception):  # ended meanwhile: the state change below says so
        storage.set_trial_user_attr(trial._trial_id, "error", why)
        storage.set_trial_user_attr(trial._trial_id, LOST_ATTR, {"trial": trial.number, "why": why})
    try:
        return bool(storage.set_trial_state_values(trial._trial_id, TrialState.FAIL))
    except Exception:  # already finished (UpdateFinishedTrialError): not ours to fail
        return False


def _retry(study: optuna.study.Study, trial: FrozenTrial, max_retry: int | None) -> bool:
    """Enqueue a retry of ``trial`` with its parameters; False when ``max_retry`` forbids it."""
    history = trial.system_attrs.get("retry_history") or []
    if max_retry is not None and len(history) + 1 > max_retry:
        return False
    retry_callback(max_retry)(study, study._storage.get_trial(trial._trial_id))
    return True


def fail_orphaned_trials(study: optuna.study.Study, pids: Iterable[int], *, max_retry: int | None = 3,
                         retry: bool = True) -> list[int]:
    """FAIL the RUNNING trials of dead workers (``pids`` on this host) as lost and, with ``retry``,
    enqueue their retries (the journal storage has no heartbeat to do it)."""
    from optuna.trial import TrialState
    dead, host = set(pids), socket.gethostname()
    failed: list[int] = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who = trial.user_attrs.get(WORKER_ATTR)
        if isinstance(who, dict) and who.get("host") == host and who.get("pid") in dead \
                and _fail_lost(study, trial, f"worker process {who.get('pid')} died"):
            failed.append(trial.number)
            if retry:
                _retry(study, trial, max_retry)
    return failed


def reclaim(study: optuna.study.Study, max_retry: int | None, *, unretried: bool = True,
            not_of: str | None = None) -> list[str]:
    """Fail the RUNNING trials whose process is provably gone (not those of launch ``not_of``) and, with
    ``unretried``, retry every lost trial that has none; one line per trial touched."""
    from optuna.trial import TrialState
    lines: list[str] = []
    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in (t.system_attrs.get("retry_history") or [])}
    for trial in trials:
        who = trial.user_attrs.get(WORKER_ATTR)
        if trial.state is TrialState.RUNNING and isinstance(who, Mapping) and process_gone(who) \
                and (not_of is None or who.get("launch") != not_of):
            why = f"its worker process {who['pid']} on this host is gone"
            if not _fail_lost(study, trial, why):
                continue
            what = f"trial {trial.number} was RUNNING, but {why}: FAIL"
        elif unretried and trial.state is TrialState.FAIL and trial.number not in retried and lost_why(trial):
            what = f"trial {trial.number} was lost ({lost_why(trial)})"
        else:
            continue
        if _retry(study, trial, max_retry):
            lines.append(f"{what}; re-enqueued with its parameters, to resume from its checkpoint")
        else:
            lines.append(f"{what}; not retried: it was retried max_retry={max_retry} times already")
    return lines
