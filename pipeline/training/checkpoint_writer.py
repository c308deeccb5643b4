"""Checkpoint writes off the training thread: the state is copied now, its bytes reach the disk later.

:func:`snapshot` copies an epoch's checkpoint state on the training thread (tensors to host memory,
containers copied), so training may change the live tensors at once. :class:`PendingWrite` holds the
one write in flight: with ``background=True`` it runs on one writer thread, which serialises the
snapshot and does the atomic, fsync'd file protocol while the next epoch trains. The training thread
collects the result at the next commit point (the next epoch's end, or ``train_end``) and only then
logs the files, so the log commits only what is durable, and where the commit lines fall in the log
does not depend on how fast the disk is. A failed write is raised on the training thread at the next
phase boundary that looks (:meth:`PendingWrite.raise_failure`) or at the commit point.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

__all__ = ["PendingWrite", "snapshot"]

T = TypeVar("T")
_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that shares no mutable part with it: tensors are copied to host memory
    (one device-to-host copy per tensor, once per checkpoint), dicts (their subclass and attributes
    kept, as ``state_dict()``'s ``_metadata``), lists and tuples are rebuilt, anything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, _IMMUTABLE):
        return obj
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps an OrderedDict's class and instance attributes
        for key, value in obj.items():
            out[key] = snapshot(value)
        return out
    if type(obj) is list:
        return [snapshot(v) for v in obj]
    if type(obj) is tuple:
        return tuple(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


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
