"""HPO never repeats and never forgets: real studies on real storage, real
processes killed with real signals.

- a replacement worker gets a sampler seed no earlier worker of the study took;
- a trial lost to Ctrl-C or a killed process is retried with its parameters when the study runs
  again, and its run resumes from its checkpoint;
- on SQLite a trial whose process is provably gone is failed at once, not after the grace period;
- ``--n-trials N`` is N trials run by the command, retries included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpo_support import journal, load, popen, study_config, wait_for
from optuna.trial import TrialState

from fsmtrain.app.hpo.recovery import LOST_ATTR, process_gone, reclaim, worker_identity
from fsmtrain.app.hpo.storage import RUN_DIRS_ATTR, WORKER_ATTR
from fsmtrain.app.hpo.worker import claim_sampler_seed, seeds_used
from fsmtrain.tools.audit import audit_file

# long enough to be caught running: at least 1 s, on any machine
MID_TRIALS: dict[str, Any] = {
    "epochs": 20, "early_stopping": {"enabled": False},
    "callbacks": {"extra": [{"target": "tests.hpo_callbacks.SlowEpochs", "kwargs": {"seconds": 0.05}}]},
}
SEEDED = {"sampler": "RandomSampler", "sampler_config": {"seed": 0}, "pruner": "NopPruner"}  # a retry runs to its end


# --- the parts, fast -------------------------------------------------------------------------------
def test_a_process_is_gone_only_when_this_host_can_prove_it() -> None:
    me = worker_identity("launch")
    assert not process_gone(me)  # this very process
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    gone = {**me, "pid": done.pid, "started": None}
    assert process_gone(gone)  # exited and reaped: no such pid
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 30,
                 "the child to exit (unreaped)")
        assert process_gone({**me, "pid": zombie.pid})  # exited, not yet reaped by its parent
    finally:
        zombie.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = Path(f"/proc/{alive.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        assert not process_gone({**me, "pid": alive.pid, "started": int(started)})
        assert process_gone({**me, "pid": alive.pid, "started": int(started) + 1})  # the pid was reused
        # what cannot be told from here is never "gone"
        assert not process_gone({**gone, "host": socket.gethostname() + "-elsewhere"})
        assert not process_gone({**gone, "boot": "another-boot"})
        assert not process_gone({**gone, "pidns": "pid:[1]"})
        assert not process_gone({"host": me["host"], "pid": done.pid, "launch": "old"})  # an older record
    finally:
        alive.kill()
        alive.wait()


def test_a_retry_just_taken_by_a_worker_is_not_failed_for_the_lost_trials_process(tmp_path: Path) -> None:
    """A retry carries the lost trial's worker record until the worker that took it (RUNNING) records
    itself. In that gap another worker's check before its next trial must not read the first run's
    dead process as the retry's and fail it (the worker running it would die on "Cannot tell a FAIL
    trial")."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=journal(tmp_path / "study.journal"))
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    lost = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)})
    lost.set_user_attr(WORKER_ATTR, {**worker_identity("first-run"), "pid": done.pid, "started": None})
    lost.set_user_attr(RUN_DIRS_ATTR, {"0": str(tmp_path / "trial-0-seed0")})
    assert reclaim(study, 3) == [f"trial 0 was RUNNING, but its worker process {done.pid} on this host is gone: "
                                 "FAIL; re-enqueued with its parameters, to resume from its checkpoint"]
    taken = study.ask()  # a worker takes the retry (RUNNING) and has not recorded itself yet
    assert taken.number == 1 and study.trials[1].system_attrs["failed_trial"] == 0
    assert reclaim(study, 3, unretried=False) == []  # another worker, before its next trial
    study.tell(taken, 0.5)
    retry = study.trials[1]
    assert retry.state is TrialState.COMPLETE
    # it resumes the lost trial's runs and knows it is a retry of a lost trial; its process is its own
    assert retry.user_attrs[RUN_DIRS_ATTR] == {"0": str(tmp_path / "trial-0-seed0")}
    assert retry.user_attrs[LOST_ATTR]["trial"] == 0 and WORKER_ATTR not in retry.user_attrs


