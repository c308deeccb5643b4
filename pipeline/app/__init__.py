"""What a user runs: the ``Trainer`` facade, run configs (YAML), one seed's job and HPO studies.

``Trainer`` is re-exported lazily, so importing a torch-free module of this package (the
``fsmtrain hpo`` parser, the study storage) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from fsmtrain.app.trainer import Trainer

        globals()["Trainer"] = Trainer  # later lookups skip this function
        return Trainer
    raise AttributeError(f"module 'fsmtrain.app' has no attribute {name!r}")


if TYPE_CHECKING:
    from fsmtrain.app.trainer import Trainer
