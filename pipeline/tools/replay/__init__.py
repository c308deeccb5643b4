"""Replay: the engine, the machine and the callbacks driven by a run's recorded numbers instead of a
model (:func:`replay_run`), or by loss curves you write down (:func:`replay_losses`). Names are
imported when first asked for, so ``fsmtrain``'s other commands do not load the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

_REPLAYER = "fsmtrain.tools.replay.replayer"
_RECORDING = "fsmtrain.tools.replay.recording"
_RESULT = "fsmtrain.tools.replay.result"
__getattr__, __dir__ = lazy_exports(__name__, {
    "ReplayDriver": _REPLAYER, "RecordingExhausted": _REPLAYER, "replay_losses": _REPLAYER, "replay_run": _REPLAYER,
    "check_replayable": _REPLAYER,
    "RecordedEpoch": _RECORDING, "RecordedTrial": _RECORDING, "Recording": _RECORDING, "ReplayBatch": _RECORDING,
    "ReplayError": _RECORDING, "TrialReport": _RECORDING, "load_recording": _RECORDING,
    "recording_from_events": _RECORDING,
    "Divergence": _RESULT, "ReplayResult": _RESULT, "compare_traces": _RESULT, "normalize_event": _RESULT,
})

__all__ = [
    "Divergence", "RecordedEpoch", "RecordedTrial", "Recording", "RecordingExhausted", "ReplayBatch", "ReplayDriver",
    "ReplayError", "ReplayResult", "TrialReport", "check_replayable", "compare_traces", "load_recording",
    "normalize_event", "recording_from_events", "replay_losses", "replay_run",
]

if TYPE_CHECKING:
    from fsmtrain.tools.replay.recording import (
        RecordedEpoch,
        RecordedTrial,
        Recording,
        ReplayBatch,
        ReplayError,
        TrialReport,
        load_recording,
        recording_from_events,
    )
    from fsmtrain.tools.replay.replayer import (
        RecordingExhausted,
        ReplayDriver,
        check_replayable,
        replay_losses,
        replay_run,
    )
    from fsmtrain.tools.replay.result import Divergence, ReplayResult, compare_traces, normalize_event
