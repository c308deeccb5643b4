"""fsmtrain: a PyTorch trainer whose loop is an explicit finite-state machine.

Layers, bottom to top (imports only point down): ``core`` (the torch-free machine), ``training``
(the torch side), ``callbacks``, ``app`` (``Trainer``, configs, jobs), ``tools`` and ``cli``. The
names below are imported when first asked for, so ``import fsmtrain`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_MODULES: dict[str, tuple[str, ...]] = {
    "core.checks": ("CallbackDefinitionError", "SlotWriteError"),
    "core.context": ("CheckpointContext", "EpochContext", "EpochRecord", "FaultContext", "RunContext", "Slot",
                     "StepContext", "StopRequest"),
    "core.driver": ("BaseDriver", "Driver"),
    "core.engine": ("Engine", "Interrupted"),
    "core.events": ("EventLog", "read_events"),
    "core.hooks": ("ReplaySupport", "Tier", "TrainingCallback"),
    "core.lifecycle": ("HOOKS", "TRANSITIONS", "Guard", "LifecycleError", "Phase", "Transition"),
    "core.registry": ("GlobalHandle", "GlobalRegistrationError", "register_global_callback"),
    "core.result": ("TrainResult",),
    "core.runner": ("CallbackOrderError", "CallbackRunner"),
    "core.stop": ("StopReason",),
    "training.optimizers": ("NamedOptimizers", "NamedSchedulers", "manual_step"),
    "app.trainer": ("Trainer",),
}
_EXPORTS: dict[str, str] = {name: f"fsmtrain.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)


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
    from fsmtrain.app.trainer import Trainer as Trainer
    from fsmtrain.core import *  # noqa: F403 - the names above from the core
