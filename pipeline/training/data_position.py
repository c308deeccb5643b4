"""Where a resumed epoch starts: after the batches a checkpoint at a step had done. A map-style ``DataLoader``
starts its batch sampler there; any other loader loads and drops them, and says so."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from fsmtrain.core.context import EpochContext

__all__ = ["SkippedBatches", "batches_from", "loader_like"]


class SkippedBatches:
    """``inner``'s batches from batch ``skip`` on: the skipped ones cost their indices only."""

    def __init__(self, inner: Iterable[list[int]], skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]


def batches_from(loader: Iterable[Any], skip: int, epoch: EpochContext,
                 epoch_rng: torch.Tensor | None) -> Iterator[Any]:
    """``loader``'s batches of ``epoch`` from batch ``skip`` on, in the epoch's order; ``epoch_rng``: the
    global torch RNG state as the epoch began, set while the order is drawn."""
    now = torch.get_rng_state()
    if epoch_rng is not None:
        torch.set_rng_state(epoch_rng)
    try:
        batches = _skipping(loader, skip, epoch)
        first = next(batches, _END)  # the epoch's order is drawn now, from the epoch's RNG
        return iter(()) if first is _END else itertools.chain((first,), batches)
    finally:
        if epoch_rng is not None:
            torch.set_rng_state(now)


_END = object()


def _skipping(loader: Iterable[Any], skip: int, epoch: EpochContext) -> Iterator[Any]:
    if isinstance(loader, DataLoader) and loader.batch_sampler is not None \
            and not isinstance(loader.dataset, IterableDataset):
        return iter(loader_like(loader, batch_sampler=SkippedBatches(loader.batch_sampler, skip)))
    epoch.warn("resume", f"the train loader ({type(loader).__name__}) cannot start at a batch index: the "
                   f"{skip} batch(es) this epoch had done before the checkpoint are loaded and dropped (not "
                   "trained on); a DataLoader over a map-style dataset skips them without loading",
               skipped_batches=skip)
    batches = iter(loader)
    for _ in range(skip):
        next(batches, None)
    return batches


def loader_like(loader: DataLoader[Any], **order: Any) -> DataLoader[Any]:
    """``loader`` again with another ``sampler`` (and batch size) or ``batch_sampler``, every other setting its own."""
    workers = loader.num_workers > 0
    return DataLoader(loader.dataset, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                      prefetch_factor=loader.prefetch_factor if workers else None,
                      persistent_workers=loader.persistent_workers if workers else False,
                      pin_memory_device=loader.pin_memory_device, in_order=loader.in_order, **order)
