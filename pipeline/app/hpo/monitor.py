"""What ``fsmtrain hpo`` shows while a study runs: a line per finished trial, a status line on a
terminal, and a summary. It reads the study's storage, so every kind of worker shows the same."""

from __future__ import annotations

import shlex
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fsmtrain.app.hpo.storage import RUN_DIRS_ATTR, WORKER_ATTR
from fsmtrain.app.hpo.trial import ERROR_ATTR, SEEDS_ATTR
from fsmtrain.app.hpo.worker import StudyPlan
from fsmtrain.callbacks.pruner import validation_label

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial


__all__ = ["Monitor", "describe_trial", "format_params"]


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def format_params(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_number(v) if isinstance(v, float) else v}" for k, v in params.items())


def _first_run_dir(trial: FrozenTrial) -> str | None:
    """The trial's first run dir, relative to the working directory when it lies under it."""
    dirs = trial.user_attrs.get(RUN_DIRS_ATTR)
    if not (isinstance(dirs, dict) and dirs):
        return None
    path = Path(next(iter(dirs.values())))
    return str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)


def describe_trial(trial: FrozenTrial) -> str:
    """``trial 3 COMPLETE 0.0123 lr=0.003 (4.1 s) -> runs/...``: one finished trial on one line."""
    state = trial.state.name
    if state == "COMPLETE":
        what = _number(trial.value)
        seeds = trial.user_attrs.get(SEEDS_ATTR)
        bad = [s for s, v in seeds.items() if v == "NaN"] if isinstance(seeds, dict) else []
        what += f" (seed {bad[0]} diverged: NaN)" if bad else ""
    elif state == "PRUNED":
        pruned = trial.user_attrs.get("pruned") or {}
        what = f"at {validation_label(pruned, last_step=trial.last_step)}" + \
            (f" by {pruned['pruner']}" if pruned.get("pruner") else "")
    elif state == "FAIL":
        what = str(trial.user_attrs.get(ERROR_ATTR, "its worker stopped beating (heartbeat stale): retried"))
    else:
        what = ""
    took = "" if trial.duration is None else f" ({trial.duration.total_seconds():.1f} s)"
    run_dir = _first_run_dir(trial)
    tail = f" -> {run_dir}" if run_dir and state != "FAIL" else ""
    retry = trial.system_attrs.get("failed_trial")
    again = f" (retry of trial {retry})" if retry is not None else ""
    return f"trial {trial.number}{again} {state} {what}  {format_params(trial.params)}{took}{tail}".rstrip()


class Monitor:
    """Polls the study; ``poll`` prints trials that finished since the last call."""

    def __init__(self, study: optuna.study.Study, launch: str, total: int, out: TextIO, *, live: bool) -> None:
        from optuna.trial import TrialState
        self.study, self.launch, self.total, self.out, self.live = study, launch, total, out, live
        self._finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        self.seen = {t.number for t in study.get_trials(deepcopy=False, states=self._finished)}
        self._lock = threading.Lock()  # the in-process watcher thread and the final poll

    def _launched_here(self, trial: FrozenTrial) -> bool:
        who = trial.user_attrs.get(WORKER_ATTR)
        return isinstance(who, dict) and who.get("launch") == self.launch

    def poll(self) -> None:
        with self._lock:
            try:
                trials = self.study.get_trials(deepcopy=False)
            except Exception:  # a busy database: the next poll shows it
                return
            lines = [describe_trial(t) for t in trials if t.state in self._finished and t.number not in self.seen]
            self.seen.update(t.number for t in trials if t.state in self._finished)
            clear, status = ("\r\x1b[K", self._status_line(trials)) if self.live else ("", "")
            self.out.write(clear + "".join(line + "\n" for line in lines) + status)
            self.out.flush()

    def _status_line(self, trials: list[FrozenTrial]) -> str:
        mine = Counter(t.state.name for t in trials if self._launched_here(t))
        done = mine["COMPLETE"] + mine["PRUNED"] + mine["FAIL"]
        best = self._best(trials)
        shown = f"best {_number(best.value)} (trial {best.number})" if best is not None else "best -"
        return (f"[{done}/{self.total}] running {mine['RUNNING']}, pruned {mine['PRUNED']}, "
                f"failed {mine['FAIL']} | {shown}")

    def _best(self, trials: list[FrozenTrial]) -> FrozenTrial | None:
        done = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None]
        pick = max if self.study.direction.name == "MAXIMIZE" else min
        return pick(done, key=lambda t: t.value, default=None)  # type: ignore[arg-type, return-value]

    def finish(self, plan: StudyPlan, *, interrupted: bool) -> Counter[str]:
        """The summary; returns this command's trials by state."""
        with self._lock:
            trials = self.study.get_trials(deepcopy=False)
            mine = Counter(t.state.name for t in trials if self._launched_here(t))
            total = Counter(t.state.name for t in trials)
            parts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(mine.items()))
            lines = [f"{'interrupted: ' if interrupted else ''}study {plan.trial.study}: this run "
                     f"{sum(mine.values())} trial(s) ({parts or 'none'}); the study holds {sum(total.values())}"]
            if total["RUNNING"]:
                lines.append(f"  {total['RUNNING']} trial(s) still RUNNING on other workers")
            if total["WAITING"]:
                lines.append(f"  {total['WAITING']} trial(s) WAITING (retries, with their parameters): the next "
                             "`fsmtrain hpo` on this study runs them first, resuming their runs")
            best = self._best(trials)
            if best is None:
                lines.append("  no completed trial yet")
            else:
                run_dir = _first_run_dir(best)
                sets = " ".join(f"--set {shlex.quote(f'{k}={v}')}" for k, v in best.params.items())
                lines += [f"best: trial {best.number}, value {_number(best.value)}: {format_params(best.params)}",
                          *([f"  run dir: {run_dir}"] if run_dir else []),
                          f"  train it: fsmtrain train {shlex.quote(plan.trial.source)} {sets}"]
            lines.append(f"report: {plan.storage.open_hints(plan.trial.study)[-1]}")
            self.out.write(("\r\x1b[K" if self.live else "") + "".join(line + "\n" for line in lines))
            self.out.flush()
            return mine
