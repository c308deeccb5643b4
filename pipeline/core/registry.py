"""The global-callback registry: the one documented piece of process-wide state.

Callbacks registered here join every run started while they are registered, in the GLOBAL tier.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

# The registry holds callbacks without importing their class (``hooks`` imports this module).
TrainingCallback = Any

_registry: dict[int, TrainingCallback] = {}
_ids = itertools.count()


@dataclass
class GlobalHandle:
    """Returned by :func:`register_global_callback`; ``remove()`` takes the callback out again."""

    key: int
    callback: TrainingCallback = field(repr=False)

    def remove(self) -> None:
        _registry.pop(self.key, None)

    @property
    def active(self) -> bool:
        return self.key in _registry


def register_global_callback(callback: TrainingCallback) -> GlobalHandle:
    key = next(_ids)
    _registry[key] = callback
    return GlobalHandle(key, callback)


def global_callbacks() -> list[TrainingCallback]:
    """Registered callbacks in registration order."""
    return [_registry[k] for k in sorted(_registry)]
