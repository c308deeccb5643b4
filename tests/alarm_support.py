"""A callback for the no-false-alarm tests: a pause at a clean moment in which to kill a run."""

from __future__ import annotations

import time
from pathlib import Path

from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import TrainingCallback


class HoldEpoch(TrainingCallback):
    """At the start of epoch index ``epoch``, once (``marker`` remembers it), writes ``marker`` and
    waits ``seconds``: every earlier epoch is committed and logged, nothing of this one yet, so a
    kill in the wait is an ordinary crash, not one in a commit window."""

    def __init__(self, epoch: int, marker: str, seconds: float = 30.0) -> None:
        self.epoch, self.marker, self.seconds = epoch, Path(marker), seconds

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if epoch.index == self.epoch and not self.marker.exists():
            self.marker.write_text("held")
            time.sleep(self.seconds)
