"""pytest fixtures for testing callbacks against loss curves, registered through the ``pytest11``
entry point ``fsmtrain`` (installed with the package; nothing to add to ``conftest.py``)::

    def test_my_stopper(replay_losses):
        assert replay_losses(train=[3, 2, 1, 1, 1], val=[3, 2, 2, 2, 2], callbacks=[MyStopper(2)]).stop_epoch == 4

``replay_losses`` is :func:`fsmtrain.tools.replay.replay_losses`; ``replay_run`` is
:func:`fsmtrain.tools.replay.replay_run` (replay a recorded ``events.jsonl``). The replay module, and with
it torch, is imported only when a test asks for one of them, so other test suites pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fsmtrain.tools.replay import ReplayResult


@pytest.fixture
def replay_losses() -> Callable[..., ReplayResult]:
    """``replay_losses(train=[...], val=[...], callbacks=[...], max_epochs=None, metrics=None, lrs=None)``:
    drive the callbacks through the real lifecycle machine; returns a ``ReplayResult``."""
    from fsmtrain.tools.replay import replay_losses as fn

    return fn


@pytest.fixture
def replay_run() -> Callable[..., ReplayResult]:
    """``replay_run(events_path, callbacks=None, overrides=None)``: replay a recorded run."""
    from fsmtrain.tools.replay import replay_run as fn

    return fn


__all__ = ["replay_losses", "replay_run"]
