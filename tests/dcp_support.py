"""A callback the sharded-checkpoint tests put into real ``torchrun`` workers (through ``callbacks.extra``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fsmtrain.core.context import StepContext
from fsmtrain.core.hooks import TrainingCallback


class KillOnceCommitted(TrainingCallback):
    """On ``rank``, after global step ``step``: once rank 0's log commits ``path`` (up to 60 s), SIGKILL to its
    own process, the first time only (``marker`` remembers it)."""

    priority = 60

    def __init__(self, rank: int, step: int, path: str, marker: str) -> None:
        self.rank, self.step, self.path, self.marker = rank, step, path, Path(marker)

    def on_train_step_end(self, step: StepContext) -> None:
        run = step.run
        if (int(run.extras.get("rank", 0)), run.global_step + 1) != (self.rank, self.step) or self.marker.exists():
            return
        log, until = Path(str(run.run_dir)) / "events.jsonl", time.monotonic() + 60
        while f'"path":"{self.path}","sha256"' not in log.read_text() and time.monotonic() < until:
            time.sleep(0.05)
        self.marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(TrainingCallback):
    """On ``rank``, after global step ``step``: SIGTERM to its own process (the ranks agree on where to stop)."""

    priority = 60

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_step_end(self, step: StepContext) -> None:
        run = step.run
        if (int(run.extras.get("rank", 0)), run.global_step + 1) == (self.rank, self.step) and not run.extras.get(
                "resumed_from"):
            os.kill(os.getpid(), signal.SIGTERM)


class SignalMidEpoch(SignalAt):
    """:class:`SignalAt`, in a run whose ranks agree before every batch (``may_stop_immediately``): they stop
    together after the next step, inside the epoch. (Agreed once per epoch instead, a signal is honoured at the
    epoch's end: tests/test_steps2_two_ranks.py.)"""

    may_stop_immediately = True
