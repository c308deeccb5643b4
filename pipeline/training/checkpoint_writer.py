"""Checkpoint writes off the training thread: a small CPU state serialized there (its bytes are the snapshot),
any other staged into reused host buffers (pinned, on a side stream, for CUDA tensors), and one writer thread
with one write in flight and one state waiting."""

from __future__ import annotations

import contextlib
import copy
import io
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsmtrain.core.context import epoch_number
from fsmtrain.training.checkpoint_file import SavedCheckpoint
from fsmtrain.training.sharding import is_sharded_tensor

__all__ = ["SERIALIZED_AT_MOST", "SLOTS", "BufferSet", "CheckpointWriter", "Job", "LeftOut", "Staged", "WritePlan",
           "Written", "stage", "tensor_bytes"]

SLOTS = 2  # one slot being written, one staged and waiting
# A CPU state with at most this many bytes of tensors is serialized on the training thread: torch.save's pickling
# holds the GIL, and on the writer thread it made the training thread wait for it (benchmarks/RESULTS.md, issue 45).
# Above it the bytes cost more than the pickling (0.84 ms a MB against a memcpy's 0.1), so the state is staged.
SERIALIZED_AT_MOST = 1 << 20
Key = tuple[Hashable, ...]
LeftOut = tuple[int, str, int | None]  # a state left out: its epoch, why, and its step (a checkpoint at a step)


@dataclass
class Staged:
    """A staged state, and the event its CUDA copies complete at (None: nothing to wait for)."""

    state: Any
    ready: Any = None  # torch.cuda.Event
    staged_bytes: int = 0
    data: memoryview | None = None  # the file's bytes, when the state was serialized on the training thread

    def wait(self) -> None:
        """Block until every copy into the buffers has landed."""
        if self.ready is not None:
            self.ready.synchronize()


@dataclass(frozen=True)
class WritePlan:
    """One epoch's checkpoint, decided and staged on the training thread."""

    epoch: int
    periodic: bool
    roles: tuple[str, ...]  # "latest", "best": other names of the epoch's file
    staged: Staged  # the state, in host buffers no one else writes while it is pending
    chain_head: str | None  # the log's head the state stores
    path: Path  # epoch_<n>.pt, or step_<n>.pt
    step: int | None = None  # a checkpoint at a step: its global step


@dataclass(frozen=True)
class Written:
    """What one write left on disk, durable, for the log to commit."""

    saved: tuple[SavedCheckpoint, ...]
    chain_head: str | None  # the log's head the files store


@dataclass
class BufferSet:
    """Host buffers for one staged state, reused from checkpoint to checkpoint."""

    buffers: dict[Key, torch.Tensor] = field(default_factory=dict)
    allocations: int = 0  # buffers allocated so far (a reused buffer is not counted again)

    def buffer_for(self, key: Key, source: torch.Tensor, pinned: bool) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype or buf.is_pinned() != pinned:
            buf = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
            self.buffers[key] = buf
            self.allocations += 1
        return buf

    def release(self) -> None:
        self.buffers.clear()


