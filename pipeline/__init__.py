"""fsmtrain: a PyTorch trainer whose loop is an explicit finite-state machine.

The layers, bottom to top (imports only point down; ``pyproject.toml`` declares the contract):

- ``fsmtrain.core``: the machine, torch-free: lifecycle table, contexts and slots, callbacks,
  runner, engine, event log, drawings of the table;
- ``fsmtrain.training``: the torch side the engine drives (driver, batch body, checkpoints, data);
- ``callbacks``: the built-in callbacks, one module each;
- ``fsmtrain.app``: the ``Trainer`` facade, run configs, one seed's job;
- ``fsmtrain.tools``: audit, replay, diagrams, reports on what runs left behind;
- ``fsmtrain.cli``: the ``fsmtrain`` command.

The names below are re-exported lazily, so ``import fsmtrain`` (and ``fsmtrain audit``) never
imports torch unless a torch-side name is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CheckpointContext": "fsmtrain.core.context",
    "EpochContext": "fsmtrain.core.context",
    "EpochRecord": "fsmtrain.core.context",
    "FaultContext": "fsmtrain.core.context",
    "RunContext": "fsmtrain.core.context",
    "Slot": "fsmtrain.core.context",
    "StepContext": "fsmtrain.core.context",
    "StopRequest": "fsmtrain.core.context",
    "Driver": "fsmtrain.core.driver",
    "Engine": "fsmtrain.core.engine",
    "TrainResult": "fsmtrain.core.result",
    "ReplaySupport": "fsmtrain.core.hooks",
    "Tier": "fsmtrain.core.hooks",
    "TrainingCallback": "fsmtrain.core.hooks",
    "HOOKS": "fsmtrain.core.lifecycle",
    "TRANSITIONS": "fsmtrain.core.lifecycle",
    "Guard": "fsmtrain.core.lifecycle",
    "LifecycleError": "fsmtrain.core.lifecycle",
    "Phase": "fsmtrain.core.lifecycle",
    "StopReason": "fsmtrain.core.stop",
    "Transition": "fsmtrain.core.lifecycle",
    "EventLog": "fsmtrain.core.events",
    "read_events": "fsmtrain.core.events",
    "GlobalHandle": "fsmtrain.core.registry",
    "GlobalRegistrationError": "fsmtrain.core.registry",
    "register_global_callback": "fsmtrain.core.registry",
    "CallbackDefinitionError": "fsmtrain.core.checks",
    "SlotWriteError": "fsmtrain.core.checks",
    "CallbackOrderError": "fsmtrain.core.runner",
    "CallbackRunner": "fsmtrain.core.runner",
    "Trainer": "fsmtrain.app.trainer",
}

__all__ = [
    "CallbackDefinitionError",
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
    "GlobalRegistrationError",
    "Guard",
    "HOOKS",
    "LifecycleError",
    "Phase",
    "ReplaySupport",
    "RunContext",
    "Slot",
    "SlotWriteError",
    "StepContext",
    "StopReason",
    "StopRequest",
    "TRANSITIONS",
    "Tier",
    "TrainResult",
    "Trainer",
    "TrainingCallback",
    "Transition",
    "read_events",
    "register_global_callback",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsmtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from fsmtrain.app.trainer import Trainer
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
    from fsmtrain.core.driver import Driver
    from fsmtrain.core.engine import Engine
    from fsmtrain.core.events import EventLog, read_events
    from fsmtrain.core.hooks import ReplaySupport, Tier, TrainingCallback
    from fsmtrain.core.lifecycle import HOOKS, TRANSITIONS, Guard, LifecycleError, Phase, Transition
    from fsmtrain.core.registry import GlobalHandle, GlobalRegistrationError, register_global_callback
    from fsmtrain.core.result import TrainResult
    from fsmtrain.core.runner import CallbackOrderError, CallbackRunner
    from fsmtrain.core.stop import StopReason
