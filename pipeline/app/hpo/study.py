"""Running a study: ``prepare`` checks everything before a file, folder or table exists; ``run_study``
creates it, retries what earlier runs lost, and runs its trials here or in K worker processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fsmtrain.app.config import RunConfig
from fsmtrain.app.config.problems import config_error
from fsmtrain.app.config.schema import STUDY_NAME_RE
from fsmtrain.app.hpo.monitor import Monitor
from fsmtrain.app.hpo.recovery import fail_orphaned_trials, reclaim, running, start_time
from fsmtrain.app.hpo.storage import (
    DB_FILE,
    JOURNAL_FILE,
    StorageError,
    StorageKind,
    StorageSpec,
    default_storage,
    existing_directions,
    open_storage,
    parse_storage,
    release_dead_holders_lock,
)
from fsmtrain.app.hpo.trial import TrialPlan
from fsmtrain.app.hpo.worker import INTERRUPTED, StudyPlan, quiet_optuna, work, worker_main
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.signals import HANDLED, sigterm_interrupts

if TYPE_CHECKING:
    import optuna

__all__ = ["StudyPlan", "check_study", "prepare", "run_study"]


def check_study(cfg: RunConfig, config_path: str, *, study: str | None = None, storage: str | None = None,
                workers: int = 1) -> tuple[str, StorageSpec]:
    """The checks that need the storage (reads only): it parses and can be reached, a SQLite file is not
    shared by workers, and no study of that name has another direction."""
    opt = cfg.optimize
    if opt is None:
        raise config_error("optimize", "an optimize: section (study, search space) for fsmtrain hpo", "none",
                           config_path)
    name = study or opt.study_name or cfg.name or Path(config_path).stem
    if study is not None and not STUDY_NAME_RE.match(study):
        raise config_error("--study", "a study name that is one folder name: letters, digits, '.', '_', '-'",
                           repr(study), config_path)
    source = "--storage" if storage is not None else "optimize.storage"
    text = storage if storage is not None else opt.storage
    study_dir = Path("runs") / cfg.project / name
    try:
        spec = default_storage(study_dir, workers) if text is None else parse_storage(text, source)
        if spec.kind is StorageKind.SQLITE and workers > 1:
            raise config_error("--workers", "1 with a SQLite storage, which is not safe for concurrent writers (leave "
                               "out --storage for a journal file, or use a database URL)", str(workers), config_path)
        directions = existing_directions(spec, name)
    except StorageError as exc:
        raise config_error(exc.source, exc.expected, exc.found, config_path) from None
    if directions is None and any(study_dir.glob("trial-*")):
        # a new study here would number its trials from 0 again, into the run dirs of one stored elsewhere
        held = [f for f in (DB_FILE, JOURNAL_FILE) if (study_dir / f).is_file()]
        where = f" ({', '.join(held)} there)" if held else ""
        blamed = "--workers" if text is None and workers > 1 else source
        raise config_error(blamed, f"the storage that holds the trials already in {study_dir}{where}, or another "
                           "--study name", f"{spec.shown}, which holds no study {name!r}", config_path)
    if directions is not None and directions != [opt.direction]:
        raise config_error("optimize.direction", f"{directions[0]}, the direction of the existing study {name!r} in "
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
    trial = TrialPlan(data, config_path, name, str(Path("runs") / cfg.project / name), seeds, opt.direction,
                      uuid.uuid4().hex[:12], dict(opt.search_space))
    limit = timeout if timeout is not None else opt.timeout
    return StudyPlan(trial, spec, opt, n_trials or opt.n_trials, None if limit is None else time.time() + limit,
                     workers)


def _create(plan: StudyPlan) -> optuna.study.Study:
    import optuna
    quiet_optuna()
    storage = open_storage(plan.storage, None)
    study = optuna.create_study(study_name=plan.trial.study, storage=storage, direction=plan.optimize.direction,
                                load_if_exists=True)
    if "fsmtrain" not in study.user_attrs:
        opt = plan.optimize
        study.set_user_attr("fsmtrain", {
            "config": plan.trial.source, "study_dir": plan.trial.study_dir, "seeds": list(plan.trial.seeds),
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
    print(f"storage: {plan.storage.kind.value}: {plan.storage.shown}", file=out)
    print("open it: " + "\n         ".join(plan.storage.open_hints(name)), file=out)
    print(f"runs:    {plan.trial.study_dir}/trial-<n>-seed<s>/", file=out, flush=True)


_PRELOAD = [
    "fsmtrain.app.hpo.worker", "fsmtrain.app.job", "fsmtrain.callbacks", "optuna",
    "torch._dynamo",  # what the first torch.optim.Optimizer() imports: seconds, paid once here
]


class HelperDied(Exception):
    """The forkserver that starts the workers died: it reports every worker it started as ended."""


class _Workers:
    def __init__(self, plan: StudyPlan, out: TextIO) -> None:
        self.plan, self.out = plan, out
        # not fork: this process holds storage connections a child must not share; the fork server
        # imports torch and the trial code once, so K workers start in about the time of one import
        self.ctx: Any = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(_PRELOAD)
        self.shared = self.ctx.Value("i", self.plan.n_trials)
        self.procs: dict[int, Any] = {}
        self.started: dict[int, int | None] = {}  # pid: start time, to tell the worker from a reused pid
        self.crashed: list[str] = []
        self.spawned = 0

    def start(self, index: int) -> None:
        proc = self.ctx.Process(target=worker_main, args=(self.plan, self.shared, index), name=f"fsmtrain-hpo-{index}")
        proc.start()
        self.procs[index] = proc
        self.started[proc.pid] = start_time(proc.pid)
        self.spawned += 1

    def _running(self, proc: Any) -> bool:
        return running(proc.pid, self.started[proc.pid])

    def reap(self, study: optuna.study.Study) -> None:
        """FAIL (and re-enqueue) the trials of workers that died, and replace them while trials remain.
        A worker reported ended while its process still runs means the forkserver died: HelperDied."""
        ended = {i: p for i, p in self.procs.items() if p.exitcode not in (None, 0, INTERRUPTED)}
        if any(self._running(p) for p in ended.values()):
            raise HelperDied
        for index, proc in ended.items():
            del self.procs[index]
            how = f"signal {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"code {proc.exitcode}"
            if release_dead_holders_lock(self.plan.storage):
                print(f"warning: released the journal lock worker {index} held when it died", file=self.out)
            failed = fail_orphaned_trials(study, [proc.pid], max_retry=self.plan.optimize.max_retry)
            left = f"; its trial(s) {failed} FAIL, retry enqueued" if failed else ""
            self.crashed.append(f"worker {index} (pid {proc.pid}) ended with {how}{left}")
            print(f"warning: {self.crashed[-1]}", file=self.out, flush=True)
            if self.spawned < 3 * self.plan.workers and self.shared.value > 0:  # a retry takes a trial too
                self.start(index)  # with a sampler seed of its own (claim_sampler_seed)

    def alive(self) -> bool:
        return any(p.exitcode is None for p in self.procs.values())

    def stop(self, study: optuna.study.Study, signum: int) -> list[int]:
        """Send every worker ``signum`` (SIGKILL after 60 s), waiting on the pids; the trials left
        RUNNING, now FAILed (not retried)."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in HANDLED}  # a second one must not orphan them
        try:
            for sig, wait in ((signum, 60.0), (signal.SIGKILL, 10.0)):
                live = [p for p in self.procs.values() if self._running(p)]
                for proc in live:
                    if sig == signal.SIGKILL:  # stuck: a worker catches SIGTERM as it does SIGINT
                        print(f"warning: worker pid {proc.pid} did not stop within 60 s of "
                              f"{signal.Signals(signum).name}; killed (SIGKILL)", file=self.out, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, sig)
                end = time.monotonic() + wait
                while any(self._running(p) for p in live) and time.monotonic() < end:
                    time.sleep(0.05)
            release_dead_holders_lock(self.plan.storage)
            return fail_orphaned_trials(study, list(self.started), retry=False)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_study(plan: StudyPlan, out: TextIO = sys.stdout) -> int:
    """Create (or load) the study and run it: exit 0; 1 when a worker or the forkserver died or every
    trial failed; 128 + the signal that stopped it."""
    try:
        with sigterm_interrupts():
            Path(plan.trial.study_dir).mkdir(parents=True, exist_ok=True)
            study = _create(plan)
            plan = replace(plan, prior_trials=len(study.get_trials(deepcopy=False)))
            _header(plan, out)
            for line in reclaim(study, plan.optimize.max_retry):
                print(line, file=out, flush=True)
    except KeyboardInterrupt as exc:  # e.g. a storage that waits for its lock or its server
        signum = Interrupted.signal_of(exc)
        print(f"interrupted: study {plan.trial.study}: {signal.Signals(signum).name} while the study was being "
              "opened; no trial started", file=out, flush=True)
        return 128 + signum
    monitor = Monitor(study, plan.trial.launch, plan.n_trials, out, live=out.isatty())
    stopped_by: int | None = None  # the signal that stopped the study
    crashed: list[str] = []
    if plan.workers == 1:
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.5):
                monitor.poll()
        watcher = threading.Thread(target=watch, name="fsmtrain-hpo-monitor", daemon=True)
        watcher.start()
        try:
            work(plan, mp.Value("i", plan.n_trials))
        except KeyboardInterrupt as exc:
            stopped_by = Interrupted.signal_of(exc)
        finally:
            stop.set()
            watcher.join()
    else:
        workers = _Workers(plan, out)
        with sigterm_interrupts():
            for index in range(plan.workers):
                workers.start(index)
            try:
                while workers.alive():
                    monitor.poll()
                    workers.reap(study)
                    time.sleep(0.5)
                workers.reap(study)
            except KeyboardInterrupt as exc:
                stopped_by = Interrupted.signal_of(exc)
                workers.stop(study, stopped_by)
            except HelperDied:
                failed = workers.stop(study, signal.SIGTERM)
                workers.crashed.append("the forkserver")
                print(f"error: the forkserver process that starts this command's workers died; the study was "
                      f"stopped: its workers stopped (SIGTERM), their running trials FAIL as lost "
                      f"({sorted(failed) or 'each worker failed its own'}), and the next `fsmtrain hpo` on the "
                      f"study retries them", file=out, flush=True)
        crashed = workers.crashed
    monitor.poll()
    counts = monitor.finish(plan, interrupted=stopped_by is not None)
    if stopped_by is not None:
        return 128 + stopped_by
    failed_all = counts.get("FAIL", 0) > 0 and counts.get("FAIL", 0) == sum(counts.values())
    return 1 if crashed or failed_all else 0

