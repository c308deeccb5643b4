"""Staging a checkpoint: the state copied into host buffers, so training may go on at once.

:class:`BufferSet` holds one host buffer per tensor of the state, keyed by where the tensor sits in
the state (``("model", "fc.weight")``, ``("optimizer", "state", 0, "exp_avg")``). A buffer is
allocated the first time its key is staged and reused at every later checkpoint; it is allocated
again only when that tensor's shape or dtype changed, and :meth:`BufferSet.release` frees them all
(``train_end``).

:func:`stage` walks the state: every tensor is copied into its buffer, every container (dict, list,
tuple) is rebuilt around the copies, and other values are kept (numbers, strings) or deep-copied.
What it returns shares nothing mutable with the live run: the next epoch may train while a writer
thread serialises the staged state.

A CPU tensor is copied at once (one ``memcpy``). A CUDA tensor is copied into a pinned buffer with
``non_blocking=True`` on a side stream that first waits for the tensor's stream (so the copy is
ordered after the last optimizer step); the training stream then waits for the side stream (so
the next optimizer step cannot overwrite a tensor while it is being copied), and an event is
recorded. Nothing here waits for the GPU: :meth:`Staged.wait` (the writer thread) does.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BufferSet", "Staged", "stage", "tensor_bytes"]

Key = tuple[Hashable, ...]


@dataclass
class Staged:
    """A staged state, and the event its CUDA copies complete at (None: nothing to wait for)."""

    state: Any
    ready: Any = None  # torch.cuda.Event
    staged_bytes: int = 0

    def wait(self) -> None:
        """Block until every copy into the buffers has landed (the writer thread, before it reads them)."""
        if self.ready is not None:
            self.ready.synchronize()


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

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

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
        if value.layout is not torch.strided or value.is_quantized or type(value) is not torch.Tensor:
            return value.detach().clone().cpu()  # rare kinds: a fresh copy each time, no reuse
        self.seen.add(key)
        self.nbytes += value.numel() * value.element_size()
        if value.device.type == "cuda":
            return self._cuda(key, value)
        buf = self.out.buffer_for(key, value, pinned=False)
        buf.copy_(value.detach())  # a CPU tensor: a memcpy; another device (mps): a blocking copy
        return buf

    def _cuda(self, key: Key, value: torch.Tensor) -> torch.Tensor:
        if self.side is None:
            self.device = value.device
            self.side = torch.cuda.Stream(device=value.device)  # type: ignore[no-untyped-call]
            self.side.wait_stream(torch.cuda.current_stream(value.device))  # after the last optimizer step
        buf = self.out.buffer_for(key, value, pinned=True)
        with torch.cuda.stream(self.side):
            buf.copy_(value.detach(), non_blocking=True)
        # No record_stream: the training stream waits for these copies (finish), so nothing it frees
        # or reuses is touched before they are done.
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
            return dict(items) if kind is dict else _rebuilt(value, items)
        if kind is list:
            return [self.walk((*key, i), v) for i, v in enumerate(value)]
        if kind is tuple:
            return tuple(self.walk((*key, i), v) for i, v in enumerate(value))
        return copy.deepcopy(value)


def _rebuilt(original: dict[Any, Any], items: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A dict subclass (``OrderedDict`` from ``state_dict()``) rebuilt as its own type, when it can be."""
    try:
        out: dict[Any, Any] = type(original)(items)
    except TypeError:
        return dict(items)
    return out


def stage(state: Any, out: BufferSet) -> Staged:
    """Copy ``state`` into ``out``'s buffers (see the module docstring); returns what was staged."""
    copier = _Copier(out)
    staged = copier.walk((), state)
    return Staged(staged, copier.finish(), copier.nbytes)


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (dicts, lists and tuples walked): what a file of it
    holds at least. A foreground write's :class:`Staged` carries it, as a staged one does."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0
