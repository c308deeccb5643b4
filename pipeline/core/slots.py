"""The well-known slots the built-in callbacks share. Built-ins import these (never each other)."""

from __future__ import annotations

from dataclasses import dataclass

from fsmtrain.core.context import Slot


@dataclass(frozen=True)
class LossPrediction:
    """The extrapolated final validation loss of ``LossPredictionCallback``."""

    predicted_loss: float
    neg_log10: float
    fit_ok: bool

    def scalars(self) -> dict[str, float]:
        """What loggers show of it (``fsmtrain.core.scalars``): the predicted loss, by its logged name."""
        return {"predicted_final_loss": self.predicted_loss}


@dataclass(frozen=True)
class StepValues:
    """One logged step of ``StepLogCallback``: the global step and epoch (from 1) and its values."""

    step: int
    epoch: int
    values: dict[str, float]

    def scalars(self) -> dict[str, float]:
        """What loggers send at ``step``: each value as ``train_step/<name>``, and ``epoch``."""
        return {"epoch": float(self.epoch), **{f"train_step/{k}": v for k, v in self.values.items()}}


MAX_GRAD_NORM: Slot[float] = Slot("max_grad_norm", doc="largest global L2 gradient norm of the epoch")
OVERFIT_GAP_RATIO: Slot[float] = Slot("overfit_gap_ratio", doc="val_loss / train_loss while overfitting")
LOSS_PREDICTION: Slot[LossPrediction] = Slot("loss_prediction", doc="extrapolated final val loss")
EARLY_STOPPING_WAIT: Slot[int] = Slot(
    "early_stopping_wait", doc="epochs in a row without improvement of the early-stopping monitor (stops at patience)")
NONFINITE_ORIGIN: Slot[list[int]] = Slot(
    "nonfinite_origin", doc="[rank, batch index] where a rank's own training loss first went non-finite this epoch "
    "(several ranks: the NaN begun there, before the ranks' sums carried it to every rank)")
STEP_VALUES: Slot[StepValues] = Slot(
    "step_values", doc="the last logged step's train loss, lr and gradient norm (log_every_n_steps)", per_step=True)
