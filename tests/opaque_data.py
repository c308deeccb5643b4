"""A data builder whose train loader hides its shuffle generator from the trainer: the negative
control of the kill-and-resume harness (the data order cannot be restored, so a resumed run must
end with different weights)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fsmtrain.training.data import synthetic_regression


class OpaqueLoader:
    """Iterates like the wrapped loader but exposes no ``generator`` or ``sampler``."""

    def __init__(self, loader: Any) -> None:
        self._inner = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


def opaque_regression(**kwargs: Any) -> tuple[OpaqueLoader, Any]:
    train, val = synthetic_regression(**kwargs)
    return OpaqueLoader(train), val
