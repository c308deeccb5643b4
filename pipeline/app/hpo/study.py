"""Running a study: checks before anything exists, the study, its workers, and what they leave.

``prepare`` turns a config and the command line into a ``StudyPlan`` and raises ``ConfigError``
for every mistake before a file, folder or table is created. ``run_study`` creates the study,
retries what earlier runs lost (:mod:`pipeline.app.hpo.recovery`), and runs its trials in this
process (``workers=1``) or in K worker processes. Every trial a worker runs, a retry included,
takes one of the command's ``n_trials`` from a shared count: the command runs that many trials,
no more. A retry left over when the count is used up stays WAITING, and the summary says so; the
next ``fsmtrain hpo`` on the study runs it first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from pipeline.app.config import ConfigError, ConfigProblem, OptimizeConfig, RunConfig, build_pruner, build_sampler
from pipeline.app.hpo.monitor import Monitor
from pipeline.app.hpo.plan import StudyPlan
from pipeline.app.hpo.recovery import fail_orphaned_trials, reclaim, worker_identity
from pipeline.app.hpo.seeds import claim_sampler_seed
from pipeline.app.hpo.storage import (
    DB_FILE,
    JOURNAL_FILE,
    Heartbeat,
    StorageError,
    StorageKind,
    StorageSpec,
    default_storage,
    existing_directions,
    open_storage,
    parse_storage,
    release_dead_holders_lock,
)
from pipeline.app.hpo.trial import TrialPlan, run_trial

if TYPE_CHECKING:
    import optuna

__all__ = ["StudyPlan", "check_study", "prepare", "run_study", "study_name_for", "work"]

INTERRUPTED = 130


def study_name_for(cfg: RunConfig, config_path: str, name: str | None) -> str:
    assert cfg.optimize is not None
    return name or cfg.optimize.study_name or cfg.name or Path(config_path).stem


def _problem(path: str, expected: str, found: str, source: str | None = None) -> ConfigError:
    return ConfigError([ConfigProblem(path, expected, found)], source)


def check_study(cfg: RunConfig, config_path: str, *, study: str | None = None, storage: str | None = None,
                workers: int = 1) -> tuple[str, StorageSpec]:
    """The checks that need the storage: it parses, it can be reached, a SQLite file is not shared by
    several workers, and a study of that name does not exist with another direction. Reads only."""
    opt = cfg.optimize
    if opt is None:
        raise _problem("optimize", "an optimize: section (study, search space) for fsmtrain hpo", "none", config_path)
    name = study_name_for(cfg, config_path, study)
    if study is not None:
        try:
            OptimizeConfig(study_name=study)
        except ValueError:
            raise _problem("--study", "a study name that is one folder name: letters, digits, '.', '_', '-'",
                           repr(study), config_path) from None
    source = "--storage" if storage is not None else "optimize.storage"
    text = storage if storage is not None else opt.storage
    study_dir = Path("runs") / cfg.project / name
    try:
        spec = default_storage(study_dir, workers) if text is None else parse_storage(text, source)
        if spec.kind is StorageKind.SQLITE and workers > 1:
            raise _problem("--workers", "1 with a SQLite storage, which is not safe for concurrent writers "
                           "(leave out --storage for a journal file, or use a database URL)", str(workers), config_path)
        directions = existing_directions(spec, name)
    except StorageError as exc:
        raise _problem(exc.source, exc.expected, exc.found, config_path) from None
    if directions is None and any(study_dir.glob("trial-*")):
        # A new study in this storage would number its trials from 0 again, into run dirs that hold
        # the trials of the study stored elsewhere: every trial would fail to claim its dir.
        held = [f for f in (DB_FILE, JOURNAL_FILE) if (study_dir / f).is_file()]
        where = f" ({', '.join(held)} there)" if held else ""
        blamed = source if text is not None else "--workers"
        raise _problem(blamed, f"the storage that holds the trials already in {study_dir}{where}, or another --study "
                       "name", f"{spec.shown}, which holds no study {name!r}", config_path)
    if directions is not None and directions != [opt.direction]:
        raise _problem("optimize.direction", f"{directions[0]}, the direction of the existing study {name!r} in "
                       f"{spec.shown} (or another --study name)", opt.direction, config_path)
    return name, spec


def prepare(cfg: RunConfig, data: dict[str, Any], config_path: str, *, study: str | None = None,
            storage: str | None = None, n_trials: int | None = None, timeout: float | None = None,
            workers: int = 1) -> StudyPlan:
    """Everything checked, nothing created."""
    name, spec = check_study(cfg, config_path, study=study, storage=storage, workers=workers)
    opt = cfg.optimize
    assert opt is not None
    seeds = tuple(cfg.seeds[: opt.n_seeds] if opt.n_seeds else cfg.seeds)
    launch = uuid.uuid4().hex[:12]
    trial = TrialPlan(data, config_path, name, str(Path("runs") / cfg.project / name), seeds, opt.direction,
                      launch, dict(opt.search_space))
    heartbeat = None if spec.kind is StorageKind.JOURNAL else Heartbeat(opt.heartbeat_interval, opt.grace_period,
                                                                        opt.max_retry)
    limit = timeout if timeout is not None else opt.timeout
    return StudyPlan(trial, spec, heartbeat, opt, n_trials or opt.n_trials,
                     None if limit is None else time.time() + limit, workers, config_path)


# --- trials for the workers --------------------------------------------------------------------
class Tickets(Protocol):
    def take(self) -> bool: ...


class LocalTickets:
    def __init__(self, n: int) -> None:
        self.left = n

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


class SharedTickets:
    """A count shared by the worker processes of one command (a ``multiprocessing.Value``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self) -> bool:
        with self.value.get_lock():
            if self.value.value <= 0:
                return False
            self.value.value -= 1
            return True


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the monitor prints one line per trial
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
    # A retry resumes its run from the last checkpoint: an epoch the lost run had reported after
    # that checkpoint is reported again, and Optuna keeps the value it has. Nothing to warn about.
    warnings.filterwarnings("ignore", message="The reported value is ignored because this `step=")


