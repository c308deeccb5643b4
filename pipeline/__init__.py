"""fsmtrain: a PyTorch trainer whose loop is an explicit finite-state machine.

The layers, bottom to top (imports only point down; ``pyproject.toml`` declares the contract):

- ``pipeline.core``: the machine, torch-free: lifecycle table, contexts and slots, callbacks,
  runner, engine, event log, drawings of the table;
- ``pipeline.training``: the torch side the engine drives (driver, batch body, checkpoints, data);
- ``callbacks``: the built-in callbacks, one module each;
- ``pipeline.app``: the ``Trainer`` facade, run configs, one seed's job;
- ``pipeline.tools``: audit, replay, diagrams, reports on what runs left behind;
- ``pipeline.cli``: the ``fsmtrain`` command.

The names below are re-exported lazily, so ``import pipeline`` (and ``fsmtrain audit``) never
imports torch unless a torch-side name is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CheckpointContext": "pipeline.core.context",
    "EpochContext": "pipeline.core.context",
    "EpochRecord": "pipeline.core.context",
    "FaultContext": "pipeline.core.context",
    "RunContext": "pipeline.core.context",
    "Slot": "pipeline.core.context",
    "StepContext": "pipeline.core.context",
    "StopRequest": "pipeline.core.context",
    "Driver": "pipeline.core.driver",
    "Engine": "pipeline.core.engine",
    "TrainResult": "pipeline.core.result",
    "ReplaySupport": "pipeline.core.hooks",
    "Tier": "pipeline.core.hooks",
    "TrainingCallback": "pipeline.core.hooks",
    "HOOKS": "pipeline.core.lifecycle",
    "TRANSITIONS": "pipeline.core.lifecycle",
    "Guard": "pipeline.core.lifecycle",
    "LifecycleError": "pipeline.core.lifecycle",
    "Phase": "pipeline.core.lifecycle",
    "StopReason": "pipeline.core.stop",
    "Transition": "pipeline.core.lifecycle",
    "EventLog": "pipeline.core.events",
    "read_events": "pipeline.core.events",
    "GlobalHandle": "pipeline.core.registry",
    "GlobalRegistrationError": "pipeline.core.registry",
    "register_global_callback": "pipeline.core.registry",
    "CallbackDefinitionError": "pipeline.core.checks",
    "SlotWriteError": "pipeline.core.checks",
    "CallbackOrderError": "pipeline.core.runner",
    "CallbackRunner": "pipeline.core.runner",
    "Trainer": "pipeline.app.trainer",
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
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from pipeline.app.trainer import Trainer
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
    from pipeline.core.driver import Driver
    from pipeline.core.engine import Engine
    from pipeline.core.events import EventLog, read_events
    from pipeline.core.hooks import ReplaySupport, Tier, TrainingCallback
    from pipeline.core.lifecycle import HOOKS, TRANSITIONS, Guard, LifecycleError, Phase, Transition
    from pipeline.core.registry import GlobalHandle, GlobalRegistrationError, register_global_callback
    from pipeline.core.result import TrainResult
    from pipeline.core.runner import CallbackOrderError, CallbackRunner
    from pipeline.core.stop import StopReason
