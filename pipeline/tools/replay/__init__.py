"""Replay: the engine, machine and callbacks driven by a run's recorded numbers (:func:`replay_run`) or by
loss curves (:func:`replay_losses`); imported when first asked for, so other commands skip the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

_RECORDING = "fsmtrain.tools.replay.recording"
__all__ = ["RecordedTrial", "Recording", "ReplayError", "ReplayResult", "TrialReport", "compare_traces",
           "load_recording", "replay_losses", "replay_run"]
__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(("RecordedTrial", "Recording", "ReplayError", "TrialReport", "load_recording"), _RECORDING),
    **dict.fromkeys(("ReplayResult", "compare_traces"), "fsmtrain.tools.replay.result"),
    **dict.fromkeys(("replay_losses", "replay_run"), "fsmtrain.tools.replay.replayer")})

if TYPE_CHECKING:
    from fsmtrain.tools.replay.recording import RecordedTrial, Recording, ReplayError, TrialReport, load_recording
    from fsmtrain.tools.replay.replayer import replay_losses, replay_run
    from fsmtrain.tools.replay.result import ReplayResult, compare_traces
