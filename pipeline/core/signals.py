"""SIGINT, SIGTERM and SIGUSR1: the one module that handles them. The first signal is recorded: the run
ends INTERRUPTED at its next safe point, the command exits 128 + the signal. A second SIGINT while a run
trains raises ``KeyboardInterrupt`` at once (only recorded in the teardown); a third gets the handler found
before, or the default action. SIGUSR1 is a pre-emption notice as SIGTERM is (exit 143)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from fsmtrain.core.engine import Interrupted, exit_status_of
from fsmtrain.core.lifecycle import FINAL

if TYPE_CHECKING:
    from fsmtrain.core.context import RunContext

__all__ = ["HANDLED", "NOTICES", "PREEMPTION", "Signals", "caught", "install", "installed", "preemption_signals",
           "sigterm_interrupts", "stop_on_signals", "uninstall"]

PREEMPTION: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)  # the default pre-emption notices
HANDLED: tuple[signal.Signals, ...] = (signal.SIGINT, *PREEMPTION)
# What a run may take as a pre-emption notice (SLURM's --signal, LSF and SGE send USR1, USR2 or XCPU).
NOTICES: tuple[signal.Signals, ...] = (*PREEMPTION, signal.SIGUSR2, signal.SIGHUP, signal.SIGXCPU)


def preemption_signals(names: Iterable[str]) -> tuple[signal.Signals, ...]:
    """The signals ``names`` say (``SIGUSR1``, or ``USR1`` as SLURM writes it); a ValueError names a wrong one."""
    known = {sig.name: sig for sig in NOTICES}
    names = list(names)
    found = [known.get(n if str(n).startswith("SIG") else f"SIG{n}") for n in names]
    wrong = [repr(n) for n, sig in zip(names, found, strict=True) if sig is None]
    if wrong or not names:
        raise ValueError(f"one or more pre-emption signals of {', '.join(known)} (USR1 also reads as SIGUSR1); "
                         f"got {', '.join(wrong) or 'none'}")
    return tuple(dict.fromkeys(sig for sig in found if sig is not None))


class Signals:
    """The signals a command received (``signum``: the first) and the run that gets them now."""

    def __init__(self, owns_process: bool, escalate: bool = True) -> None:
        self.signum: int | None = None
        self.escalate = escalate  # a second SIGINT interrupts at once (not in an hpo worker: see caught)
        self.sigints = 0
        self.run: RunContext | None = None
        self.previous: dict[signal.Signals, Any] = {sig: signal.getsignal(sig) for sig in HANDLED}
        self.owns_process = owns_process
        self.expected: str | None = None  # what a signal now means, when the command knows one is coming

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        run = self.run
        if run is not None and run.pending_signal is None:
            run.pending_signal = signum
        if signum != signal.SIGINT or not self.escalate:
            return
        self.sigints += 1
        if self.sigints == 2:  # the next one gets the handler found before, or the default action
            signal.signal(signal.SIGINT, signal.SIG_DFL if self.owns_process else _handler(self.previous, signum))
            if run is not None and run.phase is not FINAL:  # in the teardown it would cut the result short
                signal.default_int_handler(signum, frame)

    @property
    def name(self) -> str:
        return "" if self.signum is None else signal.Signals(self.signum).name

    def raise_if_signalled(self) -> None:
        """Honour a recorded signal here: raise :class:`~fsmtrain.core.engine.Interrupted`."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def said(self, final: int) -> str:
        """The line that names the signal received: its exit status, or what it was expected as."""
        if self.expected is not None:
            return f"fsmtrain: {self.name} received: {self.expected}"
        return f"fsmtrain: {self.name} received; exit code {final}"

    def exit_status(self, code: int) -> int:
        """The command's exit status: 128 + the first signal when one was received, else ``code``."""
        return code if self.signum is None else exit_status_of(self.signum)


def _handler(previous: dict[signal.Signals, Any], sig: int) -> Any:
    found = previous[signal.Signals(sig)]
    return signal.SIG_DFL if found is None else found  # None: set from C, not restorable; the default then


_installed: Signals | None = None


def install(owns_process: bool = False, escalate: bool = True) -> Signals | None:
    """Handle SIGINT and SIGTERM in this process (the main thread only, else None); idempotent."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    if _installed is None:
        _installed = Signals(owns_process, escalate)
        for sig in HANDLED:
            signal.signal(sig, _installed.handle)
    return _installed


def installed() -> Signals | None:
    """This process's :class:`Signals`, when a command or a run installed them."""
    return _installed


def uninstall(default: bool = False) -> None:
    """Put back the handlers found at :func:`install` (``default``: the default actions)."""
    global _installed
    signals, _installed = _installed, None
    if signals is not None:
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_DFL if default else _handler(signals.previous, sig))


@contextlib.contextmanager
def caught(escalate: bool = True) -> Iterator[Signals | None]:
    """The process's :class:`Signals` for the block (None off the main thread); ``escalate=False`` (an hpo
    worker, whose study forwards a Ctrl-C): a second SIGINT is only recorded."""
    if _installed is not None:
        yield _installed
        return
    signals = install(escalate=escalate)
    try:
        yield signals
    finally:
        if signals is not None:
            uninstall()


@contextlib.contextmanager
def stop_on_signals(run: RunContext, notices: Iterable[signal.Signals] = PREEMPTION) -> Iterator[None]:
    """While the block trains ``run``, SIGINT or a notice of ``notices`` sets ``run.pending_signal``; a
    default notice left out of ``notices`` gets its handler found before for the block."""
    with caught() as signals:
        if signals is None:
            yield
            return
        if run.pending_signal is None:
            run.pending_signal = signals.signum
        signals.run = run
        notices = set(notices)
        swapped = {sig: signal.signal(sig, signals.handle if sig in notices else _handler(signals.previous, sig))
                   for sig in notices.symmetric_difference(PREEMPTION)}
        try:
            yield
        finally:
            signals.run = None
            for sig, before in swapped.items():
                signal.signal(sig, before)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`~fsmtrain.core.engine.Interrupted`, so a command waiting
    on workers stops them instead of leaving them orphaned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
