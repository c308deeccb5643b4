"""A callback the kill-and-resume tests name in a config (``callbacks.extra``): the subprocess imports
it from this folder (the harness puts tests/ on its PYTHONPATH)."""

from __future__ import annotations

import time

from fsmtrain import TrainingCallback
from fsmtrain.core.context import EpochContext


class HoldFirstEpoch(TrainingCallback):
    """Holds the first epoch of each process for ``seconds`` before it trains: a window in which a
    test kills the process before anything is committed, that no loaded machine misses. It changes
    nothing that is trained."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self.held = False

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if not self.held:
            self.held = True
            time.sleep(self.seconds)