class _Copier:
    """One staging pass: copies tensors into ``out``, issuing CUDA copies on one side stream."""

    def __init__(self, out: BufferSet) -> None:
        self.out = out
        self.seen: set[Key] = set()
        self.side: Any = None  # torch.cuda.Stream, made on the first CUDA tensor
        self.device: Any = None
        self.nbytes = 0

    def tensor(self, key: Key, value: torch.Tensor) -> torch.Tensor:
        if is_sharded_tensor(value):  # FSDP's shard: its local part into a reused buffer, as a DTensor again
            dt: Any = value
            staged: torch.Tensor = dt.from_local(self.tensor(key, dt.to_local()), dt.device_mesh, dt.placements,
                                                 shape=dt.shape, stride=dt.stride())
            return staged
        if value.layout is not torch.strided or value.is_quantized or type(value) is not torch.Tensor:
            return value.detach().clone().cpu()  # rare kinds: a fresh copy each time, no reuse
        self.seen.add(key)
        self.nbytes += value.numel() * value.element_size()
        cuda = value.device.type == "cuda"  # else a CPU tensor: a memcpy; another device (mps): a blocking copy
        if cuda and self.side is None:
            self.device = value.device
            self.side = torch.cuda.Stream(device=value.device)  # type: ignore[no-untyped-call]
            self.side.wait_stream(torch.cuda.current_stream(value.device))  # after the last optimizer step
        buf = self.out.buffer_for(key, value, pinned=cuda)
        with torch.cuda.stream(self.side) if cuda else contextlib.nullcontext():
            buf.copy_(value.detach(), non_blocking=cuda)  # no record_stream: the training stream waits (finish)
        return buf

    def finish(self) -> Any:
        """Order the training stream after the copies and record the event the writer waits on."""
        for key in [k for k in self.out.buffers if k not in self.seen]:
            del self.out.buffers[key]  # a tensor the state no longer has (a param group dropped)
        if self.side is None:
            return None
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.side)
        torch.cuda.current_stream(self.device).wait_event(done)  # the next step waits on the GPU, not the host
        return done

    def walk(self, key: Key, value: Any) -> Any:
        kind = type(value)
        if kind is str or kind is int or kind is float or kind is bool or value is None or kind is bytes:
            return value
        if isinstance(value, torch.Tensor):
            return self.tensor(key, value)
        if isinstance(value, dict):
            items = [(k, self.walk((*key, k), v)) for k, v in value.items()]
            if kind is not dict:  # an OrderedDict from state_dict(): rebuilt as its own type when it can be
                try:
                    return kind(items)
                except TypeError:
                    pass
            return dict(items)
        if kind is list or kind is tuple:
            return kind(self.walk((*key, i), v) for i, v in enumerate(value))
        return copy.deepcopy(value)


def _plain_cpu_bytes(state: Any, limit: int) -> int | None:
    """The bytes of ``state``'s tensors when all are plain CPU tensors and come to at most ``limit``, else None."""
    # Exact types first: this walks the whole state on the training thread at every checkpoint, and an
    # isinstance chain on each of its hundreds of numbers and names cost it half as long again.
    total = 0
    pending = [state]
    pop, extend = pending.pop, pending.extend
    while pending:
        value = pop()
        kind = type(value)
        if kind is dict:
            extend(value.values())
        elif kind is list or kind is tuple:
            extend(value)
        elif kind is torch.Tensor:
            if value.device.type != "cpu" or value.layout is not torch.strided:
                return None
            total += value.numel() * value.element_size()
            if total > limit:
                return None
        elif kind is str or kind is int or kind is float or kind is bool or value is None:
            continue
        elif isinstance(value, torch.Tensor):  # a subclass (a Parameter...): staged as a copy
            return None
        elif isinstance(value, dict):
            extend(value.values())
        elif isinstance(value, (list, tuple)):
            extend(value)
    return total


def stage(state: Any, out: BufferSet, serialized_at_most: int | None = SERIALIZED_AT_MOST) -> Staged:
    """A snapshot of ``state`` that shares nothing mutable with the live run: its file's bytes (a CPU state of
    at most ``serialized_at_most`` bytes of tensors; None: never), or a copy in ``out``'s buffers."""
    small = None if serialized_at_most is None else _plain_cpu_bytes(state, serialized_at_most)
    if small is not None:
        out.release()  # a state that grew past the limit and shrank again is staged afresh
        data = io.BytesIO()
        torch.save(state, data)
        return Staged(None, staged_bytes=small, data=data.getbuffer())
    copier = _Copier(out)
    staged = copier.walk((), state)
    return Staged(staged, copier.finish(), copier.nbytes)


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state``: what a file of it holds at least."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, (dict, list, tuple)):
        return sum(tensor_bytes(v) for v in (state.values() if isinstance(state, dict) else state))
    return 0


@dataclass(frozen=True)
class Job:
    """One staged state to write: ``run`` writes and commits it (on the writer thread)."""

    epoch: int
    slot: int
    best: bool
    run: Callable[[], None]
    step: int | None = None  # a checkpoint at a step: its global step

    @property
    def named(self) -> str:
        return named_state(self.epoch, self.step)


def named_state(epoch: int, step: int | None) -> str:
    """A state as a person reads it: ``epoch 5``, or ``step 120 (in epoch 5)``."""
    return f"epoch {epoch_number(epoch)}" if step is None else f"step {step} (in epoch {epoch_number(epoch)})"


