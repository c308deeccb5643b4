"""SIGTERM and SIGINT set a flag; the machine's guards route the run to ``train_end``.

A signal handler runs between any two bytecodes of the main thread: in the middle of writing an
event line or a checkpoint. So the handlers here only record the signal on the run
(``RunContext.pending_signal``); the engine's ``immediate_stop`` fact reads it, the per-batch guard
stops the batch loop, and at the next phase boundary the engine raises :class:`Interrupted`, which
takes the ordinary fault path (``abort``, reason INTERRUPTED, the whole teardown, the ``result``).
A second signal during teardown only sets the flag again. Exit code: 128 + the signal number
(130 for SIGINT, 143 for SIGTERM).

In a command that latched its signals (:mod:`fsmtrain.core.signal_latch`) the latch keeps its
handlers: the run listens to it, and starts with a signal the latch received before it began.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from fsmtrain.core.context import RunContext
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.signal_latch import installed

__all__ = ["HANDLED", "Interrupted", "signals_set_flag"]

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_set_flag(run: RunContext) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM only set ``run.pending_signal`` (main thread only:
    Python delivers signals there; elsewhere the process keeps its handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    latch = installed()
    if latch is not None:
        def flag(signum: int) -> None:
            if run.pending_signal is None:
                run.pending_signal = signum

        if latch.signum is not None:
            flag(latch.signum)
        with latch.listening(flag):
            yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if run.pending_signal is None:
            run.pending_signal = signum

    previous: dict[signal.Signals, Any] = {}
    for sig in HANDLED:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
