"""fsmtrain: a PyTorch trainer whose loop is an explicit finite-state machine.

The core: ``lifecycle`` (phases, stop reasons, the transition table), ``context`` (typed contexts
and slots), ``hooks`` (``TrainingCallback``), ``runner`` (ordering, dispatch, data flow),
``engine`` (walks the machine), ``trainer`` (the torch driver and ``Trainer``), ``logs``.
"""

from pipeline.context import (
    CheckpointContext,
    EpochContext,
    EpochRecord,
    FaultContext,
    RunContext,
    Slot,
    SlotScope,
    StepContext,
    StopRequest,
)
from pipeline.engine import Driver, Engine, TrainResult
from pipeline.hooks import ReplaySupport, Tier, TrainingCallback
from pipeline.lifecycle import HOOKS, TRANSITIONS, Guard, LifecycleError, Phase, StopReason, Transition
from pipeline.logs import EventLog, read_events
from pipeline.registry import GlobalHandle, register_global_callback
from pipeline.runner import CallbackOrderError, CallbackRunner
from pipeline.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "HOOKS",
    "TRANSITIONS",
    "CallbackOrderError",
    "CallbackRunner",
    "CheckpointContext",
    "Driver",
    "Engine",
    "EpochContext",
    "EpochRecord",
    "EventLog",
    "FaultContext",
    "GlobalHandle",
    "Guard",
    "LifecycleError",
    "Phase",
    "ReplaySupport",
    "RunContext",
    "Slot",
    "SlotScope",
    "StepContext",
    "StopReason",
    "StopRequest",
    "Tier",
    "TrainResult",
    "Trainer",
    "TrainingCallback",
    "Transition",
    "read_events",
    "register_global_callback",
]
