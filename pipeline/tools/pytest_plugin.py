"""pytest fixtures for testing callbacks against loss curves, installed with the package (the
``pytest11`` entry point ``fsmtrain``; nothing to add to ``conftest.py``)::

    def test_my_stopper(replay_losses):
        assert replay_losses(train=[3, 2, 1, 1, 1], val=[3, 2, 2, 2, 2], callbacks=[MyStopper(2)]).stop_epoch == 4

Replay is imported only when a test asks for a fixture, so other test suites pay nothing.
"""

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
