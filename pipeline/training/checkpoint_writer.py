"""Checkpoint writes off the training thread: the bytes are made now, they reach the disk later.

The training thread serialises an epoch's state (so training may change the live tensors at once);
:class:`PendingWrite` holds the one write in flight: with ``background=True`` it runs on one writer
thread, which does the atomic, fsync'd file protocol, and logs the files once they are durable, while
the next epoch trains. The training thread waits for it at the next commit point (the next epoch's
end, or ``train_end``). A failed write is raised on the training thread at the next phase boundary
that looks (:meth:`PendingWrite.raise_failure`) or at the commit point.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["PendingWrite"]

T = TypeVar("T")


class PendingWrite(Generic[T]):
    """At most one write in flight. ``background=False`` runs each job at once on the calling
    thread (its error raised there and then); the protocol around it is the same."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[T] | None = None

    def submit(self, job: Callable[[], T]) -> None:
        if self._future is not None:
            raise RuntimeError("a checkpoint write is still pending: collect it with wait() first")
        if not self.background:
            done: Future[T] = Future()
            done.set_result(job())
            self._future = done
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsmtrain-checkpoint")
        self._future = self._executor.submit(job)

    def raise_failure(self) -> None:
        """Raise the pending write's error if it has already failed; never waits."""
        future = self._future
        if future is not None and future.done() and future.exception() is not None:
            self._future = None
            raise future.exception()  # type: ignore[misc]

    def wait(self) -> T | None:
        """The pending write's result (None when there is none), after waiting for it; its error is raised here."""
        future, self._future = self._future, None
        return None if future is None else future.result()

    def close(self) -> None:
        """Stop the writer thread (after the pending write, if any, finishes)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
