"""One trial of a study: each seed an ordinary run in ``<study dir>/trial-<n>-seed<s>/``, the value the
mean of the seeds' objectives (a diverged seed: the worst value, and the trial ends); the first seed
reports its validations for pruning; an exception FAILs the trial, a signal FAILs it as lost."""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsmtrain.app.config import ConfigError, RunConfig, SearchParam, config_from_dict, trial_data
from fsmtrain.app.hpo.recovery import LOST_ATTR, say, worker_identity
from fsmtrain.app.hpo.storage import RUN_DIRS_ATTR, WORKER_ATTR
from fsmtrain.app.rundir import in_use
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.events import jsonable
from fsmtrain.core.signals import installed
from fsmtrain.core.stop import StopReason

if TYPE_CHECKING:
    import optuna

    from fsmtrain.app.job import SeedRun

__all__ = [
    "ERROR_ATTR", "RESUME_ATTR", "SEEDS_ATTR", "TRACEBACK_ATTR", "TrialPlan", "run_trial", "suggest",
    "trial_config",
]

SEEDS_ATTR = "seed_objectives"
"""``{seed: objective}`` of the seeds that ran (``"NaN"`` for a diverged one)."""
ERROR_ATTR = "error"
TRACEBACK_ATTR = "traceback"
RESUME_ATTR = "resume"
"""On a retried trial: what happened to the run dirs of the trial it retries."""
LOCK_WAIT_S = 600.0  # a retry waits this long for the run it continues to be let go


@dataclass(frozen=True)
class TrialPlan:
    """What a worker needs to run trials (picklable: it crosses into spawned workers)."""

    data: Mapping[str, Any]  # the config mapping, --set overrides applied
    source: str  # the config file as given, for messages and the printed commands
    study: str
    study_dir: str  # runs/<project>/<study>
    seeds: tuple[int, ...]
    direction: str
    launch: str  # the id of the `fsmtrain hpo` command that runs it
    space: Mapping[str, SearchParam] = field(default_factory=dict)


def suggest(trial: optuna.trial.Trial, path: str, param: SearchParam) -> Any:
    """Ask the trial for the value of ``path`` (the parameter's name is its config path)."""
    if param.type == "categorical":
        return trial.suggest_categorical(path, list(param.choices or []))
    assert param.low is not None and param.high is not None  # checked by SearchParam
    if param.type == "int":
        step = int(param.step) if param.step is not None else 1
        return trial.suggest_int(path, int(param.low), int(param.high), step=step, log=param.log)
    return trial.suggest_float(path, float(param.low), float(param.high), step=param.step, log=param.log)


def trial_config(plan: TrialPlan, params: Mapping[str, Any]) -> RunConfig:
    """The study's config with ``params`` set, without ``optimize`` (what ``fsmtrain train`` reproduces)."""
    return config_from_dict(trial_data(plan.data, params), f"{plan.source} (trial parameters {dict(params)})")


def _retry_of(trial: optuna.trial.Trial) -> tuple[int | None, dict[int, Path]]:
    """The number of the trial this one retries (set by Optuna's retry callback), and its run dirs."""
    number = trial.storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
    if not isinstance(number, int):
        return None, {}
    dirs = trial.user_attrs.get(RUN_DIRS_ATTR)
    return number, {int(seed): Path(path) for seed, path in dirs.items()} if isinstance(dirs, Mapping) else {}


def _resume_dir(trial: optuna.trial.Trial, previous: Mapping[int, Path], seed: int) -> Path | None:
    """A retried trial's seed continues in place the run of the trial it retries when that committed a
    checkpoint; otherwise it starts over in its own dir. The trial's ``resume`` attribute says which."""
    from fsmtrain.training.resume import ResumeError, find_resumption
    old = previous.get(seed)
    if old is None or not (old / "events.jsonl").is_file():
        return None
    said = {"seed": seed, "previous_run_dir": str(old), "resumed": False}
    if not _let_go(trial, old):
        trial.set_user_attr(RESUME_ATTR, {**said, "why": f"still in use by another process after {LOCK_WAIT_S:.0f} s"})
        return None
    try:
        found = find_resumption(old)
    except ResumeError as exc:
        trial.set_user_attr(RESUME_ATTR, {**said, "why": str(exc)})
        return None
    trial.set_user_attr(RESUME_ATTR, {**said, "resumed": True, "from_checkpoint": found.shown,
                                      "next_epoch": found.next_epoch + 1, "global_step": found.global_step})  # from 1
    return old


