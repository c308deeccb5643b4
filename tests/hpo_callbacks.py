"""Callbacks the HPO tests put into real trials (through ``callbacks.extra``)."""

from __future__ import annotations

import os
import signal
import time

from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.core.hooks import TrainingCallback


class FailedElsewhere(TrainingCallback):
    """At the end of validation of epoch index ``epoch`` of trial ``trial`` (before the pruner
    reports it): the trial is failed under this live worker, as another worker's
    ``fail_stale_trials`` does to a trial whose heartbeat is late beyond the grace period: state
    FAIL, then the storage's heartbeat-stale callback (the retry)."""

    priority = 80  # before PrunerCallback (85) in on_val_end

    def __init__(self, trial: int = 0, epoch: int = 1, stall: float = 0.0) -> None:
        self.trial, self.epoch, self.stall = trial, epoch, stall  # stall: the worker goes on stalling after

    def on_val_end(self, epoch: EpochContext) -> None:
        from optuna.trial import TrialState

        pruner = next((cb for cb in epoch.run.callbacks if type(cb).__name__ == "PrunerCallback"), None)
        if pruner is None or epoch.index != self.epoch:
            return
        trial = pruner.trial
        if trial.number != self.trial:
            return
        storage = trial.study._storage
        if storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
            retry = storage.get_heartbeat_stale_trial_callback()
            if retry is not None:
                retry(trial.study, storage.get_trial(trial._trial_id))
        time.sleep(self.stall)


class SignalAtTheEnd(TrainingCallback):
    """In the teardown of trial ``trial``'s run, once its result is decided: SIGINT to this process's
    group, as a terminal's Ctrl-C (the command must lead a group of its own), landing after the run
    completed and before its worker told the study."""

    priority = 1000  # after every other callback's on_train_end

    def __init__(self, trial: int = 0) -> None:
        self.trial = trial

    def on_train_end(self, run: RunContext) -> None:
        hpo = run.extras.get("hpo") or {}
        if hpo.get("trial") == self.trial:
            os.killpg(os.getpgrp(), signal.SIGINT)


class SlowEpochs(TrainingCallback):
    """Each epoch takes ``seconds`` longer: a trial a test catches running (two epochs reported) is
    still running when its signal lands, however busy the machine (a whole trial can take under 2 s)."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    def on_epoch_end(self, epoch: EpochContext) -> None:
        time.sleep(self.seconds)
