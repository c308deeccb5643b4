"""A loader's own sampler on several ranks: each rank takes its share of that sampler's draw (the
same draw on every rank, seeded by the run's data seed and the epoch), and the sharded loader keeps
the loader's other settings."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

import pytest
import torch
from dist_runs import clean, config, events, fsmtrain, run_dir
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

from fsmtrain.training.distributed import shard_train_loader


def _weighted_loader(n: int = 40) -> DataLoader[tuple[torch.Tensor, ...]]:
    weights = [1.0 if i % 2 == 0 else 0.0 for i in range(n)]
    sampler = WeightedRandomSampler(weights, num_samples=n // 2, replacement=True)
    return DataLoader(TensorDataset(torch.arange(float(n))), batch_size=4, sampler=sampler, num_workers=2,
                      prefetch_factor=3, multiprocessing_context=multiprocessing.get_context("spawn"),
                      generator=torch.Generator().manual_seed(7), pin_memory=False, drop_last=True)


def test_a_weighted_sampler_is_sharded_not_replaced() -> None:
    loader = _weighted_loader()
    for epoch in range(3):
        shards = []
        for rank in (0, 1):
            sampler = shard_train_loader(loader, rank, 2, 12345).sampler
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            shards.append(list(sampler))
            assert list(sampler) == shards[-1]  # the same epoch draws the same order again
        assert all(i % 2 == 0 for s in shards for i in s), shards  # only the rows the user's sampler draws
        assert len(shards[0]) == len(shards[1]) == 10
        # Interleaved, the shards are one draw of 20 (every rank drew it alike), with repeats as it drew them.
        drawn = [i for pair in zip(*shards, strict=True) for i in pair]
        assert len(drawn) == 20 and Counter(drawn) != Counter(shards[0] * 2)
    epochs = []
    for epoch in (0, 1):
        sampler = shard_train_loader(loader, 0, 2, 12345).sampler
        sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        epochs.append(list(sampler))
    assert epochs[0] != epochs[1]  # each epoch its own draw


def test_the_sharded_loader_keeps_the_loaders_settings() -> None:
    loader = _weighted_loader()
    sharded = shard_train_loader(loader, 1, 2, 0)
    assert sharded.generator is loader.generator
    assert sharded.prefetch_factor == 3
    assert sharded.multiprocessing_context is loader.multiprocessing_context
    assert (sharded.num_workers, sharded.batch_size, sharded.drop_last) == (2, 4, True)
    shuffled = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(3))
    kept = shard_train_loader(shuffled, 0, 2, 0)
    assert isinstance(kept.sampler, DistributedSampler) and kept.generator is shuffled.generator


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_ranks_train_on_the_rows_a_weighted_sampler_draws(tmp_path: Path) -> None:
    """The odd rows have NaN targets and weight 0: a rank given any of them stops the run on NaN."""
    record = {"target": "tests.dist_support.RecordRows", "kwargs": {"folder": str(tmp_path / "rows")}}
    cfg = config(tmp_path, extra=[record], epochs=2, data="tests.dist_support.weighted_regression",
                 data_config={"n_samples": 256}, early_stopping={"enabled": False})
    done = fsmtrain("train", str(cfg), "--nproc", "2", cwd=tmp_path, timeout=150)
    out = clean(done)
    assert done.returncode == 0, out[-4000:]
    (result,) = events(run_dir(tmp_path) / "events.jsonl", "result")
    assert result["payload"]["stop_reason"] == "completed", result
    seen = [[line.split() for line in (tmp_path / "rows" / f"rows-rank{r}.txt").read_text().splitlines()]
            for r in (0, 1)]
    for epoch in ("0", "1"):
        rows = [[int(row) for e, row in rank if e == epoch] for rank in seen]
        assert len(rows[0]) == len(rows[1]) == 64
        assert all(row % 2 == 0 for r in rows for row in r)
        assert rows[0] != rows[1]
