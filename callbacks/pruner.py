"""Report each validation to an Optuna trial; stop the run when its pruner says so."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from fsmtrain.core.context import EpochContext, validation_label
from fsmtrain.core.hooks import Tier, TrainingCallback
from fsmtrain.core.slots import LOSS_PREDICTION
from fsmtrain.core.stop import StopReason

if TYPE_CHECKING:
    import optuna

__all__ = ["PREDICTION_ATTR", "PRUNED_ATTR", "PrunerCallback", "TrialEndedElsewhere", "validation_label"]

PREDICTION_ATTR = "predicted_final_loss"  # trial user attribute: where and what the latest loss prediction said
PRUNED_ATTR = "pruned"  # of a pruned trial: where, the value, the pruner, its reason and `decided_at` (wall clock)


class TrialEndedElsewhere(RuntimeError):
    """Another process finished the trial while this run trained it (a stale heartbeat); the run stops."""


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # user attributes are JSON: no NaN there


class PrunerCallback(TrainingCallback):
    """On ``on_val_end``: the latest loss prediction as a user attribute, ``trial.report(value, n)`` for
    the run's n-th validation (from 1, kept in checkpoints), a ``trial_report`` event, and a stop request
    PRUNED when ``trial.should_prune()``; the HPO layer raises ``optuna.TrialPruned`` after ``fit()``."""

    priority = 85
    tier = Tier.CORE
    rank_zero_only = True  # writes what the run owns once
    reads = (LOSS_PREDICTION,)

    def __init__(self, trial: optuna.trial.Trial, monitor: str = "val_loss") -> None:
        if not hasattr(trial, "report") or not hasattr(trial, "should_prune"):
            raise TypeError(f"trial must be an optuna.trial.Trial, got {type(trial).__name__}")
        self.trial, self.monitor = trial, monitor
        self.validations: int | None = None  # None until the first: a state-less resume counts its epochs

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validations = state.get("validations")

    def _set_attr(self, key: str, value: Any) -> None:
        setter = getattr(self.trial, "set_user_attr", None)  # replay's recorded stand-in has one too
        if setter is not None:
            setter(key, value)

    def on_val_end(self, epoch: EpochContext) -> None:
        self.validations = epoch.run.validations  # the run's count (one an epoch, more with val_every_n_steps)
        value = self.monitored(epoch, self.monitor, "the trial gets no reports")
        if value is None:
            return
        from optuna.exceptions import UpdateFinishedTrialError
        at = {"validation": self.validations, "epoch": epoch.number, "step": epoch.run.global_step}
        try:
            self._report(epoch, float(value), at)
        except UpdateFinishedTrialError as exc:
            raise TrialEndedElsewhere(self._ended_why(validation_label(at))) from exc

    def _ended_why(self, where: str) -> str:
        number = getattr(self.trial, "number", None)
        try:
            state = next(t.state.name for t in self.trial.study.get_trials(deepcopy=False) if t.number == number)
        except Exception:  # the storage itself is unreachable: say what is known
            state = "finished"
        return (f"trial {number} is already finished in the study ({state}): another process ended it while this "
                "one trained it (a heartbeat storage fails a trial whose last heartbeat is older than the grace "
                f"period), so {where} cannot be reported; the run stops "
                "here, and the study's retry of the trial runs it again from this run's last checkpoint")

    def _report(self, epoch: EpochContext, value: float, at: dict[str, Any]) -> None:
        prediction = epoch.get(LOSS_PREDICTION)
        if prediction is not None:
            self._set_attr(PREDICTION_ATTR, {**at, "value": _finite_or_none(prediction.predicted_loss),
                                             "fit_ok": prediction.fit_ok})
        self.trial.report(value, at["validation"])
        asked = time.time()
        should_prune = bool(self.trial.should_prune())
        number = getattr(self.trial, "number", None)  # replay passes a recorded stand-in
        epoch.emit("trial_report", validation=at["validation"], value=value, should_prune=should_prune, trial=number)
        if should_prune:
            pruner: object = getattr(getattr(self.trial, "study", None), "pruner", None)
            own_repr = type(pruner).__repr__ is not object.__repr__  # Optuna's pruners only have object's
            self._set_attr(PRUNED_ATTR, {
                **at, "value": _finite_or_none(value), "monitor": self.monitor,
                "pruner": None if pruner is None else repr(pruner) if own_repr else type(pruner).__name__,
                "reason": getattr(pruner, "last_reason", None), "decided_at": asked,
            })
            epoch.request_stop(StopReason.PRUNED, self.name,
                               f"trial {number} pruned at {validation_label(at)} ({self.monitor}={value:.6g})")
