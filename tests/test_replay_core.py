"""Replay against runs of the core ``Trainer`` with user callbacks: immediate stops mid-epoch,
a callback that raises, runs with no recorded config, and the strict (every batch a real trigger)
engine mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from core_helpers import make_trainer

from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.events import read_events
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.replay import ReplayError, load_recording, replay_run


class HaltAtBatch(TrainingCallback):
    """An immediate stop from a step hook: the epoch is left mid-way."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.at = (epoch, batch)

    def on_train_step_end(self, step: StepContext) -> None:
        if (step.epoch.index, step.batch_index) == self.at:
            step.request_stop(StopReason.INTERRUPTED, self.name, "halt", immediate=True)


class FailAt(TrainingCallback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if epoch.index == self.epoch:
            raise RuntimeError(f"boom at {epoch.index}")


def test_immediate_stop_mid_epoch_replays_batch_for_batch(tmp_path: Path) -> None:
    make_trainer(tmp_path, [HaltAtBatch(1, 2)], epochs=4, log_level="debug").fit()
    rec = load_recording(tmp_path / "events.jsonl")
    assert rec.epochs[-1].partial and rec.epochs[-1].batches == 3 and rec.complete_epochs == 1
    res = replay_run(tmp_path, callbacks=[HaltAtBatch(1, 2)])
    assert res.divergence is None, res.divergence.describe()
    assert (res.stop_reason, res.stop_epoch) == (StopReason.INTERRUPTED, 1)
    later = replay_run(tmp_path, callbacks=[HaltAtBatch(1, 3)])  # would have run one batch more
    assert later.divergence is not None and later.stop_reason is None  # losses of that epoch are unknown


def test_a_callback_that_raised_replays_to_the_same_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom at 2"):
        make_trainer(tmp_path, [FailAt(2)], epochs=5).fit()
    res = replay_run(tmp_path / "events.jsonl", callbacks=[FailAt(2)])
    assert res.divergence is None, res.divergence.describe()
    assert res.stop_reason is StopReason.ERROR and isinstance(res.error, RuntimeError)


class FailInVal(TrainingCallback):
    def on_val_end(self, epoch: EpochContext) -> None:
        if epoch.index == 1:
            raise RuntimeError("boom in val")


def test_an_epoch_cut_in_val_replays_to_its_failure_with_the_losses_its_exception_carries(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        make_trainer(tmp_path, [FailInVal()], epochs=3).fit()
    cut = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "exception")
    assert set(cut["payload"]["epoch_metrics"]) == {"lr", "train_loss", "val_loss"}  # the epoch line never came
    res = replay_run(tmp_path, callbacks=[FailInVal()])
    assert res.divergence is None, res.divergence.describe()
    assert res.stop_reason is StopReason.ERROR and isinstance(res.error, RuntimeError)


class FailAtEpochEnd(TrainingCallback):
    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.index == 1:
            raise RuntimeError("boom at epoch end")


def test_an_epoch_cut_at_its_end_before_its_record_replays_to_the_same_failure(tmp_path: Path) -> None:
    """A callback raising in on_epoch_end: epoch_end counts as inside the epoch, so its exception
    carries the epoch's metrics, and the replay of the unmodified run fails the same way."""
    with pytest.raises(RuntimeError):
        make_trainer(tmp_path, [FailAtEpochEnd()], epochs=3).fit()
    cut = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "exception")
    assert set(cut["payload"]["epoch_metrics"]) == {"lr", "train_loss", "val_loss"}
    rec = load_recording(tmp_path / "events.jsonl")
    assert rec.complete_epochs == 1 and rec.epochs[-1].partial
    res = replay_run(tmp_path, callbacks=[FailAtEpochEnd()])
    assert res.divergence is None, res.divergence.describe()
    assert res.stop_reason is StopReason.ERROR and isinstance(res.error, RuntimeError)


def test_losses_a_cut_epoch_never_logged_are_unknown(tmp_path: Path) -> None:
    """A log whose exception carries no measurements (as a log written before it did): the replay
    cannot run epoch 1's validation, and says so."""
    with pytest.raises(RuntimeError):
        make_trainer(tmp_path, [FailInVal()], epochs=3).fit()
    log = tmp_path / "events.jsonl"
    events = read_events(log)
    for e in events:
        e["payload"].pop("epoch_metrics", None)
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    res = replay_run(tmp_path, callbacks=[FailInVal()])
    assert (res.stop_reason, res.exhausted_after) == (None, 1)  # epoch 1's losses were never written
    assert res.divergence is not None and res.divergence.found is not None
    assert res.divergence.found["payload"]["type"] == "RecordingExhausted"


@pytest.mark.parametrize("strict", [False, True])
def test_strict_and_fast_engine_modes_replay_the_same_trace(tmp_path: Path, strict: bool) -> None:
    make_trainer(tmp_path, [], epochs=3, log_level="debug", strict=not strict).fit()
    assert replay_run(tmp_path, callbacks=[], strict=strict).divergence is None


def test_without_a_recorded_config_callbacks_must_be_given(tmp_path: Path) -> None:
    make_trainer(tmp_path, [], epochs=2).fit()
    assert not any("config" in e["payload"] for e in read_events(tmp_path / "events.jsonl"))
    with pytest.raises(ReplayError, match="records no config"):
        replay_run(tmp_path)
    with pytest.raises(ReplayError, match="records no config"):
        replay_run(tmp_path, callbacks=[], overrides=["epochs=5"])
    assert replay_run(tmp_path, callbacks=[]).stop_reason is StopReason.COMPLETED


def test_a_resumed_log_replays_as_the_run_it_continues(tmp_path: Path) -> None:
    from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback

    def cbs() -> list[Any]:
        return [CheckpointCallback(tmp_path / "checkpoints"), EarlyStoppingCallback(patience=50)]

    make_trainer(tmp_path, cbs(), epochs=2).fit()
    make_trainer(tmp_path, cbs(), epochs=4, resume_from="latest").fit()  # a second segment
    res = replay_run(tmp_path, callbacks=[EarlyStoppingCallback(patience=50)])
    assert res.divergence is None, res.divergence.describe()
    assert (res.stop_reason, res.stop_epoch) == (StopReason.COMPLETED, 4)


def test_a_second_run_appended_without_resume_is_refused(tmp_path: Path) -> None:
    make_trainer(tmp_path, [], epochs=1).fit()
    lines = (tmp_path / "events.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "events.jsonl").write_text("".join(lines + lines))  # two runs in one file
    with pytest.raises(ReplayError, match="holds two runs"):
        replay_run(tmp_path)


def test_a_signal_during_validation_replays_to_the_same_interruption(tmp_path: Path) -> None:
    """SIGTERM landing in an epoch's last validation: the run finishes that epoch (a checkpoint before its
    end would validate it again on resume) and stops at the epoch's end; the replay reproduces the
    interruption there instead of running out of recording ("epoch 3 is unknown")."""
    import os
    import signal

    class TermInVal(TrainingCallback):
        def on_val_batch_end(self, step: Any) -> None:
            if step.epoch.index == 1 and step.batch_index == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the trainer's handler sets the flag

    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path, [TermInVal()], epochs=3).fit()
    events = read_events(tmp_path / "events.jsonl")
    cut = next(e for e in events if e["event"] == "exception")
    assert (cut["phase"], cut["payload"]["source"]) == ("epoch_end", "signal SIGTERM")
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [0, 1]  # the signalled epoch ended
    res = replay_run(tmp_path, callbacks=[TermInVal()])
    assert res.divergence is None, res.divergence.describe()
    assert res.stop_reason is StopReason.INTERRUPTED
