"""What a user runs: the ``Trainer`` facade, run configs (YAML) and one seed's job.

``Trainer`` is re-exported lazily, so ``pipeline.app.config`` (``fsmtrain validate``) can be
imported without the trainer and torch behind it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from pipeline.app.trainer import Trainer

        globals()["Trainer"] = Trainer  # later lookups skip this function
        return Trainer
    raise AttributeError(f"module 'pipeline.app' has no attribute {name!r}")


if TYPE_CHECKING:
    from pipeline.app.trainer import Trainer
