"""``log_every_n_steps`` reaches W&B and TensorBoard (issue 41, item 1): the values of the log's
``train_step`` events, at the same global step, read back by W&B's own reader of its offline run
and TensorBoard's ``EventAccumulator``; the epoch rows stay where they were."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from callbacks_wandb_history import wandb_history
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer, read_events
from fsmtrain.callbacks import StepLogCallback, TensorBoardLoggingCallback, WandbLoggingCallback
from fsmtrain.core.context import StepContext
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.runner import CallbackOrderError, CallbackRunner
from fsmtrain.core.slots import STEP_VALUES

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.mark.timeout(180)
def test_step_values_reach_wandb_and_tensorboard_at_the_global_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(24, 4), torch.randn(24, 1)
    train = DataLoader(TensorDataset(x, y), batch_size=8)  # 3 batches an epoch: epoch ends at steps 3, 6, 9
    model = nn.Linear(4, 1)
    run_dir = tmp_path / "run"
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, train, max_epochs=3,
            callbacks=[StepLogCallback(2), WandbLoggingCallback(), TensorBoardLoggingCallback(run_dir / "tb")],
            run_dir=run_dir, default_callbacks=False, console_level="error").fit()
    events = read_events(run_dir / "events.jsonl")
    logged = {e["payload"]["step"]: e["payload"] for e in events if e["event"] == "train_step"}
    assert sorted(logged) == [2, 4, 6, 8]
    assert all({"loss", "lr", "grad_norm"} <= set(v) for v in logged.values())
    epochs = {e["global_step"]: e["payload"]["metrics"] for e in events if e["event"] == "epoch"}
    rows = {r["_step"]: r for r in wandb_history(run_dir)}
    assert sorted(rows) == [2, 3, 4, 6, 8, 9]  # step 6 holds step values and epoch 2's row
    for step, values in logged.items():
        row = rows[step]
        assert row["epoch"] == (step - 1) // 3 + 1
        assert {k: row[f"train_step/{k}"] for k in values if k != "batch" and k != "step"} == \
            {k: v for k, v in values.items() if k not in ("batch", "step")}
    for step, metrics in epochs.items():
        assert rows[step]["epoch"] == step // 3 and rows[step]["val_loss"] == metrics["val_loss"]
    acc = event_accumulator.EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    for name in ("loss", "lr", "grad_norm"):
        got = [(e.step, e.value) for e in acc.Scalars(f"train_step/{name}")]
        assert got == [(s, pytest.approx(logged[s][name], rel=1e-6)) for s in sorted(logged)]
    assert [e.step for e in acc.Scalars("val_loss")] == sorted(epochs)
    assert [(e.step, e.value) for e in acc.Scalars("epoch")] == [(2, 1), (3, 1), (4, 2), (6, 2), (6, 2), (8, 3), (9, 3)]


def test_the_loggers_cost_nothing_per_batch_without_a_step_log() -> None:
    loggers = [WandbLoggingCallback(), TensorBoardLoggingCallback("unused")]
    assert not CallbackRunner(loggers).has("on_train_step_end")
    on = CallbackRunner([*loggers, StepLogCallback(5)])
    assert [cb.name for _, cb in ((i, on.callbacks[i]) for i, _ in on.table("on_train_step_end"))] == \
        ["StepLogCallback", "WandbLoggingCallback", "TensorBoardLoggingCallback"]


def test_a_reader_of_the_step_values_before_their_writer_is_refused() -> None:
    class Early(TrainingCallback):
        priority = 5  # before StepLogCallback (13) in on_train_step_end
        reads = (STEP_VALUES,)

        def on_train_step_end(self, step: StepContext) -> None: ...

    said = re.escape("Early (priority 5) reads slot 'step_values' in on_train_step_end")
    with pytest.raises(CallbackOrderError, match=said):
        CallbackRunner([Early(), StepLogCallback(5)])
