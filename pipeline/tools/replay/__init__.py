"""Replay: the engine, machine and callbacks driven by a run's recorded numbers (:func:`replay_run`) or by
loss curves (:func:`replay_losses`)."""

from fsmtrain.tools.replay.recording import RecordedTrial, Recording, ReplayError, TrialReport, load_recording
from fsmtrain.tools.replay.replayer import replay_losses, replay_run
from fsmtrain.tools.replay.result import ReplayResult, compare_traces

__all__ = ["RecordedTrial", "Recording", "ReplayError", "ReplayResult", "TrialReport", "compare_traces",
           "load_recording", "replay_losses", "replay_run"]