def test_a_worker_never_takes_a_sampler_seed_an_earlier_worker_took() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.InMemoryStorage()
    optuna.create_study(study_name="s", storage=storage)
    said: list[str] = []

    def claim(worker: int, launch: str, prior: int = 0) -> int:
        return claim_sampler_seed(storage, "s", 7, worker=worker, launch=launch, prior_trials=prior,
                                  who={"pid": 100 + worker}, say=said.append)

    assert [claim(0, "a"), claim(1, "a")] == [7, 8]  # a fresh study: the configured seed, worker k adds k
    assert said == []
    again = claim(0, "a")  # the replacement of worker 0 in the same command
    assert again not in (7, 8) and said == [f"worker 0: sampler seed {again}, since seed 7 was taken by an earlier "
                                            "worker of the study (by process 100): a seed proposes what it proposed "
                                            "before"]
    third = claim(0, "a")
    later = [claim(0, "b", prior=5), claim(1, "b", prior=5), claim(0, "b", prior=5)]
    taken = [7, 8, again, third, *later]
    assert len(set(taken)) == len(taken)
    study_id = storage.get_study_id_from_name("s")
    assert sorted(seeds_used(storage.get_study_system_attrs(study_id))) == sorted(taken)


# --- the found cases, for real ---------------------------------------------------------------------
def _committed(trial: optuna.trial.FrozenTrial) -> bool:
    """The trial's (first seed's) run log has committed a checkpoint: a kill leaves it one to resume from."""
    run_dir = (trial.user_attrs.get("run_dirs") or {}).get("0")
    try:
        return run_dir is not None and b'"event":"checkpoint"' in (Path(run_dir) / "events.jsonl").read_bytes()
    except OSError:
        return False


def _running(storage: Any, exclude: frozenset[int] = frozenset(), epochs: int = 2) -> Any:
    """A poll for a RUNNING trial (not in ``exclude``) that reported ``epochs`` epochs and committed a
    checkpoint: (number, pid). Reported epochs alone are not enough: the checkpoint of an epoch is
    committed once its background write is durable, which on a busy machine can be epochs later (a
    trial killed with nothing committed rightly starts over, and the test would see no resume)."""
    def poll() -> tuple[int, int] | None:
        try:
            trials = load(storage()).get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        except Exception:  # not created yet, or half created
            return None
        for t in trials:
            if (t.number not in exclude and len(t.intermediate_values) >= epochs and "worker" in t.user_attrs
                    and _committed(t)):
                return t.number, int(t.user_attrs["worker"]["pid"])
        return None
    return poll


def _kill_mid_trial(storage: Any, poll: Any, timeout: float, logs: tuple[Path, ...]) -> tuple[int, int]:
    """SIGKILL the worker of a RUNNING trial while the trial still runs: the worker is stopped while
    its trial's state is checked (a short trial can end between a poll and the kill). (number, pid)."""
    deadline = time.monotonic() + timeout
    while True:
        number, pid = wait_for(poll, max(1.0, deadline - time.monotonic()), "a running trial", logs)
        os.kill(pid, signal.SIGSTOP)
        try:
            if load(storage()).trials[number].state is TrialState.RUNNING:
                os.kill(pid, signal.SIGKILL)
                return number, pid
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _resumed(study: optuna.study.Study, number: int) -> optuna.trial.FrozenTrial:
    """The one retry of trial ``number``: COMPLETE, its parameters, its run resumed in place."""
    lost = study.trials[number]
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == number]
    assert len(retries) == 1, [(t.number, t.state.name) for t in retries]
    retry = retries[0]
    assert retry.state is TrialState.COMPLETE, (retry.number, retry.state, retry.user_attrs.get("error"))
    assert retry.params == lost.params
    old_dir = lost.user_attrs["run_dirs"]["0"]
    resume = retry.user_attrs["resume"]
    assert resume["previous_run_dir"] == old_dir and resume["resumed"] is True, resume
    assert retry.user_attrs["run_dirs"]["0"] == old_dir
    events = [json.loads(line) for line in (Path(old_dir) / "events.jsonl").read_text().splitlines()]
    # the log keeps the 0-based index; the attribute a person reads counts epochs from 1
    assert [e["payload"]["next_epoch"] + 1 for e in events if e["event"] == "resume"] == [resume["next_epoch"]]
    report = audit_file(Path(old_dir) / "events.jsonl")
    assert report.ok, report.render()
    return retry


