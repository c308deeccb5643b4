"""Extrapolate the final validation loss from an exponential fit of the val losses so far."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import Tier, TrainingCallback, int_at_least
from fsmtrain.core.slots import LOSS_PREDICTION, LossPrediction

__all__ = ["FIRST_EPOCH", "LossPredictionCallback", "fit_exponential", "predict_final_loss"]

FIRST_EPOCH = 10  # the first validation index with a prediction: the fit then sees 11 val losses
MIN_R2 = 0.5  # a fit that explains less of the variance (flat or noisy curves) is rejected
# Refit once the history has grown by this share since the last fit (every epoch up to 50), so a long run
# stays linear in its length; between refits the last fit's (A, K) is carried.
REFIT_GROWTH = 0.02


def _exp(t: Any, a: float, k: float) -> Any:
    return a * np.exp(k * t)


def fit_exponential(t: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares fit of ``y = A·exp(K·t)``, started from a log-linear fit: ``(A, K)``, or None
    when the data cannot be fitted or R² is below :data:`MIN_R2`. Never raises or warns. The minimum
    is the one ``scipy.optimize.curve_fit`` finds, solved with numpy alone (no scipy import)."""
    with np.errstate(all="ignore"):
        try:
            ts = np.arange(len(t), dtype=np.float64) if isinstance(t, range) and t.start == 0 and t.step == 1 \
                else np.asarray(t, dtype=np.float64)
            ys = np.asarray(y, dtype=np.float64)
            if ts.ndim != 1 or ts.size < 3 or ts.shape != ys.shape or not np.all(np.isfinite(ys)) or np.any(ys <= 0):
                return None
            if float(np.ptp(ys)) <= 1e-12 * float(np.max(ys)):
                return None  # a flat curve has no trend to extrapolate (rounding noise is not a trend)
            ss_tot = float(np.sum((ys - ys.mean()) ** 2))
            fit = _least_squares(ts, ys) if math.isfinite(ss_tot) and ss_tot > 0 else None
            if fit is None or not 1.0 - float(np.sum((ys - _exp(ts, *fit)) ** 2)) / ss_tot >= MIN_R2:
                return None  # not fitted, or R² too low (or NaN)
            return fit
        except Exception:  # any fitting failure means "no prediction"
            return None


def _least_squares(ts: Any, ys: Any) -> tuple[float, float] | None:
    """``min_{A,K} Σ (y - A·exp(K·t))²`` by variable projection: for a given K the best A is
    ``Σ y·e / Σ e²`` (``e = exp(K·t)``), which leaves a smooth function of K alone,
    ``S(K) = Σ y² - (Σ y·e)² / Σ e²``; Newton's method on it (exact first and second derivatives,
    a halved step whenever S does not fall) from the log-linear fit's K."""
    span = float(ts.max() - ts.min())
    if not span > 0:
        return None
    origin = float(ts.min())
    s = (ts - origin) / span  # in [0, 1]: exp(κ·s) overflows only for |κ| > 700
    powers = np.stack((np.ones_like(s), s, s * s), axis=1)
    logs = np.log(ys)
    sc = s - s.mean()
    kappa = float(np.dot(sc, logs - logs.mean()) / np.dot(sc, sc))  # the log-linear slope

    def terms(kappa: float) -> tuple[float, float, float, float, float, float, float]:
        e = np.exp(kappa * s)
        (a0, a1, a2), (b0, b1, b2) = np.stack((ys * e, e * e)) @ powers
        return a0, a1, a2, b0, 2.0 * b1, 4.0 * b2, -a0 * a0 / b0  # the sums and S(κ) - Σ y²
    a0, a1, a2, b0, b1, b2, f = terms(kappa)
    for _ in range(100):
        grad = -2.0 * a0 * a1 / b0 + a0 * a0 * b1 / (b0 * b0)
        curv = (-2.0 * (a1 * a1 + a0 * a2) / b0 + 4.0 * a0 * a1 * b1 / (b0 * b0) + a0 * a0 * b2 / (b0 * b0)
                - 2.0 * a0 * a0 * b1 * b1 / (b0 * b0 * b0))
        if not (math.isfinite(grad) and math.isfinite(curv)):
            return None
        step = -grad / curv if curv > 0 else -math.copysign(1.0, grad)
        if curv > 0 and abs(step) <= 1e-7 * max(1.0, abs(kappa)):
            break  # converged: rounding keeps Newton's steps from getting much smaller
        for _ in range(40):
            trial = terms(kappa + step)
            if math.isfinite(trial[6]) and trial[6] <= f:
                break
            step /= 2.0
        else:
            break  # no step lowers S: κ is the minimum to working precision
        kappa += step
        a0, a1, a2, b0, b1, b2, f = trial
    # A at the origin of s, moved to t = 0
    k = float(kappa) / span
    a = float(a0 / b0) * math.exp(-k * origin)
    return (a, k) if math.isfinite(a) and math.isfinite(k) else None


