"""What a person reads about a run says the same thing everywhere: ``audit`` and the report give a
callback's share of epoch time alike; the README names every 0-based epoch field of the log (``epoch``,
``best_epoch``) and every member of ``EpochContext``; the loss prediction has one name; the default
early-stopping patience warns only where the user set early stopping; ``--set`` indexes a list
(``callbacks.extra.0.kwargs.threshold``).
"""

from __future__ import annotations

import csv
import html
import inspect
import re
import time
from pathlib import Path
from typing import Any

import pytest
from core_helpers import events_of, make_trainer

from fsmtrain import TrainingCallback
from fsmtrain.app.config import apply_overrides, config_from_dict, load_config
from fsmtrain.callbacks import CheckpointCallback, GradientMonitorCallback, LossPredictionCallback, MetricsCsvCallback
from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.tools.audit import audit_file
from fsmtrain.tools.report.page import render_report

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
EPOCHS = 12  # the loss prediction starts at the 11th epoch


class SlowStart(TrainingCallback):
    """Takes its time before the first epoch (as W&B's start does) and a little in each one."""

    def on_train_begin(self, run: RunContext) -> None:
        time.sleep(1.0)

    def on_epoch_end(self, epoch: EpochContext) -> None:
        time.sleep(0.002)


def _callbacks(run_dir: Path, epochs: int) -> list[TrainingCallback]:
    return [SlowStart(), GradientMonitorCallback(warn_threshold=1e-9), LossPredictionCallback(max_epochs=epochs),
            MetricsCsvCallback(run_dir / "metrics.csv"), CheckpointCallback(run_dir / "checkpoints")]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of 12 epochs, resumed for a 13th (its log then has every kind of epoch field)."""
    run_dir = tmp_path_factory.mktemp("people") / "run"
    make_trainer(run_dir, _callbacks(run_dir, EPOCHS), epochs=EPOCHS).fit()
    make_trainer(run_dir, _callbacks(run_dir, EPOCHS + 1), epochs=EPOCHS + 1, resume_from="latest").fit()
    return run_dir


@pytest.mark.timeout(120)
def test_audit_and_report_give_a_callbacks_share_of_epoch_time_alike(run: Path) -> None:
    story = "\n".join(audit_file(run / "events.jsonl").render().splitlines())
    (line,) = [x for x in story.splitlines() if "time per callback (share of epoch time)" in x]
    audit_share = float(re.search(r"SlowStart [\d.]+ s \(([\d.]+)%\)", line).group(1))  # type: ignore[union-attr]
    page, _ = render_report(str(run))
    text = html.unescape(page.read_text(encoding="utf-8"))
    chart = text[text.index('id="plot-callback-time"'):]
    report_share = float(re.search(r">SlowStart</text>.*?[\d.]+ s \(([\d.]+)%\)", chart).group(1))  # type: ignore[union-attr]
    assert audit_share == report_share
    # inside the epochs it slept 13 x 2 ms; the 1 s before each segment's first epoch is no epoch's time
    epochs = [e["payload"] for e in events_of(run) if e["event"] == "epoch"]
    inside = sum(p["callback_seconds"]["SlowStart"] for p in epochs)
    assert 13 * 0.002 <= inside < 1.0
    assert 0 < audit_share < 100
    assert audit_share == pytest.approx(100 * inside / sum(p["seconds"] for p in epochs), abs=0.06)


def _epoch_fields(value: Any, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            if (key == "epoch" or key.endswith("_epoch")) and type(inner) is int:
                found.add(key)
            if key != "config":
                _epoch_fields(inner, found)


@pytest.mark.timeout(120)
def test_the_readme_names_every_0_based_epoch_field_of_the_log(run: Path) -> None:
    found: set[str] = set()
    for event in events_of(run):
        _epoch_fields({"epoch": event["epoch"], **event["payload"]}, found)
    assert {"best_epoch", "start_epoch", "checkpoint_epoch", "next_epoch"} <= found  # the log has them all
    section = README[README.index("**One epoch numbering.**"):README.index("## The run log")]
    assert "count from 0" in section
    missing = [f for f in sorted(found) if f"`{f}`" not in section]
    assert not missing, f"the README does not say these log fields are 0-based: {missing}"
    # and every reader shows the index plus one
    result = [e for e in events_of(run) if e["event"] == "result"][-1]
    best = result["payload"]["best_epoch"] + 1
    assert f"best epoch: {best} (" in audit_file(run / "events.jsonl").render()
    page, _ = render_report(str(run))
    assert f"(epoch {best})" in page.read_text(encoding="utf-8")


@pytest.mark.timeout(120)
def test_the_loss_prediction_has_one_name(run: Path) -> None:
    with open(run / "metrics.csv", newline="") as fh:
        columns = next(csv.reader(fh))
    assert "predicted_final_loss" in columns  # as W&B, TensorBoard and the console legend call it
    assert not [c for c in columns if "predicted_loss" in c or c.startswith("loss_prediction")], columns
    page, _ = render_report(str(run))
    assert "predicted_final_loss" in page.read_text(encoding="utf-8")
    assert "`pred` its short label" in README and "`predicted_final_loss`" in README


def _minimal(**changes: Any) -> dict[str, Any]:
    return {"net": "fsmtrain.training.models.MLP", "net_config": {"in_features": 8, "out_features": 1},
            "data": "fsmtrain.training.data.synthetic_regression", "epochs": 3, "batch_size": 8, **changes}


def test_a_patience_that_can_never_fire_warns_default_or_not() -> None:
    default = config_from_dict(_minimal()).warnings
    assert [w.path for w in default] == ["early_stopping.patience"] and "found 20 (the default)" in str(default[0])
    set_by_user = config_from_dict(_minimal(early_stopping={"patience": 5}))
    assert [w.path for w in set_by_user.warnings] == ["early_stopping.patience"]
    assert str(set_by_user.warnings[0]).endswith("found 5")


def test_set_indexes_a_list(tmp_path: Path) -> None:
    data = _minimal(callbacks={"extra": [{"target": "fsmtrain.callbacks.EarlyStoppingCallback"}]})
    out = apply_overrides(data, ["callbacks.extra.0.kwargs.patience=2"])
    early = "fsmtrain.callbacks.EarlyStoppingCallback"
    assert out["callbacks"]["extra"] == [{"target": early, "kwargs": {"patience": 2}}]
    assert data["callbacks"]["extra"][0] == {"target": "fsmtrain.callbacks.EarlyStoppingCallback"}  # a copy
    path = tmp_path / "c.yaml"
    path.write_text(str(data).replace("'", '"'), encoding="utf-8")  # JSON is YAML
    cfg = load_config(path, ["callbacks.extra.0.kwargs.patience=2"])
    assert cfg.callbacks.extra[0].kwargs == {"patience": 2}
    with pytest.raises(ValueError, match=r"callbacks\.extra\.1\.kwargs\.patience: expected an index of "
                                         r"callbacks\.extra from 0 to 0; found 1 \(1 items\)"):
        load_config(path, ["callbacks.extra.1.kwargs.patience=2"])


def test_the_readme_documents_every_member_of_epoch_context() -> None:
    members = {n for n, _ in inspect.getmembers(EpochContext) if not n.startswith("_")}
    members |= {n for n in vars(EpochContext(RunContext.__new__(RunContext), 0)) if not n.startswith("_")}
    missing = sorted(m for m in members if f"`epoch.{m}" not in README)
    assert not missing, f"EpochContext members the README does not name: {missing}"
