"""SIGINT and SIGTERM, latched for the life of a command: recorded where they land, acted on where
that is safe.

Python runs a signal handler between any two bytecodes, and SIGTERM's default kills the process
where it stands: in the middle of the start-up's claim of the run directory, of writing
``model.pt``, of the teardown. ``fsmtrain train`` and ``fsmtrain resume`` therefore :func:`install`
a latch first thing and keep it until their exit status is decided:

- during start-up a signal is honoured before the run directory is claimed, or before the run
  starts (the job lets the claim go): :meth:`SignalLatch.raise_if_signalled`;
- while a run trains, the run gets the signal too (``fsmtrain.training.signals``) and ends
  INTERRUPTED at its next boundary;
- during the teardown it waits until the teardown (``model.pt``, ``lifecycle.mmd``, the
  ``result``) is done;
- the exit status is 128 + the first signal (130, 143), never a death by the signal:
  :meth:`SignalLatch.exit_status`.

The process that owns the command then :meth:`~SignalLatch.settle`\\ s: it runs its exit handlers
and ends with the command's status, or 128 + a signal that reached it before it ends. A command
run in-process (tests call ``fsmtrain.cli.main`` with arguments) :func:`uninstall`\\ s instead,
giving back the handlers it found.
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

from fsmtrain.core.engine import Interrupted

__all__ = ["HANDLED", "SignalLatch", "install", "installed", "latched", "uninstall"]

HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class SignalLatch:
    """The signals a command received: ``signum`` is the first, ``count`` how many."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.expected: str | None = None  # what a signal now means, when the command knows one is coming
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
        """Honour a latched signal here: raise :class:`~fsmtrain.core.engine.Interrupted`."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def said(self, final: int) -> str:
        """The line that names the signal received: its exit status, or what it was expected as
        (:attr:`expected`, set where the command has said its last word already)."""
        if self.expected is not None:
            return f"fsmtrain: {self.name} received: {self.expected}"
        return f"fsmtrain: {self.name} received; exit code {final}"

    def exit_status(self, code: int) -> int:
        """The command's exit status: 128 + the first signal when one was received, else ``code``."""
        return code if self.signum is None else 128 + self.signum

    def settle(self, code: int) -> NoReturn:
        """End the process that owns the command: with ``code``, or 128 + the first signal that
        reached it before it ends (said on stderr). The exit handlers (W&B's, multiprocessing's...)
        and the threads the interpreter would wait for run here, with the latch in place; then the
        process ends at once, never by a signal and never in the interpreter's own finalization.

        Python runs a handler only when the main thread is back in Python code, and a signal that
        lands while an exit handler is in C code may see none before the end (found: SIGTERM
        10-30 ms after the ``result`` line, during torch's exit handlers, exited 0 with no word).
        So the C-level handler's own record is read as well: the wakeup fd gets one byte per signal
        as it lands, and the last look blocks the signals in this thread and reads that pipe and
        what is still pending."""
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        try:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
            arrived = [*_drained(read_end), *sorted(signal.sigpending() & set(HANDLED))]
            if self.signum is None and arrived:  # (a signal Python did handle is in the pipe too)
                self.signum = int(arrived[0])
            final = self.exit_status(code)
            with contextlib.suppress(Exception):
                if final != code:
                    print(self.said(final), file=sys.stderr)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(final)


def _drained(fd: int) -> list[int]:
    """The signal numbers the C-level handler wrote to the wakeup fd ``fd`` (non-blocking)."""
    got = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 512):
            got += chunk
    return [n for n in got if n in HANDLED]


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


@contextlib.contextmanager
def latched() -> Iterator[SignalLatch | None]:
    """The process's latch for the block: the one its command installed (kept after the block), or
    one installed for the block and given back after it (None off the main thread)."""
    if _installed is not None:
        yield _installed
        return
    latch = install()
    try:
        yield latch
    finally:
        if latch is not None:
            uninstall()


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
