import math

import optuna
import pytest
import torch
from optuna.trial import TrialState
from torch import nn

from fsmtrain import StopReason, Trainer, TrainingCallback, read_events
from fsmtrain.callbacks import PrunerCallback


class EndRecorder(TrainingCallback):
    priority = 99

    def __init__(self):
        self.ended_with = None

    def on_train_end(self, run):
        self.ended_with = run.stop.reason if run.stop else StopReason.COMPLETED


def test_median_pruner_prunes_a_bad_trial(tiny, tmp_path, scripted):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="prune", storage=storage, direction="minimize",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3))

    def good(trial):
        # two completed trials with decreasing losses, run through the real engine (one batch an epoch)
        losses = [1.0 / (e + 1) for e in range(8)]
        out = scripted([PrunerCallback(trial)], losses, losses)
        assert out.result.stop_reason is StopReason.COMPLETED
        return out.result.objective

    study.optimize(good, n_trials=2)
    ends: list[EndRecorder] = []
    results = []

    def bad(trial):
        train, _ = tiny.loaders(n=16, batch=8)  # two batches an epoch: its global steps are not the good trials'
        far = [(torch.randn(16, 4), torch.full((16, 1), 100.0))]  # val loss ~1e4, far above the median
        model = tiny.model()
        end = EndRecorder()
        ends.append(end)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), train, far,
                          max_epochs=8, callbacks=[PrunerCallback(trial), end], run_dir=tmp_path / "bad",
                          console_level="error", default_callbacks=False)
        result = trainer.fit()
        results.append(result)
        if result.stop_reason is StopReason.PRUNED:  # what the HPO layer does after fit() returns
            assert result.stop is not None
            raise optuna.TrialPruned(result.stop.message)
        return result.objective

    study.optimize(bad, n_trials=1)
    reloaded = optuna.load_study(study_name="prune", storage=storage)
    trial = reloaded.trials[-1]
    assert trial.state is TrialState.PRUNED
    # Optuna's steps count validations, so the trials compare whatever their batches: warm-up 3, pruned at 3
    assert sorted(trial.intermediate_values) == [1, 2, 3]
    assert ends[0].ended_with is StopReason.PRUNED  # on_train_end ran
    assert results[0].epochs_completed == 3
    events = read_events(tmp_path / "bad" / "events.jsonl")
    transitions = [e for e in events if e["event"] == "transition"]
    assert transitions[-1]["to"] == "train_end"
    assert transitions[-1]["payload"]["reason"] == "pruned"
    assert transitions[-1]["payload"]["source"] == "PrunerCallback"
    reports = [e["payload"] for e in events if e["event"] == "trial_report"]
    assert [(r["validation"], r["should_prune"]) for r in reports] == [(1, False), (2, False), (3, True)]
    assert all(math.isclose(r["value"], trial.intermediate_values[r["validation"]]) for r in reports)
    pruned = trial.user_attrs["pruned"]
    assert {k: pruned[k] for k in ("validation", "epoch", "step")} == {"validation": 3, "epoch": 3, "step": 6}
    assert results[0].stop is not None and "pruned at validation 3 (epoch 3, step 6)" in results[0].stop.message


def test_nop_pruner_never_stops(scripted):
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    trial = study.ask()
    out = scripted([PrunerCallback(trial)], [1.0] * 4, [5.0] * 4)
    assert out.result.stop_reason is StopReason.COMPLETED
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0}


def test_missing_monitor_warns(scripted):
    trial = optuna.create_study().ask()
    out = scripted([PrunerCallback(trial, monitor="acc")], [1.0] * 2, [1.0] * 2)
    assert len(out.named("warning")) == 1


def test_requires_a_trial():
    with pytest.raises(TypeError, match=r"optuna\.trial\.Trial"):
        PrunerCallback(object())  # type: ignore[arg-type]  # the wrong type on purpose
