import math
import warnings

import numpy as np
import pytest
import torch

from fsmtrain.callbacks import LossPredictionCallback
from fsmtrain.callbacks.loss_prediction import FIRST_EPOCH, fit_exponential, predict_final_loss
from fsmtrain.core.slots import LOSS_PREDICTION, LossPrediction


def test_exact_exponential_recovers_a_and_k():
    a, k = 2.5, -0.13
    y = [a * math.exp(k * t) for t in range(15)]
    fit = fit_exponential(range(15), y)
    assert fit is not None
    assert abs(fit[0] - a) / a < 1e-6
    assert abs(fit[1] - k) / abs(k) < 1e-6
    pred = predict_final_loss(y, max_epochs=100)
    assert pred.fit_ok
    expected = a * math.exp(k * 99)
    assert abs(pred.predicted_loss - expected) / expected < 1e-5
    assert pred.neg_log10 == pytest.approx(-math.log10(expected))


def test_flat_curve_falls_back_to_last_val_loss():
    pred = predict_final_loss([0.7] * 12, max_epochs=50)
    assert pred == LossPrediction(0.7, -math.log10(0.7), False)


def test_noisy_curve_falls_back():
    rng = np.random.default_rng(0)
    y = list(0.5 + 0.05 * rng.standard_normal(12))
    pred = predict_final_loss(y, max_epochs=50)
    assert not pred.fit_ok
    assert pred.predicted_loss == y[-1]


@pytest.mark.parametrize("bad", [[1.0] * 5 + [math.nan] + [0.5] * 6, [1.0] * 6 + [-0.5] * 6, [1e308] * 6 + [0.1] * 6])
def test_degenerate_inputs_never_raise_or_warn(bad):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pred = predict_final_loss(bad, max_epochs=1000)
    assert pred.predicted_loss == bad[-1] or pred.fit_ok


def test_slot_is_none_before_epoch_10_and_set_from_10_on(scripted):
    a, k = 1.0, -0.2
    val = [a * math.exp(k * t) for t in range(14)]
    seen: dict[int, LossPrediction | None] = {}

    from fsmtrain import TrainingCallback

    class Reader(TrainingCallback):
        priority = 71
        reads = (LOSS_PREDICTION,)

        def on_val_end(self, epoch):
            seen[epoch.index] = epoch.get(LOSS_PREDICTION)

    out = scripted([LossPredictionCallback(max_epochs=30), Reader()], [1.0] * 14, val, max_epochs=14)
    assert FIRST_EPOCH == 10
    assert all(seen[i] is None for i in range(10))
    for i in range(10, 14):
        p = seen[i]
        assert p is not None and p.fit_ok
        assert p.predicted_loss == pytest.approx(math.exp(-0.2 * 29), rel=1e-6)
    # the slot reaches the epoch log
    epochs = out.named("epoch")
    assert "loss_prediction" not in epochs[9]["payload"]["slots"]
    assert epochs[10]["payload"]["slots"]["loss_prediction"]["fit_ok"] is True


def test_state_dict_round_trip():
    cb = LossPredictionCallback(max_epochs=20)
    cb.val_losses = [1.0, 0.5, 0.1 + 0.2]
    state = cb.state_dict()
    # one tensor, whatever the run's length: a checkpoint pays per pickled object (a list paid per epoch)
    assert isinstance(state["val_losses"], torch.Tensor) and state["val_losses"].dtype == torch.float64
    fresh = LossPredictionCallback(max_epochs=20)
    fresh.load_state_dict(state)
    assert fresh.val_losses == [1.0, 0.5, 0.1 + 0.2]  # bit-exact: float64 holds every Python float
    older = LossPredictionCallback(max_epochs=20)
    older.load_state_dict({"val_losses": [1.0, 0.5], "fitted_at": 0, "fit": None})  # a checkpoint from before
    assert older.val_losses == [1.0, 0.5]


def test_bad_max_epochs():
    with pytest.raises(ValueError, match="max_epochs"):
        LossPredictionCallback(max_epochs=0)


def _sum_of_squares(t, y, fit):
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    return float(np.sum((y - fit[0] * np.exp(fit[1] * t)) ** 2))


@pytest.mark.parametrize("seed", range(12))
def test_the_fit_is_the_least_squares_minimum_curve_fit_finds(seed):
    """The numpy solver lands on scipy's curve_fit minimum (started alike), never above it."""
    from scipy.optimize import curve_fit

    rng = np.random.default_rng(seed)
    n = int(rng.integers(11, 400))
    a, k, noise = rng.uniform(0.05, 20), rng.uniform(-0.4, 0.03), rng.uniform(0, 0.15)
    t = np.arange(n, dtype=float) + (0 if seed % 2 else rng.integers(0, 50))  # some not starting at 0
    y = a * np.exp(k * t) * np.clip(1 + noise * rng.standard_normal(n), 0.05, None) + rng.uniform(0, 0.01)
    ours = fit_exponential(list(t), list(y))
    k0, log_a0 = np.polyfit(t, np.log(y), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = curve_fit(lambda t, a, k: a * np.exp(k * t), t, y, p0=(math.exp(log_a0), k0), maxfev=5000)
    s_ref = _sum_of_squares(t, y, ref)
    residual = 1 - s_ref / float(np.sum((y - y.mean()) ** 2))
    if residual < 0.5:  # R² below MIN_R2: no prediction
        assert ours is None
        return
    assert ours is not None
    assert _sum_of_squares(t, y, ours) <= s_ref * (1 + 1e-9)
    assert ours[0] == pytest.approx(ref[0], rel=1e-5) and ours[1] == pytest.approx(ref[1], rel=1e-5, abs=1e-9)


def test_fitting_imports_no_scipy():
    import subprocess
    import sys

    code = ("import sys; from fsmtrain.callbacks.loss_prediction import predict_final_loss; "
            "p = predict_final_loss([2.0 * 0.9 ** t for t in range(30)], 100); assert p.fit_ok; "
            "print('scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