@pytest.mark.slow
@pytest.mark.timeout(200)  # the grace period alone is 120 s
def test_a_killed_sqlite_study_is_retried_at_once_and_counts_the_retry(tmp_path: Path) -> None:
    """After `kill -9` on SQLite a re-run fails the dead trial at once, not after the 120 s grace
    period, and `--n-trials 3` counts its retry among the 3."""
    cfg = study_config(tmp_path, {"n_trials": 3, **SEEDED}, **MID_TRIALS)
    db = tmp_path / "runs" / "quickstart" / "s" / "study.db"
    url = f"sqlite:///{db}"
    first = popen("hpo", cfg, cwd=tmp_path, log=tmp_path / "first.log")
    number, pid = _kill_mid_trial(lambda: url, _running(lambda: url), 120, (tmp_path / "first.log",))
    assert pid == first.pid
    first.wait(timeout=30)
    again = popen("hpo", cfg, "--n-trials", "2", cwd=tmp_path, log=tmp_path / "again.log")
    assert again.wait(timeout=150) == 0, (tmp_path / "again.log").read_text()
    log = (tmp_path / "again.log").read_text()
    assert (f"trial {number} was RUNNING, but its worker process {pid} on this host is gone: FAIL; re-enqueued with "
            "its parameters, to resume from its checkpoint") in log
    assert "waiting for" not in log
    study = load(url)
    assert study.trials[number].state is TrialState.FAIL
    assert study.trials[number].user_attrs["lost"] == {
        "trial": number, "why": f"its worker process {pid} on this host is gone"}
    retry = _resumed(study, number)
    launches = Counter(t.user_attrs["worker"]["launch"] for t in study.trials)
    second = retry.user_attrs["worker"]["launch"]
    assert launches[second] == 2, launches  # --n-trials 2: the retry and one new trial
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trial_failed_under_its_live_worker_stops_its_run_and_the_worker_goes_on(tmp_path: Path) -> None:
    """Left open at the last stop: a heartbeat storage fails a trial whose heartbeat is older than the
    grace period, also under a live worker that stalled; that worker then died on Optuna's "Cannot
    tell a FAIL trial" (or a report to the finished trial raised in the run). Here the trial is failed
    as ``fail_stale_trials`` does it, from inside its own run (state FAIL, then the storage's stale
    callback, which enqueues the retry), before its second epoch's report."""
    extra = [{"target": "tests.hpo_callbacks.FailedElsewhere", "kwargs": {"trial": 0, "epoch": 1}}]
    cfg = study_config(tmp_path, {"n_trials": 3, **SEEDED}, epochs=4, early_stopping={"enabled": False},
                       callbacks={"extra": extra})
    url = f"sqlite:///{tmp_path / 'runs' / 'quickstart' / 's' / 'study.db'}"
    done = popen("hpo", cfg, cwd=tmp_path, log=tmp_path / "hpo.log")
    assert done.wait(timeout=240) == 0, (tmp_path / "hpo.log").read_text()
    log = (tmp_path / "hpo.log").read_text()
    assert "Traceback" not in log and "Cannot tell" not in log, log
    study = load(url)
    lost = study.trials[0]
    assert lost.state is TrialState.FAIL
    retry = _resumed(study, 0)  # the retry resumed the stopped run from its checkpoint, and completed
    assert (f"trial 0 was ended (FAIL) by another process while this worker ran it; the study's retry of it, "
            f"trial {retry.number}, runs it again") in log, log
    events = [json.loads(line) for line in (Path(lost.user_attrs["run_dirs"]["0"]) / "events.jsonl").open()]
    (first_end,) = [e for e in events if e["event"] == "transition" and e["to"] == "train_end"][:1]
    assert first_end["payload"]["reason"] == "error" and first_end["epoch"] == 1
    assert "trial 0 is already finished in the study (FAIL)" in first_end["payload"]["message"]
    assert f"so validation 2 (epoch 2, step {first_end['global_step']}) cannot be reported" in \
        first_end["payload"]["message"]
    # --n-trials 3: the trial stopped under the worker, its retry, one more; the worker went on to both
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [1, 2])
def test_trials_stopped_by_ctrl_c_are_retried_and_resume_when_the_study_runs_again(workers: int,
                                                                                   tmp_path: Path) -> None:
    """Trials stopped by Ctrl-C are not failed: a later `hpo` retries them, and their runs resume."""
    cfg = study_config(tmp_path, {"n_trials": 10, **SEEDED}, **MID_TRIALS)
    folder = tmp_path / "runs" / "quickstart" / "s"
    path = folder / ("study.journal" if workers > 1 else "study.db")
    storage = (lambda: journal(path)) if workers > 1 else (lambda: f"sqlite:///{path}")
    parent = popen("hpo", cfg, "--workers", str(workers), cwd=tmp_path, log=tmp_path / "hpo.log")
    wait_for(_running(storage), 120, "a running trial", (tmp_path / "hpo.log",))
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=120) in (130, -signal.SIGINT), (tmp_path / "hpo.log").read_text()
    trials = load(storage()).trials
    lost = [t.number for t in trials if t.state is TrialState.FAIL and t.user_attrs["lost"]["trial"] == t.number]
    stopped = [t for t in trials if t.number in lost and "run_dirs" in t.user_attrs
               and (Path(t.user_attrs["run_dirs"]["0"]) / "checkpoints").is_dir()]
    assert stopped and all(t.user_attrs["error"] == "interrupted (Ctrl-C)" for t in stopped)
    assert [t.number for t in trials if t.state is TrialState.FAIL] == lost  # every trial Ctrl-C stopped
    again = popen("hpo", cfg, "--workers", str(workers), "--n-trials", str(len(lost)), cwd=tmp_path,
                  log=tmp_path / "again.log")
    assert again.wait(timeout=240) == 0, (tmp_path / "again.log").read_text()
    log = (tmp_path / "again.log").read_text()
    study = load(storage())
    for number in lost:
        assert f"trial {number} was lost (interrupted (Ctrl-C)); re-enqueued with its parameters" in log, log
    retries = [_resumed(study, t.number) for t in stopped]
    second = retries[0].user_attrs["worker"]["launch"]
    ran = [t for t in study.trials if t.user_attrs["worker"]["launch"] == second]
    assert len(ran) == len(lost) and all(t.system_attrs["failed_trial"] in lost for t in ran)  # nothing new
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killing_one_of_two_journal_workers_five_times_repeats_nothing_and_loses_nothing(tmp_path: Path) -> None:
    """A replacement for a `kill -9`ed worker of `--workers 2` (journal) proposes new parameters, not
    the dead worker's again. Five commands on one study, each with one of its two workers killed
    mid-trial."""
    cfg = study_config(tmp_path, {"n_trials": 6, **SEEDED}, **MID_TRIALS)
    path = tmp_path / "runs" / "quickstart" / "s" / "study.journal"
    killed: list[int] = []
    seen: frozenset[int] = frozenset()
    for round_ in range(5):
        log = tmp_path / f"hpo{round_}.log"
        parent = popen("hpo", cfg, "--workers", "2", cwd=tmp_path, log=log)
        number, pid = _kill_mid_trial(lambda: journal(path), _running(lambda: journal(path), exclude=seen), 180,
                                      (log,))
        assert pid != parent.pid
        assert parent.wait(timeout=400) == 1, log.read_text()  # finished, and says a worker crashed
        text = log.read_text()
        assert f"(pid {pid}) ended with signal SIGKILL; its trial(s) [{number}] FAIL, retry enqueued" in text, text
        killed.append(number)
        seen = frozenset(t.number for t in load(journal(path)).trials)
    study = load(journal(path))
    proposed = Counter(tuple(sorted(t.params.items())) for t in study.trials if "failed_trial" not in t.system_attrs)
    assert max(proposed.values()) == 1, [p for p, n in proposed.items() if n > 1]  # no parameter set twice
    by_command = Counter(t.user_attrs["worker"]["launch"] for t in study.trials)
    assert sorted(by_command.values()) == [6] * 5, by_command  # --n-trials 6, retries included
    for number in killed:  # every killed trial completed by resume
        _resumed(study, number)
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
