"""pytest fixtures for testing callbacks against loss curves (``replay_losses``, ``replay_run``), installed with
the package by its ``pytest11`` entry point; replay is imported only when a test asks for a fixture."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fsmtrain.tools.replay import ReplayResult


@pytest.fixture
def replay_losses() -> Callable[..., ReplayResult]:
    """:func:`fsmtrain.tools.replay.replay_losses`: callbacks driven by loss curves."""
    from fsmtrain.tools.replay import replay_losses as fn

    return fn


@pytest.fixture
def replay_run() -> Callable[..., ReplayResult]:
    """:func:`fsmtrain.tools.replay.replay_run`: replay a recorded ``events.jsonl``."""
    from fsmtrain.tools.replay import replay_run as fn

    return fn


__all__ = ["replay_losses", "replay_run"]
