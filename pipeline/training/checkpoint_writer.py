"""Checkpoint writes off the training thread: at most one write in flight and one state waiting.

The training thread stages an epoch's state (:mod:`fsmtrain.training.staging`) into one of two
buffer sets ("slots") and hands it to the :class:`CheckpointWriter`. One writer thread writes the
states in the order they came, one at a time. A slow disk never holds training up:

- :meth:`CheckpointWriter.make_room`, asked before staging, gives a free slot. When a write is in
  flight and another state already waits, the waiting one is dropped (latest wins) and its slot
  reused, unless it holds a ``best`` state and the new one does not: then the new one is not
  staged at all. Either way the caller learns which epoch was left out and why, and logs it.
- The run's final state is never left out: for it, ``make_room`` waits for a slot (``train_end``
  waits for every write anyway).

With ``background=False`` each job runs at once on the calling thread. A failed write is kept and
raised on the training thread at the next look (:meth:`CheckpointWriter.raise_failure`, the next
``make_room``, or :meth:`CheckpointWriter.drain`); from then on nothing more is written, and a
state still waiting is dropped (and reported as such).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from fsmtrain.core.context import epoch_number

__all__ = ["CheckpointWriter", "Job", "Room", "SLOTS"]

SLOTS = 2  # one slot being written, one staged and waiting


@dataclass(frozen=True)
class Job:
    """One staged state to write: ``run`` writes and commits it (on the writer thread)."""

    epoch: int
    slot: int
    best: bool
    run: Callable[[], None]


@dataclass(frozen=True)
class Room:
    """What :meth:`CheckpointWriter.make_room` decided for a new state of ``epoch``."""

    slot: int | None  # where to stage it; None: it is left out (``skipped`` says why)
    dropped: int | None = None  # the waiting state's epoch, dropped to make room
    dropped_why: str = ""
    skipped: str = ""  # why the new state itself is left out


class CheckpointWriter:
    """The writer thread and its two slots (see the module docstring)."""

    def __init__(self, background: bool, on_dropped: Callable[[int, str], None] | None = None) -> None:
        self.background = background
        self._on_dropped = on_dropped  # a state dropped on the writer thread (after a failure)
        self._cond = threading.Condition()
        self._in_flight: Job | None = None  # claimed for writing (the thread may not have begun it)
        self._waiting: Job | None = None
        self._failure: BaseException | None = None
        self._failed = False  # a write failed: nothing more is written
        self._thread: threading.Thread | None = None
        self._closing = False
        self.written = 0  # jobs done, for tests and benchmarks

    # --- the training thread ---------------------------------------------------------------
    def make_room(self, epoch: int, best: bool, final: bool) -> Room:
        """A slot to stage the state of ``epoch`` into (see the module docstring)."""
        with self._cond:
            self._check_open()
            if self._in_flight is None:
                return Room(0)
            if self._waiting is None:
                return Room(1 - self._in_flight.slot)
            waiting = self._waiting
            if waiting.best and not best:
                if not final:
                    return Room(None, skipped=f"the best state of epoch {epoch_number(waiting.epoch)} is still "
                                              "waiting to be written behind the write of epoch "
                                              f"{epoch_number(self._in_flight.epoch)} (a slow disk); a best state "
                                              "is never dropped for a newer one that is not")
                while self._waiting is waiting and not self._failed:  # the run's last state: worth a wait
                    self._cond.wait()
                self._check_open()
                return Room(1 - self._in_flight.slot) if self._in_flight is not None else Room(0)
            self._waiting = None
            return Room(waiting.slot, dropped=waiting.epoch,
                        dropped_why=f"the state of epoch {epoch_number(epoch)} replaced it while it waited behind the "
                                    f"write of epoch {epoch_number(self._in_flight.epoch)} (a slow disk: the newest "
                                    "state is written)")

    def submit(self, job: Job) -> None:
        """Write ``job`` now (foreground), or hand it to the writer thread."""
        if not self.background:
            self._check_open()
            try:
                job.run()
            except BaseException:
                self._failed = True
                raise
            self.written += 1
            return
        with self._cond:
            self._check_open()
            if self._in_flight is None:
                self._in_flight = job
            else:
                if self._waiting is not None:
                    raise RuntimeError("a checkpoint state is already waiting: ask make_room() before staging")
                self._waiting = job
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fsmtrain-checkpoint", daemon=True)
                self._thread.start()

    def raise_failure(self) -> None:
        """Raise a failed write's error (once); never waits."""
        with self._cond:
            self._raise_pending()

    def busy_slots(self) -> set[int]:
        with self._cond:
            return {j.slot for j in (self._in_flight, self._waiting) if j is not None}

    def drain(self) -> None:
        """Wait until every handed-over state is written; a failed write's error is raised here."""
        with self._cond:
            while (self._in_flight is not None or self._waiting is not None) and not self._failed:
                self._cond.wait()
            self._raise_pending()

    def wait_idle(self) -> None:
        """Wait until nothing is in flight or waiting (a failed write counts as done); raises nothing."""
        with self._cond:
            while (self._in_flight is not None or self._waiting is not None) and not self._failed:
                self._cond.wait()

    def close(self) -> None:
        """Stop the writer thread once it is idle (after :meth:`drain`, or after a failure)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    # --- the writer thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._in_flight is None and not self._closing:
                    self._cond.wait()
                job = self._in_flight
                if job is None:
                    return
            self._write(job)

    def _write(self, job: Job) -> None:
        dropped: Job | None = None
        try:
            job.run()
        except BaseException as exc:  # kept for the training thread: it decides how the run ends
            with self._cond:
                self._failure, self._failed = exc, True
                dropped, self._waiting = self._waiting, None
                self._in_flight = None
                self._cond.notify_all()
            if dropped is not None and self._on_dropped is not None:
                self._on_dropped(dropped.epoch, f"the write of epoch {epoch_number(job.epoch)} failed before it "
                                                f"({type(exc).__name__}: {exc})")
            return
        with self._cond:
            self.written += 1
            if self._in_flight is job:
                self._in_flight, self._waiting = self._waiting, None
            self._cond.notify_all()

    def _raise_pending(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _check_open(self) -> None:
        self._raise_pending()
        if self._failed:
            raise RuntimeError("an earlier checkpoint write failed: nothing more is written in this run")
