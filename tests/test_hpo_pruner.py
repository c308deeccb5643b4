"""PredictedFinalLossPruner: scripted loss curves through the real engine, LossPredictionCallback and
PrunerCallback, against a real Optuna study."""

from __future__ import annotations

import math
from typing import Any, Literal

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from fsmtrain import StopReason
from fsmtrain.app.hpo.pruner import PredictedFinalLossPruner
from fsmtrain.callbacks import LossPredictionCallback, PrunerCallback
from fsmtrain.callbacks.pruner import PREDICTION_ATTR, PRUNED_ATTR
from fsmtrain.tools.replay import ReplayResult, replay_losses

EPOCHS = 40


def _curve(a: float, k: float, floor: float = 0.0) -> list[float]:
    return [a * math.exp(-k * t) + floor for t in range(EPOCHS)]


def _run(study: optuna.study.Study, val: list[float]) -> tuple[optuna.trial.FrozenTrial, ReplayResult]:
    """One trial whose run is the scripted ``val`` curve; told as the HPO layer does."""
    trial = study.ask()
    out = replay_losses(val, val, callbacks=[LossPredictionCallback(max_epochs=EPOCHS), PrunerCallback(trial)])
    assert out.result is not None
    if out.result.stop_reason is StopReason.PRUNED:
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, out.result.objective)
    return study.trials[-1], out


@pytest.fixture
def study() -> optuna.study.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(pruner=PredictedFinalLossPruner(margin=0.1, n_warmup_steps=10))


def test_prunes_a_hopeless_trial_and_keeps_good_ones(study: optuna.study.Study) -> None:
    first, out = _run(study, _curve(1.0, 0.12, 0.01))  # no completed trial yet: never pruned
    assert first.state is TrialState.COMPLETE and out.epochs_completed == EPOCHS
    best = first.value
    assert best is not None and best < 0.03

    hopeless, out = _run(study, _curve(2.0, 0.01))  # heads for ~1.35 at the last epoch
    assert hopeless.state is TrialState.PRUNED
    assert out.stop_reason is StopReason.PRUNED and out.epochs_completed == 11  # epoch 11: the first prediction
    assert hopeless.last_step == 11  # Optuna's step: the 11th validation (one an epoch)
    # The pruner decided on the number the run's log records.
    logged = out.events("epoch")[-1]["payload"]["slots"]["loss_prediction"]
    attr = hopeless.user_attrs[PREDICTION_ATTR]
    assert attr == {"validation": 11, "epoch": 11, "step": 11, "value": logged["predicted_loss"], "fit_ok": True}
    assert attr["value"] > best * 1.1
    assert hopeless.user_attrs[PRUNED_ATTR]["pruner"].startswith("PredictedFinalLossPruner(margin=0.1")
    assert "predicted final loss" in hopeless.user_attrs[PRUNED_ATTR]["reason"]
    assert " at validation 11 is worse than the best" in hopeless.user_attrs[PRUNED_ATTR]["reason"]

    good, out = _run(study, _curve(1.1, 0.12, 0.011))  # a little worse than the best, within the margin
    assert good.state is TrialState.COMPLETE and out.epochs_completed == EPOCHS
    assert good.user_attrs[PREDICTION_ATTR]["validation"] == EPOCHS


def test_nothing_is_pruned_before_the_warm_up(study: optuna.study.Study) -> None:
    _run(study, _curve(1.0, 0.12, 0.01))
    pruner = PredictedFinalLossPruner(margin=0.1, n_warmup_steps=20)
    study.pruner = pruner
    late, out = _run(study, _curve(2.0, 0.01))
    assert late.state is TrialState.PRUNED and late.last_step == 20 and out.epochs_completed == 20


def _frozen(prediction: dict[str, Any] | None, step: int = 12) -> optuna.trial.FrozenTrial:
    attrs = {} if prediction is None else {PREDICTION_ATTR: prediction}
    return create_trial(state=TrialState.RUNNING, params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)},
                        user_attrs=attrs, intermediate_values={s: 1.0 for s in range(step + 1)})


@pytest.mark.parametrize("direction, best, predicted, prunes", [
    ("minimize", 1.0, 1.2, True),
    ("minimize", 1.0, 1.05, False),  # within the 10% margin
    ("maximize", 1.0, 0.8, True),
    ("maximize", 1.0, 0.95, False),
])
def test_decision_follows_direction_and_margin(direction: Literal["minimize", "maximize"], best: float,
                                               predicted: float, prunes: bool) -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction=direction)
    study.add_trial(create_trial(value=best, params={"x": 0.1}, distributions={"x": FloatDistribution(0, 1)}))
    pruner = PredictedFinalLossPruner(margin=0.1, n_warmup_steps=10)
    assert pruner.prune(study, _frozen({"validation": 12, "value": predicted, "fit_ok": True})) is prunes
    assert (pruner.last_reason is not None) is prunes


def test_stale_failed_or_missing_predictions_do_not_prune() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study()
    study.add_trial(create_trial(value=1.0, params={"x": 0.1}, distributions={"x": FloatDistribution(0, 1)}))
    pruner = PredictedFinalLossPruner(margin=0.1, n_warmup_steps=10)
    assert not pruner.prune(study, _frozen(None))
    assert not pruner.prune(study, _frozen({"validation": 11, "value": 9.0, "fit_ok": True}))  # not this validation's
    assert not pruner.prune(study, _frozen({"validation": 12, "value": 9.0, "fit_ok": False}))  # only the last loss
    assert PredictedFinalLossPruner(use_failed_fits=True).prune(study, _frozen({"validation": 12, "value": 9.0,
                                                                                "fit_ok": False}))
    assert not pruner.prune(study, _frozen({"validation": 12, "value": None, "fit_ok": True}))
    assert not PredictedFinalLossPruner(n_startup_trials=2).prune(study, _frozen({"validation": 12, "value": 9.0,
                                                                                  "fit_ok": True}))


@pytest.mark.parametrize("kwargs", [{"margin": -1}, {"margin": math.nan}, {"n_warmup_steps": -1},
                                    {"n_startup_trials": 1.5}])
def test_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PredictedFinalLossPruner(**kwargs)
