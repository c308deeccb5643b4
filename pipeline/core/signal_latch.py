"""SIGINT and SIGTERM, latched for the life of a command: recorded where they land, acted on where
that is safe.

Python runs a signal handler between any two bytecodes, and SIGTERM's default kills the process
where it stands: in the middle of the start-up's claim of the run directory, of writing
``model.pt``, of the teardown. ``fsmtrain train`` and ``fsmtrain resume`` therefore :func:`install`
a latch first thing and keep it until their exit status is decided:

- during start-up a signal is honoured before the run directory is claimed, or before the run
  starts (the job lets the claim go): :meth:`SignalLatch.raise_if_signalled`;
- while a run trains, the run gets the signal too (``pipeline.training.signals``) and ends
  INTERRUPTED at its next boundary;
- during the teardown it waits until the teardown (``model.pt``, ``lifecycle.mmd``, the
  ``result``) is done;
- the exit status is 128 + the first signal (130, 143), never a death by the signal:
  :meth:`SignalLatch.exit_status`.

Once the status is decided, the process that owns the command :meth:`~SignalLatch.settle`\\ s: it
runs its exit handlers and ends with that status; a signal after the decision is ignored and said
so on stderr. A command run in-process (tests call
``pipeline.cli.main`` with arguments) :func:`uninstall`\\ s instead, giving back the handlers it found.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

from pipeline.core.engine import Interrupted

__all__ = ["HANDLED", "SignalLatch", "install", "installed", "uninstall"]

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class SignalLatch:
    """The signals a command received: ``signum`` is the first, ``count`` how many."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._listeners: list[Callable[[int], None]] = []
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        for listener in tuple(self._listeners):
            listener(signum)

    @contextlib.contextmanager
    def listening(self, listener: Callable[[int], None]) -> Iterator[None]:
        """While the block runs, ``listener(signum)`` is called with every signal as it lands."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)

    @property
    def name(self) -> str:
        return "" if self.signum is None else signal.Signals(self.signum).name

    def raise_if_signalled(self) -> None:
        """Honour a latched signal here: raise :class:`~pipeline.core.engine.Interrupted`."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def exit_status(self, code: int) -> int:
        """The command's exit status: 128 + the first signal when one was received, else ``code``."""
        return code if self.signum is None else 128 + self.signum

    def settle(self, code: int) -> NoReturn:
        """The exit status is decided: end the process with it. A signal from now on is ignored,
        and said so on stderr. The exit handlers (W&B's, multiprocessing's...) and the threads the
        interpreter would wait for are run here, while the handler that says so is still Python's;
        then the process ends at once. (Left to the interpreter's own exit, a signal landing during
        its finalization, after Python reset the handlers, went unreported or killed the process.)"""

        def late(signum: int, frame: FrameType | None) -> None:
            with contextlib.suppress(OSError):
                os.write(2, f"fsmtrain: {signal.Signals(signum).name} arrived after the exit status ({code}) was "
                            "decided; ignored\n".encode())

        for sig in HANDLED:
            signal.signal(sig, late)
        try:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)


_installed: SignalLatch | None = None


def install() -> SignalLatch | None:
    """Latch SIGINT and SIGTERM for this process (main thread only: Python delivers signals there;
    elsewhere nothing is installed and None is returned)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    if _installed is not None:
        return _installed
    latch = SignalLatch()
    for sig in HANDLED:
        latch._previous[sig] = signal.signal(sig, latch._handle)
    _installed = latch
    return latch


def installed() -> SignalLatch | None:
    """The latch of this process, when a command installed one."""
    return _installed


def uninstall() -> None:
    """Give back the handlers the latch replaced (the latch's record stays readable)."""
    global _installed
    latch, _installed = _installed, None
    if latch is None:
        return
    for sig, old in latch._previous.items():
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
