"""How slot values become the named scalars W&B logs and the console line shows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fsmtrain.core.context import EpochContext, RunContext, Slot
from fsmtrain.core.events import EventLog
from fsmtrain.core.scalars import epoch_scalars, slot_scalars
from fsmtrain.core.slots import LOSS_PREDICTION, LossPrediction


@dataclass(frozen=True)
class Confusion:
    tp: int
    fp: int
    label: str
    ok: bool


def test_numbers_bools_and_none() -> None:
    assert slot_scalars("x", 2) == {"x": 2.0}
    assert slot_scalars("x", np.float32(0.5)) == {"x": 0.5}
    assert slot_scalars("x", True) == {} and slot_scalars("x", None) == {}


def test_structured_values_give_slot_slash_field() -> None:
    assert slot_scalars("confusion", Confusion(3, 1, "a", True)) == {"confusion/tp": 3.0, "confusion/fp": 1.0}
    assert slot_scalars("per_class", {"cat": 0.5, "dog": 0.25, "note": "x"}) == {
        "per_class/cat": 0.5, "per_class/dog": 0.25}


def test_the_built_in_prediction_keeps_its_logged_name() -> None:
    assert slot_scalars(LOSS_PREDICTION.name, LossPrediction(0.25, 0.6, True)) == {"predicted_final_loss": 0.25}


def test_one_element_tensors_convert_and_others_are_left_out() -> None:
    assert slot_scalars("t", torch.tensor(1.5)) == {"t": 1.5}
    assert slot_scalars("t", torch.ones(3)) == {}
    assert slot_scalars("s", "text") == {} and slot_scalars("l", [1.0, 2.0]) == {}


def test_epoch_scalars_are_metrics_then_slots_and_metrics_keep_their_names() -> None:
    run = RunContext("r", 1, EventLog(None, "r", keep=True, console=None))
    epoch = EpochContext(run, 0)
    epoch.metrics.update({"train_loss": 1.0, "val_loss": 2.0})
    run.set(Slot("my_metric"), 3.0)
    run.set(Slot("val_loss"), 9.0)  # a slot named like a metric does not replace it
    assert epoch_scalars(epoch) == {"train_loss": 1.0, "val_loss": 2.0, "my_metric": 3.0}
    assert list(epoch_scalars(epoch)) == ["train_loss", "val_loss", "my_metric"]