def predict_final_loss(val_losses: Sequence[float], max_epochs: int) -> LossPrediction:
    """Fit all ``val_losses`` (epoch ``t`` = position) and evaluate at the last epoch index
    ``max_epochs - 1``. Falls back to the last val loss (``fit_ok=False``)."""
    return prediction_from_fit(fit_exponential(range(len(val_losses)), val_losses), val_losses, max_epochs)


def prediction_from_fit(fit: tuple[float, float] | None, val_losses: Sequence[float],
                        max_epochs: int) -> LossPrediction:
    with np.errstate(all="ignore"):
        predicted = math.nan if fit is None else float(_exp(np.float64(max_epochs - 1), *fit))
    ok = math.isfinite(predicted)
    value = predicted if ok else float(val_losses[-1]) if val_losses else math.nan
    neg_log10 = -math.log10(value) if value > 0 and math.isfinite(value) else math.nan
    return LossPrediction(predicted_loss=value, neg_log10=neg_log10, fit_ok=ok)


class LossPredictionCallback(TrainingCallback):
    """On ``on_val_end`` from the 11th validation on: slot ``loss_prediction`` holds the fit of all val
    losses so far evaluated at the run's last validation, or the last val loss when the fit fails."""

    priority = 70
    tier = Tier.CORE
    writes = (LOSS_PREDICTION,)

    def __init__(self, max_epochs: int) -> None:
        self.max_epochs = int_at_least("max_epochs", max_epochs, 1)
        self.val_losses: list[float] = []
        self.fitted_at = 0  # history length at the last fit
        self.fit: tuple[float, float] | None = None

    def on_val_end(self, epoch: EpochContext) -> None:
        value = epoch.metrics.get("val_loss")
        if value is None:
            return
        self.val_losses.append(float(value))
        if len(self.val_losses) <= FIRST_EPOCH:
            return
        horizon = max(1, round(len(self.val_losses) * self.max_epochs / (epoch.index + 1)))  # validations in all
        try:
            if len(self.val_losses) - self.fitted_at >= max(1, math.ceil(REFIT_GROWTH * self.fitted_at)):
                self.fit = fit_exponential(range(len(self.val_losses)), self.val_losses)
                self.fitted_at = len(self.val_losses)
            prediction = prediction_from_fit(self.fit, self.val_losses, horizon)
        except Exception:  # a prediction must never end a run
            prediction = LossPrediction(float(value), math.nan, False)
        epoch.set(LOSS_PREDICTION, prediction)

    def state_dict(self) -> dict[str, Any]:
        # One tensor, not a list: a checkpoint's serialisation costs a Python call per object.
        return {"val_losses": torch.tensor(self.val_losses, dtype=torch.float64), "fitted_at": self.fitted_at,
                "fit": None if self.fit is None else list(self.fit)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.val_losses = torch.as_tensor(state.get("val_losses", []), dtype=torch.float64).tolist()
        self.fitted_at = int(state.get("fitted_at", 0))
        fit = state.get("fit")
        self.fit = None if fit is None else (float(fit[0]), float(fit[1]))
