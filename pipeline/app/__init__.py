"""What a user runs: the ``Trainer`` facade, run configs (YAML), one seed's job and HPO studies.

``Trainer`` is re-exported lazily, so importing a torch-free module of this package (the
``fsmtrain hpo`` parser, the study storage) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.app.own_packages import keep_own_callbacks

__all__ = ["Trainer"]

# Before anything here imports ``callbacks``: a user's folder of that name on the import path (the
# working folder of a notebook or of ``python -m``) must not stand in for fsmtrain's.
keep_own_callbacks()


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from pipeline.app.trainer import Trainer

        globals()["Trainer"] = Trainer  # later lookups skip this function
        return Trainer
    raise AttributeError(f"module 'pipeline.app' has no attribute {name!r}")


if TYPE_CHECKING:
    from pipeline.app.trainer import Trainer
