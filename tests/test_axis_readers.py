"""One axis everywhere (issue 41, item 5), read by each ecosystem's own program: W&B's offline run
(``wandb leet inspect``), TensorBoard's ``EventAccumulator`` and ``metrics.csv`` through pandas
put a validation at the same global step and say its epoch counted from 1; Optuna's step
(``optuna.load_study(...).trials[i].intermediate_values``) counts validations from 1, and a pruned trial's
attribute, the hpo console, ``hpo-report`` and the study page name the same validation, epoch and step."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from callbacks_wandb_history import wandb_history
from hpo_support import fsmtrain, study_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer, read_events
from fsmtrain.callbacks import MetricsCsvCallback, PrunerCallback, TensorBoardLoggingCallback, WandbLoggingCallback

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.mark.timeout(180)
def test_wandb_tensorboard_csv_put_each_validation_at_one_global_step_and_optuna_counts_validations(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(24, 4), torch.randn(24, 1)
    train = DataLoader(TensorDataset(x, y), batch_size=8)  # 3 batches an epoch: steps 3, 6, 9
    model = nn.Linear(4, 1)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trial = optuna.create_study(study_name="axis", storage=storage, pruner=optuna.pruners.NopPruner()).ask()
    run_dir = tmp_path / "run"
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, train, max_epochs=3,
            callbacks=[WandbLoggingCallback(), TensorBoardLoggingCallback(run_dir / "tb"),
                       MetricsCsvCallback(run_dir / "metrics.csv"), PrunerCallback(trial)],
            run_dir=run_dir, default_callbacks=False, console_level="error").fit()
    logged = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "epoch"]
    steps, val = [e["global_step"] for e in logged], [e["payload"]["metrics"]["val_loss"] for e in logged]
    assert steps == [3, 6, 9]
    rows = wandb_history(run_dir)
    assert [(r["_step"], r["epoch"]) for r in rows] == [(3, 1), (6, 2), (9, 3)]
    assert [r["val_loss"] for r in rows] == pytest.approx(val)
    acc = event_accumulator.EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("epoch")] == [(3, 1), (6, 2), (9, 3)]
    assert [e.step for e in acc.Scalars("val_loss")] == steps
    csv = pd.read_csv(run_dir / "metrics.csv")
    assert list(zip(csv["global_step"], csv["epoch"], strict=True)) == [(3, 1), (6, 2), (9, 3)]
    (frozen,) = optuna.load_study(study_name="axis", storage=storage).trials
    assert sorted(frozen.intermediate_values.items()) == pytest.approx(list(zip([1, 2, 3], val, strict=True)))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_pruned_trial_is_named_at_one_validation_by_its_attribute_console_report_and_page(
        tmp_path: Path) -> None:
    space = {"optimizer_config.lr": {"type": "float", "low": 1e-8, "high": 0.1, "log": True}}
    cfg = study_config(tmp_path, {"n_trials": 2, "search_space": space, "pruner": "MedianPruner",
                                  "pruner_config": {"n_startup_trials": 1, "n_warmup_steps": 2}})
    db = tmp_path / "runs" / "quickstart" / "s" / "study.db"
    db.parent.mkdir(parents=True)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    for lr in (0.03, 1e-7):  # the second learns nothing: worse than the first at every step
        study.enqueue_trial({"optimizer_config.lr": lr})
    hpo = fsmtrain("hpo", cfg, cwd=tmp_path)
    assert hpo.returncode == 0, hpo.stdout + hpo.stderr
    pruned = optuna.load_study(study_name="s", storage=f"sqlite:///{db}").trials[1]
    assert pruned.state is optuna.trial.TrialState.PRUNED, hpo.stdout
    n = pruned.last_step
    events = read_events(tmp_path / pruned.user_attrs["run_dirs"]["0"] / "events.jsonl")
    (report,) = [e for e in events if e["event"] == "trial_report" and e["payload"]["should_prune"]]
    epoch, step = report["epoch"] + 1, report["global_step"]  # the log keeps the 0-based epoch index
    assert report["payload"]["validation"] == n == epoch == 2 and step == 8  # 4 batches an epoch
    at = {"validation": n, "epoch": epoch, "step": step}
    assert {k: pruned.user_attrs["pruned"][k] for k in at} == at
    assert f"trial 1 PRUNED at validation {n} (epoch {epoch}, step {step}) by MedianPruner" in hpo.stdout
    text = fsmtrain("hpo-report", db.parent, cwd=tmp_path)
    assert f"trial 1 pruned at validation {n} (epoch {epoch}, step {step}, val_loss " in text.stdout, \
        text.stdout + text.stderr
    assert "median at that validation" in text.stdout
    page = fsmtrain("report", db, "--study", "s", cwd=tmp_path)
    assert page.returncode == 0, page.stdout + page.stderr
    html = (db.parent / "s-report.html").read_text(encoding="utf-8")
    figure = html[html.index('id="plot-intermediate"'):]
    figure = figure[:figure.index("</figure>")]
    assert "validation (from 1)" in figure
    ticks = [float(t) for t in re.findall(r'text-anchor="middle">([\d.]+)</text>', figure)]
    assert ticks and min(ticks) >= 1, ticks  # counted from 1, as the run pages count epochs
    assert f"pruned at validation {n} (epoch {epoch}, step {step})</td>" in html  # the table of trials
