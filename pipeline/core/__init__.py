"""The machine, torch-free: the lifecycle table and its machine, contexts and slots, callbacks, the
runner, the engine and the event log."""

from fsmtrain.core.checks import CallbackDefinitionError, SlotWriteError
from fsmtrain.core.context import (
    CheckpointContext,
    EpochContext,
    EpochRecord,
    FaultContext,
    RunContext,
    Slot,
    StepContext,
    StopRequest,
)
from fsmtrain.core.driver import BaseDriver, Driver
from fsmtrain.core.engine import Engine, Interrupted
from fsmtrain.core.events import EventLog, read_events
from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
from fsmtrain.core.lifecycle import HOOKS, TRANSITIONS, Guard, LifecycleError, Phase, Transition
from fsmtrain.core.registry import GlobalHandle, GlobalRegistrationError, register_global_callback
from fsmtrain.core.result import TrainResult
from fsmtrain.core.runner import CallbackOrderError, CallbackRunner
from fsmtrain.core.stop import StopReason

__all__ = ["HOOKS", "TRANSITIONS", "BaseDriver", "CallbackDefinitionError", "CallbackOrderError", "CallbackRunner",
           "CheckpointContext", "Driver", "Engine", "EpochContext", "Interrupted", "EpochRecord", "EventLog",
           "FaultContext", "GlobalHandle", "GlobalRegistrationError", "Guard", "LifecycleError", "Phase",
           "ReplaySupport", "RunContext", "Slot", "SlotWriteError", "StepContext", "StopReason", "StopRequest",
           "Tier", "TrainResult", "TrainingCallback", "Transition", "read_events", "register_global_callback"]
