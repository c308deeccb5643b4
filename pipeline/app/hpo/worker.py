"""One worker of a study: one trial a ticket, until the tickets or the time run out. It catches
SIGINT and SIGTERM, so a signal never lands in a storage write: the trial FAILs as lost, no further
trial starts, and the worker raises ``Interrupted`` (a worker process exits 130)."""

from __future__ import annotations

import hashlib
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fsmtrain.app.config import OptimizeConfig, build_pruner, build_sampler
from fsmtrain.app.hpo.recovery import reclaim, say, worker_identity
from fsmtrain.app.hpo.storage import StorageKind, StorageSpec, open_storage
from fsmtrain.app.hpo.trial import TrialPlan, run_trial
from fsmtrain.core.signals import caught

if TYPE_CHECKING:
    import optuna
    from optuna.storages import BaseStorage

__all__ = ["INTERRUPTED", "SEED_ATTR_PREFIX", "StudyPlan", "claim_sampler_seed", "ended_elsewhere",
           "quiet_optuna", "seeds_used", "work", "worker_main"]

INTERRUPTED = 130
# Sampler seeds no two workers of a study share (a seed proposes what it proposed before): each taken
# seed is a study system attribute of its own.
SEED_ATTR_PREFIX = "fsmtrain:sampler_seed:"