def _load(plan: StudyPlan, index: int) -> optuna.study.Study:
    import optuna

    storage = open_storage(plan.storage, plan.heartbeat)
    seed = None
    configured = plan.optimize.sampler_config.get("seed")
    if type(configured) is int:  # a seed no earlier worker of the study took (a replacement gets a new one)
        seed = claim_sampler_seed(storage, plan.trial.study, configured, worker=index, launch=plan.trial.launch,
                                  prior_trials=plan.prior_trials, who=worker_identity(plan.trial.launch),
                                  say=lambda line: print(line, file=sys.stderr, flush=True))
    sampler = build_sampler(plan.optimize, worker=index, prior_trials=plan.prior_trials, seed=seed)
    return optuna.load_study(study_name=plan.trial.study, storage=storage, sampler=sampler,
                             pruner=build_pruner(plan.optimize))


def work(plan: StudyPlan, tickets: Tickets, index: int = 0) -> None:
    """One worker: one trial a ticket (a retry Optuna or an earlier run enqueued comes first), until
    the tickets or the time run out; a grid that is used up waits, on a heartbeat storage, for the
    trials running elsewhere, whose retries it may still have to run."""
    import optuna
    from optuna.trial import TrialState

    _quiet_optuna()
    study = _load(plan, index)
    objective = partial(run_trial, plan=plan.trial)
    sampler = study.sampler
    exhausted: Callable[[], bool] = (lambda: bool(sampler.is_exhausted(study))) \
        if isinstance(sampler, optuna.samplers.GridSampler) else (lambda: False)
    beating, waited = plan.heartbeat is not None, False
    pause, grace = 1.0, 0
    if plan.heartbeat is not None:
        pause = max(0.5, min(plan.heartbeat.interval / 2, 5.0))
        grace = plan.heartbeat.grace_period or 2 * plan.heartbeat.interval  # Optuna's default
    def reclaim_gone() -> None:  # a trial whose process died on this host: failed and retried at once
        # (a sibling worker of this command is its parent's to fail and retry, which says so)
        launch = plan.trial.launch if plan.workers > 1 else None
        for line in reclaim(study, plan.optimize.max_retry, unretried=False, not_of=launch):
            print(line, file=sys.stderr, flush=True)

    while not _past(plan.deadline):
        reclaim_gone()
        if exhausted():
            if beating:
                for line in reclaim(study, plan.optimize.max_retry):  # a process gone here: no need to wait
                    print(line, file=sys.stderr, flush=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    optuna.storages.fail_stale_trials(study)
            states = Counter(t.state for t in study.get_trials(deepcopy=False))
            if not states[TrialState.WAITING]:
                if not (beating and states[TrialState.RUNNING]):
                    return
                if not waited:
                    print(f"waiting for {states[TrialState.RUNNING]} trial(s) running elsewhere to end or go stale "
                          f"(grace period {grace} s)", file=sys.stderr, flush=True)
                    waited = True
                time.sleep(pause)  # another worker's trial: wait until it ends or goes stale
                continue
        if not tickets.take():
            reclaim_gone()
            _say_owed(study)
            return
        taken: list[int] = []
        try:
            study.optimize(partial(_taking, objective, taken), n_trials=1, catch=(Exception,))
        except Exception:
            why = ended_elsewhere(study, taken)
            if why is None:
                raise
            print(why, file=sys.stderr, flush=True)


def _taking(objective: Callable[[Any], float], taken: list[int], trial: Any) -> float:
    taken.append(trial._trial_id)
    return objective(trial)


def ended_elsewhere(study: optuna.study.Study, taken: list[int]) -> str | None:
    """Why Optuna could not tell the trial this worker ran, when another process had already
    finished it (a heartbeat storage fails a trial whose heartbeat is older than the grace period,
    also under a live worker that stalled); None when that is not why."""
    if not taken:
        return None
    frozen = study._storage.get_trial(taken[-1])
    if not frozen.state.is_finished():
        return None
    retries = [t.number for t in study.get_trials(deepcopy=False)  # Optuna's retry names the trials it follows
               if (t.system_attrs.get("retry_history") or [None])[-1] == frozen.number]
    then = (f"the study's retry of it, trial {retries[0]}, runs it again" if retries else
            "the study enqueued no retry of it (its max_retry is used up)")
    return (f"trial {frozen.number} was ended ({frozen.state.name}) by another process while this worker ran it; "
            f"{then}; its run keeps what it trained (its log says where it stopped); this worker goes on")


def _say_owed(study: optuna.study.Study) -> None:
    """A worker with no trial left says which retries it leaves waiting for the next worker."""
    from optuna.trial import TrialState

    waiting = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    if waiting:
        print(f"trial(s) {', '.join(map(str, waiting))} wait to be run (retries, or enqueued): this command has "
              "run its --n-trials; `fsmtrain hpo` again on the study runs them", file=sys.stderr, flush=True)


def _worker_main(plan: StudyPlan, shared: Any, index: int) -> None:
    try:
        work(plan, SharedTickets(shared), index)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)


