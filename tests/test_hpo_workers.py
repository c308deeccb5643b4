"""Studies across processes, for real: K worker processes on the journal file, two ``fsmtrain hpo``
processes on one PostgreSQL database, a worker killed with SIGKILL, and Ctrl-C."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from hpo_support import Postgres, fsmtrain, journal, load, new_database, popen, postgres_server, study_config, wait_for
from optuna.trial import TrialState
from system_parts import POSTGRES, go_without, require

from fsmtrain.tools.audit import audit_file

# a trial long enough to be caught running: at least 4 s, on any machine
SLOW_TRIALS: dict[str, Any] = {
    "epochs": 40, "early_stopping": {"enabled": False},
    "callbacks": {"extra": [{"target": "tests.hpo_callbacks.SlowEpochs", "kwargs": {"seconds": 0.1}}]},
}


@pytest.fixture(scope="session")
def pg() -> Iterator[Postgres]:
    """A real PostgreSQL server for the session. Where PostgreSQL is missing or cannot start, its tests
    skip naming ./setup.sh, or fail under FSMTRAIN_REQUIRE_SYSTEM=1 (tests/system_parts.py)."""
    require(POSTGRES)
    root = Path(tempfile.mkdtemp(prefix="fsmtrain-pg-"))  # not under pytest's 0700 tmp: postgres must enter
    try:
        with postgres_server(root) as server:
            yield server
    except RuntimeError as exc:
        go_without(POSTGRES, f"the server did not start: {exc}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_all_finished(study: optuna.study.Study, n: int) -> None:
    trials = study.trials
    assert len(trials) == n, [(t.number, t.state.name) for t in trials]
    assert sorted(t.number for t in trials) == list(range(n))
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def _check_audited(trial: optuna.trial.FrozenTrial) -> None:
    for run_dir in trial.user_attrs["run_dirs"].values():
        report = audit_file(Path(run_dir) / "events.jsonl")
        assert report.ok, report.render()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_on_the_journal_file(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 12, "sampler": "RandomSampler"})
    proc = fsmtrain("hpo", cfg, "--workers", "2", cwd=tmp_path, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = tmp_path / "runs" / "quickstart" / "s" / "study.journal"
    assert "Optuna journal file" in proc.stdout and f"optuna-dashboard {path.relative_to(tmp_path)}" in proc.stdout
    study = load(journal(path))
    _check_all_finished(study, 12)
    assert len({t.user_attrs["worker"]["pid"] for t in study.trials}) == 2  # both workers ran trials
    for trial in study.trials:
        _check_audited(trial)
    from optuna_dashboard._storage_url import get_storage

    assert get_storage(str(path)).get_all_studies()[0].study_name == "s"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_on_postgresql(pg: Postgres, tmp_path: Path) -> None:
    url = new_database(pg, "two_workers")
    cfg = study_config(tmp_path, {"n_trials": 6, "storage": url, "sampler": "RandomSampler"})
    procs = [popen("hpo", cfg, cwd=tmp_path, log=tmp_path / f"w{i}.log") for i in range(2)]
    for i, proc in enumerate(procs):
        assert proc.wait(timeout=200) == 0, (tmp_path / f"w{i}.log").read_text()
    study = load(url)
    _check_all_finished(study, 12)
    assert len({t.user_attrs["worker"]["pid"] for t in study.trials}) == 2
    for trial in study.trials:
        _check_audited(trial)
    assert "heartbeats on" in (tmp_path / "w0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_retry_waits_for_the_stalled_worker_to_let_its_run_go(pg: Postgres, tmp_path: Path) -> None:
    """A trial failed under a worker that stalled (the heartbeat's stale check): the other process
    takes the retry while the stalled one still runs in the trial's run dir. The retry waits for the
    run to stop and be let go, then resumes it, rather than failing at once on the run dir's lock
    (those parameters would never run again)."""
    url = new_database(pg, "stalled")
    extra = [{"target": "tests.hpo_callbacks.FailedElsewhere", "kwargs": {"trial": 0, "epoch": 1, "stall": 10.0}}]
    # Three trials a process: the other one asks again within the stall whether or not its second
    # trial began before the failure (with two, it could be done before the retry existed).
    cfg = study_config(tmp_path, {"n_trials": 3, "storage": url, "sampler": "RandomSampler", "pruner": "NopPruner"},
                       epochs=4, early_stopping={"enabled": False}, callbacks={"extra": extra})
    procs = [popen("hpo", cfg, cwd=tmp_path, log=tmp_path / f"w{i}.log") for i in range(2)]
    for i, proc in enumerate(procs):
        assert proc.wait(timeout=200) == 0, (tmp_path / f"w{i}.log").read_text()
    study = load(url)
    _check_all_finished(study, 6)
    lost = study.trials[0]
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == 0]
    assert lost.state is TrialState.FAIL and retry.state is TrialState.COMPLETE, retry.user_attrs
    assert retry.user_attrs["resume"]["resumed"] is True and retry.user_attrs["run_dirs"] == lost.user_attrs["run_dirs"]
    waited = [i for i, proc in enumerate(procs) if proc.pid == retry.user_attrs["worker"]["pid"]]
    assert waited and waited != [i for i, proc in enumerate(procs) if proc.pid == lost.user_attrs["worker"]["pid"]]
    log = (tmp_path / f"w{waited[0]}.log").read_text()
    old = lost.user_attrs["run_dirs"]["0"]
    assert f"trial {retry.number}: {old} is still in use by the process the trial it retries was failed under" in log
    assert f"trial {retry.number}: {old} was let go; resuming there" in log
    _check_audited(retry)


@pytest.mark.timeout(120)
def test_a_check_that_meets_another_process_stamping_the_schema_opens_after_it(
        pg: Postgres, capsys: pytest.CaptureFixture[str]) -> None:
    """Two ``fsmtrain hpo`` on a fresh database: while one stamps the schema version of the tables it
    made, the other's check waits for it and opens after it, instead of stamping it too
    ("UniqueViolation ... alembic_version") and giving up. Here the first process's stamp is a
    transaction held open until the check waits on it, then committed."""
    import threading

    import sqlalchemy
    from optuna.storages._rdb import models

    from fsmtrain.app.hpo.storage import StorageError, existing_directions, parse_storage

    reference = optuna.storages.RDBStorage(new_database(pg, "stamp_reference"))  # the schema version to stamp
    with reference.engine.connect() as conn:
        head = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar_one()
    reference.engine.dispose()
    url = new_database(pg, "stamp_race")
    engine = sqlalchemy.create_engine(url)
    models.BaseModel.metadata.create_all(engine)  # the other process made the tables ...
    stamper = engine.connect()
    stamp = stamper.begin()  # ... and is stamping them
    stamper.execute(sqlalchemy.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                                    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"))
    stamper.execute(sqlalchemy.text("INSERT INTO alembic_version VALUES (:head)"), {"head": head})
    outcome: dict[str, Any] = {}

    def check() -> None:
        try:
            outcome["directions"] = existing_directions(parse_storage(url, "optimize.storage"), "s")
        except StorageError as exc:
            outcome["error"] = str(exc)

    checker = threading.Thread(target=check)
    checker.start()
    watcher = sqlalchemy.create_engine(pg.url, isolation_level="AUTOCOMMIT")
    try:
        with watcher.connect() as conn:
            wait_for(lambda: conn.execute(sqlalchemy.text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar(),
                     60, "the check to wait on the other process's uncommitted alembic_version table")
        stamp.commit()
    finally:
        stamper.close()
        watcher.dispose()
        checker.join(60)
        engine.dispose()
    assert outcome == {"directions": None}, outcome  # no study "s" yet: the check goes on to create it
    said = capsys.readouterr().err.splitlines()  # the retry is said on the console
    assert any("another process was setting up this database" in line and "alembic_version" in line
               and "attempt 2 of 5" in line for line in said), said


@pytest.mark.timeout(60)
def test_a_database_whose_studies_table_is_not_optunas_fails_at_once_without_a_retry(
        pg: Postgres, capsys: pytest.CaptureFixture[str]) -> None:
    """The retry above is for a duplicate only: a missing table, opening without creating, is the
    database's state, said at once and not dressed up as another process's race."""
    import sqlalchemy

    from fsmtrain.app.hpo.storage import StorageError, existing_directions, parse_storage

    url = new_database(pg, "not_optuna")
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE TABLE studies (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(StorageError) as caught:
        existing_directions(parse_storage(url, "optimize.storage"), "s")
    assert caught.value.expected == "a database that can be opened" and "version_info" in caught.value.found
    assert "another process" not in capsys.readouterr().err


class _Watch:
    """Polls one storage for a RUNNING trial of ``pid`` that reported a few epochs (one storage
    object for all polls: opening one per poll is slow enough on a loaded machine to miss trials)."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.study: optuna.study.Study | None = None

    def __call__(self) -> int | None:
        try:
            self.study = self.study or load(self.url)
            trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        except Exception:  # not created yet, or half created
            return None
        for t in trials:
            if t.user_attrs.get("worker", {}).get("pid") == self.pid and len(t.intermediate_values) >= 2:
                return t.number
        return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_is_failed_by_heartbeat_and_retried(pg: Postgres, tmp_path: Path) -> None:
    url = new_database(pg, "killed")
    cfg = study_config(tmp_path, {"n_trials": 2, "storage": url, "sampler": "RandomSampler",
                                  "heartbeat_interval": 1, "grace_period": 3}, **SLOW_TRIALS)
    victim = popen("hpo", cfg, cwd=tmp_path, log=tmp_path / "victim.log")
    # --n-trials counts the retries a command runs: one more for the victim's retry
    survivor = popen("hpo", cfg, "--n-trials", "3", cwd=tmp_path, log=tmp_path / "survivor.log")
    killed = wait_for(_Watch(url, victim.pid), 120, "a trial of the victim to run",
                      (tmp_path / "victim.log", tmp_path / "survivor.log"))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert survivor.wait(timeout=200) == 0, (tmp_path / "survivor.log").read_text()
    study = load(url)
    trials = {t.number: t for t in study.trials}
    assert trials[killed].state is TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1 and retries[0].state is TrialState.COMPLETE
    retry = retries[0]
    assert retry.params == trials[killed].params
    # The retry continued the killed trial's run in place, from its last committed checkpoint.
    old_dir = trials[killed].user_attrs["run_dirs"]["0"]
    resume = retry.user_attrs["resume"]
    assert resume["previous_run_dir"] == old_dir and resume["resumed"] is True, resume
    assert retry.user_attrs["run_dirs"]["0"] == old_dir
    events = [json.loads(line) for line in (Path(old_dir) / "events.jsonl").read_text().splitlines()]
    # the log keeps the 0-based index; the attribute a person reads counts epochs from 1
    assert [e["payload"]["next_epoch"] + 1 for e in events if e["event"] == "resume"] == [resume["next_epoch"]]
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    _check_audited(retry)
    assert f"trial {killed} FAIL" in (tmp_path / "survivor.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_local_worker_is_failed_retried_and_replaced(tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 3, "sampler": "RandomSampler"}, **SLOW_TRIALS)
    path = tmp_path / "runs" / "quickstart" / "s" / "study.journal"
    parent = popen("hpo", cfg, "--workers", "2", cwd=tmp_path, log=tmp_path / "hpo.log")

    def running() -> tuple[int, int] | None:
        if not path.exists():
            return None
        try:
            trials = load(journal(path)).get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        except KeyError:  # the journal file is there, the study not yet
            return None
        for t in trials:
            if len(t.intermediate_values) >= 2 and "worker" in t.user_attrs:
                return t.number, t.user_attrs["worker"]["pid"]
        return None

    number, pid = wait_for(running, 120, "a running trial", (tmp_path / "hpo.log",))
    os.kill(pid, signal.SIGKILL)
    assert parent.wait(timeout=200) == 1  # the study finished, but a worker crashed: say so
    log = (tmp_path / "hpo.log").read_text()
    assert f"pid {pid}) ended with signal SIGKILL; its trial(s) [{number}] FAIL, retry enqueued" in log
    study = load(journal(path))
    assert study.trials[number].state is TrialState.FAIL
    assert study.trials[number].user_attrs["error"] == f"worker process {pid} died"
    assert [t.state for t in study.trials if t.system_attrs.get("failed_trial") == number] == [TrialState.COMPLETE]
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_the_study_with_nothing_running(workers: int, tmp_path: Path) -> None:
    cfg = study_config(tmp_path, {"n_trials": 20, "sampler": "RandomSampler"}, **SLOW_TRIALS)
    parent = popen("hpo", cfg, "--workers", str(workers), cwd=tmp_path, log=tmp_path / "hpo.log")
    name = "study.journal" if workers > 1 else "study.db"
    path = tmp_path / "runs" / "quickstart" / "s" / name
    storage = (lambda: journal(path)) if workers > 1 else (lambda: f"sqlite:///{path}")
    wait_for(_running(storage), 120, "a running trial", (tmp_path / "hpo.log",))
    parent.send_signal(signal.SIGINT)
    code = parent.wait(timeout=120)
    # 130, or death by SIGINT (what a shell also shows as 130): CPython re-raises SIGINT at exit when
    # the interrupt struck inside code an extension module ran (seen during scipy's first import).
    assert code in (130, -signal.SIGINT), f"exit {code}: " + (tmp_path / "hpo.log").read_text()
    study = load(storage())
    assert not [t for t in study.trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    interrupted = [t for t in study.trials if t.state is TrialState.FAIL]
    assert interrupted and all(t.user_attrs.get("error") == "interrupted (Ctrl-C)" for t in interrupted)
    assert len(study.trials) < 20
    # The interrupted runs still ended through train_end (a worker may have been between runs, or
    # building one, when the signal came: then there is no log). A worker struck between the trial's
    # creation and naming its run dir leaves it no run_dirs at all.
    named = [t.user_attrs["run_dirs"]["0"] for t in interrupted if "run_dirs" in t.user_attrs]
    logs = [Path(d) / "events.jsonl" for d in named]
    assert any(log.exists() for log in logs)
    for log in filter(Path.exists, logs):
        report = audit_file(log)
        assert report.ok and report.explanation.stop_reason == "interrupted", report.render()
    assert "interrupted: study s" in (tmp_path / "hpo.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_after_a_trials_run_ended_keeps_its_result_and_stops_the_study(workers: int, tmp_path: Path) -> None:
    """A Ctrl-C that comes once trial 0's run has completed (in its teardown, or before the worker
    told the study) keeps the trial's result: its run ended for its own reason and its log says so,
    so the trial is not failed as interrupted (the next `hpo` would train it again). The Ctrl-C here
    comes from the run's own last ``on_train_end``, to the process group as a terminal sends it."""
    extra = [{"target": "tests.hpo_callbacks.SignalAtTheEnd", "kwargs": {"trial": 0}}]
    cfg = study_config(tmp_path, {"n_trials": 6, "sampler": "RandomSampler"}, epochs=4,
                       early_stopping={"enabled": False}, callbacks={"extra": extra})
    parent = popen("hpo", cfg, "--workers", str(workers), cwd=tmp_path, log=tmp_path / "hpo.log", session=True)
    code = parent.wait(timeout=200)
    log = (tmp_path / "hpo.log").read_text()
    assert code == 130, f"exit {code}: {log}"
    assert "Traceback" not in log, log
    assert "trial 0: SIGINT came after the run of seed 0 had ended (completed): the run counts; no further trial " \
           "starts" in log, log
    folder = tmp_path / "runs" / "quickstart" / "s"
    study = load(journal(folder / "study.journal") if workers > 1 else f"sqlite:///{folder / 'study.db'}")
    first = study.trials[0]
    run_dir = Path(first.user_attrs["run_dirs"]["0"])
    report = audit_file(run_dir / "events.jsonl")
    assert report.ok and report.explanation.stop_reason == "completed", report.render()
    (result,) = [json.loads(line) for line in (run_dir / "events.jsonl").open() if '"event":"result"' in line]
    assert first.state is TrialState.COMPLETE and first.value == result["payload"]["objective"], first
    assert "error" not in first.user_attrs and "lost" not in first.user_attrs
    if workers == 1:
        assert len(study.trials) == 1  # nothing started after it
    for other in study.trials[1:]:  # the other worker's trial: stopped in its run, or ended before the signal
        assert other.state in (TrialState.FAIL, TrialState.COMPLETE), other
        if other.state is TrialState.FAIL:
            assert other.user_attrs["error"] == "interrupted (Ctrl-C)", other.user_attrs
    assert len(study.trials) < 6
    assert "interrupted: study s" in log


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_to_the_command_stops_every_worker_as_ctrl_c_does(workers: int, tmp_path: Path) -> None:
    """SIGTERM (what a scheduler sends) to `fsmtrain hpo` stops its workers as Ctrl-C does, so none
    trains on orphaned, and the command exits 143 (128 + SIGTERM), with one worker or two."""
    cfg = study_config(tmp_path, {"n_trials": 8, "sampler": "RandomSampler"}, **SLOW_TRIALS)
    parent = popen("hpo", cfg, "--workers", str(workers), cwd=tmp_path, log=tmp_path / "hpo.log")
    folder = tmp_path / "runs" / "quickstart" / "s"
    db = f"sqlite:///{folder / 'study.db'}"
    storage = (lambda: journal(folder / "study.journal")) if workers > 1 else (lambda: db)
    wait_for(_running(storage), 120, "a running trial", (tmp_path / "hpo.log",))
    parent.send_signal(signal.SIGTERM)  # to the command's own pid only, as a scheduler's kill
    code = parent.wait(timeout=120)
    log = (tmp_path / "hpo.log").read_text()
    assert code == 143, f"exit {code}: {log}"
    assert "Traceback" not in log and "interrupted: study s" in log, log
    trials = load(storage()).trials
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    stopped = [t for t in trials if t.state is TrialState.FAIL]
    assert stopped and all(t.user_attrs["error"] == "interrupted (SIGTERM)" for t in stopped), \
        [t.user_attrs for t in stopped]
    assert len(trials) < 8
    left = [pid for pid in {t.user_attrs["worker"]["pid"] for t in trials} if _alive(pid)]
    assert not left, f"worker(s) {left} train on"
    named = [Path(t.user_attrs["run_dirs"]["0"]) / "events.jsonl" for t in stopped if "run_dirs" in t.user_attrs]
    for events in filter(Path.exists, named):
        report = audit_file(events)
        assert report.ok and report.explanation.stop_reason == "interrupted", report.render()



@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "signum"), [(1, signal.SIGTERM), (2, signal.SIGTERM), (2, signal.SIGINT)])
def test_a_signal_while_the_study_is_opened_says_so_and_starts_nothing(workers: int, signum: int,
                                                                        tmp_path: Path) -> None:
    """A signal while `fsmtrain hpo` is still opening its study (here, a journal whose lock another
    process holds; a database server that is slow to answer is the same) is not the signal's silent
    default action: the command says what it was doing and exits 128 + the signal, having started no
    trial; the storage's lock, which it never held, stays."""
    cfg = study_config(tmp_path, {"n_trials": 2, "sampler": "RandomSampler"})
    store = tmp_path / "shared.journal"
    store.touch()
    lock = Path(f"{store}.lock")
    lock.symlink_to(store)  # held, as Optuna's JournalFileSymlinkLock holds it (broken after 30 s)
    parent = popen("hpo", cfg, "--workers", str(workers), "--storage", store, cwd=tmp_path, log=tmp_path / "hpo.log",
                   session=True)
    folder = tmp_path / "runs" / "quickstart" / "s"
    wait_for(folder.is_dir, 120, "the study's folder", (tmp_path / "hpo.log",))  # made just before the study
    os.killpg(parent.pid, signum)  # the whole group, as a terminal's Ctrl-C or a scheduler's kill
    code = parent.wait(timeout=25)  # well inside the lock's 30 s grace: the study was never created
    log = (tmp_path / "hpo.log").read_text()
    assert code == 128 + signum, f"exit {code}: {log}"
    name = signal.Signals(signum).name
    assert f"interrupted: study s: {name} while the study was being opened; no trial started" in log, log
    assert "Traceback" not in log, log
    assert lock.is_symlink() and store.stat().st_size == 0  # nothing written, the other holder's lock kept
    assert not (folder / "trials").exists() and not list(folder.glob("**/events.jsonl"))


def _running(storage: Callable[[], Any]) -> Callable[[], bool]:
    """A poll: does a RUNNING trial of the study have two epochs reported?"""
    def poll() -> bool:
        try:  # the study may be half created yet
            return any(len(t.intermediate_values) >= 2
                       for t in load(storage()).get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        except Exception:
            return False

    return poll


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has ended: only its exit status waits to be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def _open_at_once(url: str, barrier: Any, results: Any) -> None:
    from fsmtrain.app.hpo.storage import StorageError, open_storage, parse_storage

    barrier.wait()
    try:
        open_storage(parse_storage(url, "optimize.storage"))
        results.put("")
    except StorageError as exc:
        results.put(str(exc))


@pytest.mark.timeout(120)
def test_workers_opening_a_fresh_sqlite_file_at_once_all_open_it(tmp_path: Path) -> None:
    """Processes opening a new SQLite file together (a watcher and the study) all open it: none dies
    with 'table trial_params already exists'. Each round is a fresh file opened by 4 processes
    released together; a race there shows in about one round in three."""
    ctx = multiprocessing.get_context("fork")  # the imports are done: each round costs milliseconds
    for round_ in range(8):
        url = f"sqlite:///{tmp_path / f'study{round_}.db'}"
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(url, barrier, results)) for _ in range(4)]
        for proc in procs:
            proc.start()
        errors = [e for e in (results.get(timeout=60) for _ in procs) if e]
        for proc in procs:
            proc.join(timeout=30)
        assert errors == [], f"round {round_}: {errors}"