def drawn_seed(*parts: object) -> int:
    """A sampler seed drawn from ``parts``, below 2**32 (what numpy's RandomState takes)."""
    digest = hashlib.sha256(":".join(["fsmtrain-sampler-seed", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def seeds_used(attrs: Mapping[str, Any]) -> dict[int, Any]:
    """The seeds recorded in a study's system attributes, with who took each."""
    return {int(key.removeprefix(SEED_ATTR_PREFIX)): who for key, who in attrs.items()
            if key.startswith(SEED_ATTR_PREFIX)}


def claim_sampler_seed(storage: BaseStorage, study: str, seed: int, *, worker: int, launch: str,
                       prior_trials: int, who: Mapping[str, Any],
                       say: Callable[[str], None] | None = None) -> int:
    """The seed worker ``worker`` of command ``launch`` takes, recorded as taken by ``who``: ``seed + worker``
    on a new study, else drawn from (seed, trials, worker), since a seed proposes what it proposed before;
    another drawn one if that is taken, and then ``say`` is told."""
    study_id = storage.get_study_id_from_name(study)
    used = seeds_used(storage.get_study_system_attrs(study_id))
    first = candidate = seed + worker if prior_trials == 0 else drawn_seed(seed, prior_trials, worker)
    attempt = 0
    while candidate in used:
        candidate = drawn_seed(seed, launch, worker, attempt)
        attempt += 1
    storage.set_study_system_attr(study_id, f"{SEED_ATTR_PREFIX}{candidate}", {**who, "worker": worker})
    if candidate != first and say is not None:
        taken = used[first]
        by = f" (by process {taken.get('pid')})" if isinstance(taken, Mapping) and taken.get("pid") else ""
        say(f"worker {worker}: sampler seed {candidate}, since seed {first} was taken by an earlier worker of "
            f"the study{by}: a seed proposes what it proposed before")
    return candidate


@dataclass(frozen=True)
class StudyPlan:
    """What one ``fsmtrain hpo`` command runs: the study, its storage, its budget and its workers."""

    trial: TrialPlan
    storage: StorageSpec
    optimize: OptimizeConfig
    n_trials: int
    deadline: float | None  # time.time() after which no trial starts
    workers: int
    prior_trials: int = 0  # trials the study held when this command started (see claim_sampler_seed)

    @property
    def heartbeat(self) -> OptimizeConfig | None:
        """Where the heartbeat settings are: a database storage's; a journal file has no heartbeat."""
        return None if self.storage.kind is StorageKind.JOURNAL else self.optimize


def take_ticket(tickets: Any) -> bool:
    """Take one of the trials a command may still start (a ``multiprocessing.Value`` its workers share)."""
    with tickets.get_lock():
        if tickets.value <= 0:
            return False
        tickets.value -= 1
        return True


def quiet_optuna() -> None:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the monitor prints one line per trial
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
    # a retry reports again the validations its lost run reported after its last checkpoint
    warnings.filterwarnings("ignore", message="The reported value is ignored because this `step=")


def _load(plan: StudyPlan, index: int) -> optuna.study.Study:
    import optuna
    storage = open_storage(plan.storage, plan.heartbeat)
    seed = None
    configured = plan.optimize.sampler_config.get("seed")
    if type(configured) is int:  # a seed no earlier worker of the study took (a replacement gets a new one)
        seed = claim_sampler_seed(storage, plan.trial.study, configured, worker=index, launch=plan.trial.launch,
                                  prior_trials=plan.prior_trials, who=worker_identity(plan.trial.launch), say=say)
    sampler = build_sampler(plan.optimize, seed=seed)
    return optuna.load_study(study_name=plan.trial.study, storage=storage, sampler=sampler,
                             pruner=build_pruner(plan.optimize))


def work(plan: StudyPlan, tickets: Any, index: int = 0) -> None:
    """One worker: one trial a ticket (enqueued retries first); a used-up grid on a heartbeat storage
    waits for the trials running elsewhere, whose retries it may still have to run."""
    with caught(escalate=False) as signals:
        stop_here = signals.raise_if_signalled if signals is not None else lambda: None  # off the main thread
        _run_trials(plan, tickets, index, stop_here)
        stop_here()  # a signal after the last trial ended: the command still ends interrupted


def _run_trials(plan: StudyPlan, tickets: Any, index: int, stop_here: Callable[[], None]) -> None:
    import optuna
    from optuna.trial import TrialState
    quiet_optuna()
    study = _load(plan, index)
    objective = partial(run_trial, plan=plan.trial)
    grid = study.sampler if isinstance(study.sampler, optuna.samplers.GridSampler) else None
    beat, waited = plan.heartbeat, False
    pause = 1.0 if beat is None else max(0.5, min(beat.heartbeat_interval / 2, 5.0))
    grace = 0 if beat is None else beat.grace_period or 2 * beat.heartbeat_interval  # Optuna's default
    siblings = plan.trial.launch if plan.workers > 1 else None  # a sibling's dead worker is its parent's to reclaim
    while plan.deadline is None or time.time() < plan.deadline:
        stop_here()
        say(*reclaim(study, plan.optimize.max_retry, unretried=False, not_of=siblings))
        if grid is not None and grid.is_exhausted(study):
            if beat is not None:
                say(*reclaim(study, plan.optimize.max_retry))  # a process gone here: no need to wait
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    optuna.storages.fail_stale_trials(study)
            states = Counter(t.state for t in study.get_trials(deepcopy=False))
            if not states[TrialState.WAITING]:
                if not (beat is not None and states[TrialState.RUNNING]):
                    return
                if not waited:
                    say(f"waiting for {states[TrialState.RUNNING]} trial(s) running elsewhere to end or go stale "
                        f"(grace period {grace} s)")
                    waited = True
                time.sleep(pause)  # another worker's trial: wait until it ends or goes stale
                continue
        if not take_ticket(tickets):
            say(*reclaim(study, plan.optimize.max_retry, unretried=False, not_of=siblings))
            waiting = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
            if waiting:  # retries this command leaves for the next one
                say(f"trial(s) {', '.join(map(str, waiting))} wait to be run (retries, or enqueued): this "
                    "command has run its --n-trials; `fsmtrain hpo` again on the study runs them")
            return
        taken: list[int] = []
        try:
            study.optimize(partial(_taking, objective, taken), n_trials=1, catch=(Exception,))
        except Exception:
            why = ended_elsewhere(study, taken)
            if why is None:
                raise
            say(why)


def _taking(objective: Callable[[Any], float], taken: list[int], trial: Any) -> float:
    taken.append(trial._trial_id)
    return objective(trial)


def ended_elsewhere(study: optuna.study.Study, taken: list[int]) -> str | None:
    """Why Optuna could not tell the trial this worker ran, when another process had already finished
    it (a stale heartbeat); None when that is not why."""
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


def worker_main(plan: StudyPlan, shared: Any, index: int) -> None:
    try:
        work(plan, shared, index)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)