# --- the study ---------------------------------------------------------------------------------
def _create(plan: StudyPlan) -> optuna.study.Study:
    import optuna

    _quiet_optuna()
    storage = open_storage(plan.storage, None)
    study = optuna.create_study(study_name=plan.trial.study, storage=storage, direction=plan.optimize.direction,
                                load_if_exists=True)
    if "fsmtrain" not in study.user_attrs:
        opt = plan.optimize
        study.set_user_attr("fsmtrain", {
            "config": plan.config, "study_dir": plan.trial.study_dir, "seeds": list(plan.trial.seeds),
            "sampler": opt.sampler, "sampler_config": opt.sampler_config,
            "pruner": opt.pruner, "pruner_config": opt.pruner_config,
            "search_space": {k: v.model_dump(exclude_defaults=True) for k, v in opt.search_space.items()},
        })
    return study


def _header(plan: StudyPlan, out: TextIO) -> None:
    opt, name = plan.optimize, plan.trial.study
    workers = f"{plan.workers} worker processes" if plan.workers > 1 else "1 process"
    print(f"study {name} ({opt.direction}): {plan.n_trials} trials, {workers}, "
          f"{len(plan.trial.seeds)} seed(s) a trial, sampler {opt.sampler}, pruner {opt.pruner}", file=out)
    print(f"storage: {plan.storage.describe()}", file=out)
    hints = plan.storage.open_hints(name)
    print(f"open it: {hints[0]}", file=out)
    for hint in hints[1:]:
        print(f"         {hint}", file=out)
    print(f"runs:    {plan.trial.study_dir}/trial-<n>-seed<s>/", file=out, flush=True)


_PRELOAD = [
    "pipeline.app.hpo.study", "pipeline.app.job", "callbacks", "optuna",
    "torch._dynamo",  # what the first torch.optim.Optimizer() imports: seconds, paid once here
]