def _let_go(trial: optuna.trial.Trial, old: Path) -> bool:
    """Wait until no live process holds ``old`` (a worker stalled past the heartbeat's grace period)."""
    if not in_use(old):
        return True
    say(f"trial {trial.number}: {old} is still in use by the process the trial it retries was failed under; "
        f"waiting for that run to stop (at most {LOCK_WAIT_S:.0f} s)")
    deadline = time.monotonic() + LOCK_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.5)
        _stop_if_signalled()
        if not in_use(old):
            say(f"trial {trial.number}: {old} was let go; resuming there")
            return True
    say(f"trial {trial.number}: {old} is still in use after {LOCK_WAIT_S:.0f} s; this retry starts over in its own "
        "run dir")
    return False


def run_trial(trial: optuna.trial.Trial, plan: TrialPlan) -> float:
    """The objective: train every seed of the trial (see the module docstring for the rules)."""
    import optuna

    from fsmtrain.app.job import train_seed
    worst = -math.inf if plan.direction == "maximize" else math.inf
    objectives: dict[str, float] = {}
    run_dirs: dict[str, str] = {}
    try:
        trial.set_user_attr(WORKER_ATTR, worker_identity(plan.launch))
        retry_of, previous = _retry_of(trial)
        params = {path: suggest(trial, path, p) for path, p in plan.space.items()}
        cfg = trial_config(plan, params)
        hpo = {"study": plan.study, "trial": trial.number, "params": params, "retry_of": retry_of}
        for index, seed in enumerate(plan.seeds):
            _stop_if_signalled()  # a signal after an earlier seed's run ended: the trial is lost, not run on
            resume_from = _resume_dir(trial, previous, seed)
            run_dir = resume_from or Path(plan.study_dir) / f"trial-{trial.number}-seed{seed}"
            run_dirs[str(seed)] = str(run_dir.absolute())
            trial.set_user_attr(RUN_DIRS_ATTR, dict(run_dirs))  # before training: a killed trial still names it
            run = train_seed(cfg, seed, run_dir, trial=trial if index == 0 else None, extras={"hpo": hpo},
                             resume=resume_from is not None)
            result = run.result
            error = _error_of(trial, run)
            if error is not None:
                raise error
            assert result is not None
            pruned = result.stop_reason is StopReason.PRUNED
            diverged = not pruned and not math.isfinite(result.objective)  # its reason's objective is inf
            objectives[str(seed)] = math.nan if diverged else result.objective
            trial.set_user_attr(SEEDS_ATTR, jsonable(objectives))
            if pruned:
                raise optuna.TrialPruned(result.stop.message if result.stop else "pruned")
            if diverged:
                return worst  # the remaining seeds are not run
        return statistics.fmean(objectives.values())
    except KeyboardInterrupt as exc:
        signum = Interrupted.signal_of(exc)
        why = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"interrupted ({signal.Signals(signum).name})"
        trial.set_user_attr(ERROR_ATTR, why)
        trial.set_user_attr(LOST_ATTR, {"trial": trial.number, "why": why})  # retried next run
        raise
    except optuna.TrialPruned:
        raise
    except Exception as exc:
        # A trial another process already finished takes no more attributes: the worker says why it ended.
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            said = " ".join(str(exc).split())
            trial.set_user_attr(ERROR_ATTR, (said if isinstance(exc, ConfigError) else
                                             f"{type(exc).__name__}: {said}")[:500])
            trial.set_user_attr(TRACEBACK_ATTR, "".join(traceback.format_exception(exc)))
        raise


def _error_of(trial: optuna.trial.Trial, run: SeedRun) -> BaseException | None:
    """What a seed's run raises in its trial: its error, KeyboardInterrupt for a run a signal stopped,
    nothing for a signal after the run had ended for its own reason (the run counts)."""
    result = run.result
    if result is not None and result.stop_reason is StopReason.INTERRUPTED:
        return run.error if isinstance(run.error, KeyboardInterrupt) else KeyboardInterrupt()
    signals = installed()
    if isinstance(run.error, KeyboardInterrupt) and result is not None and signals is not None and signals.signum:
        say(f"trial {trial.number}: {signals.name} came after the run of seed {run.seed} had ended "
            f"({result.stop_reason.value}): the run counts; no further trial starts")
        return None
    return run.error


def _stop_if_signalled() -> None:
    signals = installed()
    if signals is not None:
        signals.raise_if_signalled()
