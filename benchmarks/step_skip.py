"""How long a resume inside an epoch takes to skip the batches the checkpoint had done, 10,000 of
them: a DataLoader over a map-style dataset starts its batch sampler at that index (nothing loaded),
against loading and dropping them (what any other loader gets).

    python benchmarks/step_skip.py [--batches 10000] [--workers 0]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.core.context import EpochContext, RunContext
from fsmtrain.core.events import EventLog
from fsmtrain.training.data_position import batches_from


class _Batches:  # no DataLoader: it cannot start at an index
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=10_000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    rows = (args.batches + 10) * args.batch_size
    data = TensorDataset(torch.randn(rows, 32), torch.randn(rows, 1))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(0))
    epoch = EpochContext(RunContext("bench", 1, EventLog(None, "bench", console=None, keep=True)), 0)
    for name, source in (("start at the index", loader), ("load and drop", _Batches(loader))):
        t = time.perf_counter()
        first = next(batches_from(source, args.batches, epoch, None))
        print(f"{name}: skip {args.batches} batches of {args.batch_size} rows (workers {args.workers}) "
              f"in {time.perf_counter() - t:.3f} s; first batch {tuple(first[0].shape)}")


if __name__ == "__main__":
    main()