@dataclass
class _Workers:
    plan: StudyPlan
    out: TextIO
    ctx: Any = None
    shared: Any = None

    def __post_init__(self) -> None:
        # Not fork: this process holds storage connections (and torch's state) a child must not
        # share. A fork server imports torch and the trial code once and forks every worker from
        # that clean process, so K workers start in about the time of one import, not K of them.
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(_PRELOAD)
        self.shared = self.ctx.Value("i", self.plan.n_trials)
        self.procs: dict[int, Any] = {}
        self.crashed: list[str] = []
        self.spawned = 0

    def start(self, index: int) -> None:
        proc = self.ctx.Process(target=_worker_main, args=(self.plan, self.shared, index), name=f"fsmtrain-hpo-{index}")
        proc.start()
        self.procs[index] = proc
        self.spawned += 1

    def reap(self, study: optuna.study.Study) -> None:
        """Note workers that died; FAIL (and re-enqueue) the trials they left RUNNING; replace them
        while trials remain."""
        for index, proc in list(self.procs.items()):
            if proc.exitcode is None or proc.exitcode in (0, INTERRUPTED):
                continue
            del self.procs[index]
            how = f"signal {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"code {proc.exitcode}"
            if release_dead_holders_lock(self.plan.storage):
                print(f"warning: released the journal lock worker {index} held when it died", file=self.out)
            failed = fail_orphaned_trials(study, [proc.pid], max_retry=self.plan.optimize.max_retry)
            left = f"; its trial(s) {failed} FAIL, retry enqueued" if failed else ""
            self.crashed.append(f"worker {index} (pid {proc.pid}) ended with {how}{left}")
            print(f"warning: {self.crashed[-1]}", file=self.out, flush=True)
            if self.spawned < 3 * self.plan.workers and self.shared.value > 0:  # a retry takes a trial too
                self.start(index)  # with a sampler seed of its own (pipeline.app.hpo.seeds)

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs.values())

    def interrupt(self, study: optuna.study.Study) -> None:
        """Ctrl-C: every worker gets SIGINT (a terminal sends it to the group; a kill to this pid
        only reaches us), ends its trial as FAIL and exits."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan them
        try:
            for proc in self.procs.values():
                if proc.exitcode is None and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGINT)
            for proc in self.procs.values():
                proc.join(timeout=60)
                if proc.exitcode is None:
                    proc.terminate()
                    proc.join(timeout=10)
                    release_dead_holders_lock(self.plan.storage)
            fail_orphaned_trials(study, [p.pid for p in self.procs.values()], retry=False)  # stopped, not lost
        finally:
            signal.signal(signal.SIGINT, previous)


def run_study(plan: StudyPlan, out: TextIO = sys.stdout, *, live: bool | None = None) -> int:
    """Create (or load) the study and run it; returns the exit code: 0, 1 when a worker crashed or
    every trial of this command failed, 130 when interrupted."""
    Path(plan.trial.study_dir).mkdir(parents=True, exist_ok=True)
    study = _create(plan)
    plan = replace(plan, prior_trials=len(study.get_trials(deepcopy=False)))
    _header(plan, out)
    for line in reclaim(study, plan.optimize.max_retry):
        print(line, file=out, flush=True)
    monitor = Monitor(study, plan.trial.launch, plan.n_trials, out,
                      live=out.isatty() if live is None else live)
    interrupted = False
    crashed: list[str] = []
    if plan.workers == 1:
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.5):
                monitor.poll()

        watcher = threading.Thread(target=watch, name="fsmtrain-hpo-monitor", daemon=True)
        watcher.start()
        try:
            work(plan, LocalTickets(plan.n_trials))
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stop.set()
            watcher.join()
    else:
        workers = _Workers(plan, out)
        for index in range(plan.workers):
            workers.start(index)
        try:
            while workers.alive():
                monitor.poll()
                workers.reap(study)
                time.sleep(0.5)
            workers.reap(study)
        except KeyboardInterrupt:
            interrupted = True
            workers.interrupt(study)
        crashed = workers.crashed
    monitor.poll()
    counts = monitor.finish(plan, interrupted=interrupted)
    if interrupted:
        return INTERRUPTED
    failed_all = counts.get("FAIL", 0) > 0 and counts.get("FAIL", 0) == sum(counts.values())
    return 1 if crashed or failed_all else 0

