"""What a user runs: the ``Trainer`` facade, run configs, one seed's job and HPO studies. ``Trainer``
is re-exported lazily, so a torch-free module of this package imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsmtrain.core.exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"Trainer": "fsmtrain.app.trainer"})
__all__ = ["Trainer"]

if TYPE_CHECKING:
    from fsmtrain.app.trainer import Trainer
