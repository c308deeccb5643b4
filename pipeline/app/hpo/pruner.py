"""``PredictedFinalLossPruner``: stop a trial whose extrapolated final loss cannot beat the study,
read from the trial's ``predicted_final_loss`` attribute (the number the run's log records)."""

from __future__ import annotations

import math
from typing import Any

import optuna
from optuna.pruners import BasePruner
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from fsmtrain.callbacks.pruner import PREDICTION_ATTR

__all__ = ["PredictedFinalLossPruner"]


class PredictedFinalLossPruner(BasePruner):
    """Prune when the predicted final loss is worse than the best completed value by more than
    ``margin`` (relative: ``best + margin·|best|`` when minimizing). Nothing is pruned before validation
    ``n_warmup_steps`` (Optuna's step: validations counted from 1), before ``n_startup_trials`` finite
    completions, or on a failed fit unless ``use_failed_fits``. ``last_reason`` explains the latest decision."""

    def __init__(self, margin: float = 0.1, n_warmup_steps: int = 10, n_startup_trials: int = 1,
                 use_failed_fits: bool = False) -> None:
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        for name, value in (("n_warmup_steps", n_warmup_steps), ("n_startup_trials", n_startup_trials)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.margin = float(margin)
        self.n_warmup_steps = n_warmup_steps
        self.n_startup_trials = n_startup_trials
        self.use_failed_fits = use_failed_fits
        self.last_reason: str | None = None

    def _prediction(self, trial: FrozenTrial) -> tuple[int, float] | None:
        attr: Any = trial.user_attrs.get(PREDICTION_ATTR)
        if not isinstance(attr, dict):
            return None
        step, value = attr.get("validation"), attr.get("value")
        if not isinstance(step, int) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        if not attr.get("fit_ok", False) and not self.use_failed_fits:
            return None
        return step, float(value)

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        self.last_reason = None
        step = trial.last_step
        if step is None or step < self.n_warmup_steps:
            return False
        found = self._prediction(trial)
        if found is None or found[0] != step:  # only a prediction made at this validation counts
            return False
        completed = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.value is not None and math.isfinite(t.value)]
        if len(completed) < max(self.n_startup_trials, 1):
            return False
        predicted, sign = found[1], -1 if study.direction == StudyDirection.MAXIMIZE else 1
        best = min(completed) if sign > 0 else max(completed)
        limit = best + sign * self.margin * abs(best)
        hopeless = sign * (predicted - limit) > 0
        if hopeless:
            self.last_reason = (f"predicted final loss {predicted:.6g} at validation {step} is worse than the best "
                                f"completed value {best:.6g} by more than {self.margin:g} (limit {limit:.6g})")
        return hopeless

    def __repr__(self) -> str:
        return (f"PredictedFinalLossPruner(margin={self.margin:g}, n_warmup_steps={self.n_warmup_steps}, "
                f"n_startup_trials={self.n_startup_trials}, use_failed_fits={self.use_failed_fits})")