class CheckpointWriter:
    """The writer thread and its two slots (``background=False``: each job runs at once on the caller). A
    failed write is raised on the training thread at its next look; nothing more is written after it."""

    def __init__(self, background: bool, on_dropped: Callable[[int, str, int | None], None] | None = None) -> None:
        self.background = background
        self._on_dropped = on_dropped  # a waiting state dropped on the writer thread (after a failure)
        self._cond = threading.Condition()
        self._in_flight: Job | None = None  # claimed for writing (the thread may not have begun it)
        self._waiting: Job | None = None
        self._failure: BaseException | None = None
        self._failed = False  # a write failed: nothing more is written
        self._thread: threading.Thread | None = None
        self._closing = False
        self.written = 0  # jobs done, for tests and benchmarks

    # --- the training thread ---------------------------------------------------------------
    def claim_slot(self, epoch: int, best: bool, final: bool,
                   step: int | None = None) -> tuple[int | None, LeftOut | None]:
        """A slot to stage ``epoch``'s state into (None: it is left out), and the state left out, if any. A
        waiting state is dropped for it, except that a waiting ``best`` is never dropped for one that is not
        (this one is left out); a ``final`` state waits."""
        with self._cond:
            self._check_open()
            if self._in_flight is None:
                return 0, None
            if self._waiting is None:
                return 1 - self._in_flight.slot, None
            waiting = self._waiting
            behind = f"the write of {self._in_flight.named} (the writer is behind: a slow disk or a busy CPU"
            if waiting.best and not best:
                if not final:
                    return None, (epoch, f"the state of {named_state(epoch, step)} was left out: the best state of "
                                         f"{waiting.named} still waits to be written behind {behind}); a best "
                                         "state is never dropped for a newer one that is not", step)
                while self._waiting is waiting and not self._failed:  # the run's last state: worth a wait
                    self._cond.wait()
                self._check_open()
                return (0 if self._in_flight is None else 1 - self._in_flight.slot), None
            self._waiting = None
            return waiting.slot, (waiting.epoch, f"the state of {waiting.named} was left out: the state of "
                                                 f"{named_state(epoch, step)} replaced it while it waited behind "
                                                 f"{behind}; the newest state is written)", waiting.step)

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
            elif self._waiting is None:
                self._waiting = job
            else:
                raise RuntimeError("a checkpoint state is already waiting: ask claim_slot() before staging")
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fsmtrain-checkpoint", daemon=True)
                self._thread.start()

    def raise_failure(self) -> None:
        """Raise a failed write's error (once); never waits."""
        with self._cond:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def busy_slots(self) -> set[int]:
        with self._cond:
            return {j.slot for j in (self._in_flight, self._waiting) if j is not None}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight or waiting (a failed write counts as done); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (self._in_flight is None and self._waiting is None) or self._failed, timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every handed-over state is written, raising a failed write's error; False on timeout."""
        done = self.wait_idle(timeout)
        self.raise_failure()
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Stop the (daemon) writer thread once it is idle; False: still writing after ``timeout`` seconds."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    # --- the writer thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._in_flight is not None or self._closing)
                job = self._in_flight
                if job is None:
                    return
            self._write(job)

    def _write(self, job: Job) -> None:
        try:
            job.run()
        except BaseException as exc:  # kept for the training thread: it decides how the run ends
            with self._cond:
                self._failure, self._failed = exc, True
                dropped, self._waiting, self._in_flight = self._waiting, None, None
                self._cond.notify_all()
            if dropped is not None and self._on_dropped is not None:
                self._on_dropped(dropped.epoch, f"the state of {dropped.named} was left out: the write of "
                                                f"{job.named} failed before it ({type(exc).__name__}: {exc})",
                                 dropped.step)
            return
        with self._cond:
            self.written += 1
            if self._in_flight is job:
                self._in_flight, self._waiting = self._waiting, None
            self._cond.notify_all()

    def _check_open(self) -> None:
        self.raise_failure()
        if self._failed:
            raise RuntimeError("an earlier checkpoint write failed: nothing more is written in this run")
