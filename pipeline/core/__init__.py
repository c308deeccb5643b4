"""The machine, torch-free: the lifecycle table and the machine built from it, typed contexts and
slots, ``TrainingCallback``, the global registry, the runner, the engine (its driver contract, its
result) and the event log."""

from pipeline.core.checks import CallbackDefinitionError, SlotWriteError
from pipeline.core.context import (
    CheckpointContext,
    EpochContext,
    EpochRecord,
    FaultContext,
    RunContext,
    Slot,
    StepContext,
    StopRequest,
)
from pipeline.core.driver import BaseDriver, Driver
from pipeline.core.engine import Engine, Interrupted
from pipeline.core.events import EventLog, read_events
from pipeline.core.hooks import ReplaySupport, Tier, TrainingCallback
from pipeline.core.lifecycle import HOOKS, TRANSITIONS, Guard, LifecycleError, Phase, Transition
from pipeline.core.registry import GlobalHandle, GlobalRegistrationError, register_global_callback
from pipeline.core.result import TrainResult
from pipeline.core.runner import CallbackOrderError, CallbackRunner
from pipeline.core.stop import StopReason

__all__ = [
    "HOOKS", "TRANSITIONS", "BaseDriver", "CallbackDefinitionError", "CallbackOrderError", "CallbackRunner",
    "CheckpointContext", "Driver", "Engine", "EpochContext", "Interrupted", "EpochRecord", "EventLog", "FaultContext",
    "GlobalHandle", "GlobalRegistrationError", "Guard", "LifecycleError", "Phase", "ReplaySupport",
    "RunContext", "Slot", "SlotWriteError", "StepContext", "StopReason", "StopRequest", "Tier",
    "TrainResult", "TrainingCallback", "Transition", "read_events", "register_global_callback",
]
