"""Real kills of a whole 2-rank run at an exact step, for tests/test_steps2_two_ranks.py. ``KillGroupAt``
(every rank of the test's runs carries it) reads ``FSMTRAIN_TEST_GROUP``: ``kill:N``: as batch N+1
begins on rank 0 (N steps done), rank 0 sends SIGKILL to the launcher (the elastic agent, leading its own
session: the worker's parent, or the parent of the launch's zygote that forked the worker, tests/forked_cli.py),
to rank 1 and to itself; ``term:N``: rank 1 sends itself SIGTERM there (the step of the signal is
then known exactly); ``termval:E``: rank 1 sends itself SIGTERM as epoch E's last validation ends.
Each rank writes its pid to ``FSMTRAIN_TEST_PIDS``/rank<r> first."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import TrainingCallback

GROUP_ENV = "FSMTRAIN_TEST_GROUP"
PIDS_ENV = "FSMTRAIN_TEST_PIDS"


class KillGroupAt(TrainingCallback):
    priority = 99  # after the checkpoint callback (95): a step's hooks have all run

    def __init__(self) -> None:
        what, _, at = os.environ.get(GROUP_ENV, ":").partition(":")
        self.what, self.at, self.rank = what, int(at) if at else -1, 0
        self.pids = Path(os.environ.get(PIDS_ENV, "."))

    def on_train_begin(self, run: RunContext) -> None:
        self.rank = int(run.extras.get("rank", 0))
        (self.pids / f"rank{self.rank}").write_text(str(os.getpid()))

    def on_batch_begin(self, step: StepContext) -> None:
        if step.run.global_step != self.at:
            return
        if self.what == "kill" and self.rank == 0:
            os.kill(os.getpgid(os.getppid()), signal.SIGKILL)  # the launcher: the leader of its parent's group
            os.kill(int((self.pids / "rank1").read_text()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.what == "term" and self.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_val_end(self, epoch: EpochContext) -> None:
        if self.what == "termval" and self.rank == 1 and not epoch.inside and epoch.index == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
