"""Built-in data builders for the examples (no download): ``builder(*, batch_size, seed, **data_config)``
returns ``(train, val)``; ``seed`` drives the shuffle order, ``data_seed`` the data itself."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["Loaders", "digits", "make_loaders", "synthetic_regression", "two_moons"]


class Loaders(NamedTuple):
    train: DataLoader[Any]
    val: DataLoader[Any] | None


def make_loaders(train: Dataset[Any], val: Dataset[Any] | None, *, batch_size: int, seed: int,
                 drop_last: bool = False) -> Loaders:
    """Wrap datasets in loaders whose shuffle order depends only on ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator, drop_last=drop_last)
    val_loader = None if val is None else DataLoader(val, batch_size=batch_size, shuffle=False)
    return Loaders(train_loader, val_loader)


def _split(x: torch.Tensor, y: torch.Tensor | None, val_fraction: float, batch_size: int, seed: int) -> Loaders:
    """The last ``val_fraction`` of the rows (at least one) for validation, the rest for training; without
    ``y`` the batches are the rows of ``x`` alone."""
    n = len(x)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_train = n - max(1, math.floor(n * val_fraction))  # at least one row each, as n >= 2
    train, val = ((cast("Dataset[Any]", x[part]) if y is None else TensorDataset(x[part], y[part]))
                  for part in (slice(None, n_train), slice(n_train, None)))
    return make_loaders(train, val, batch_size=batch_size, seed=seed)


def synthetic_regression(*, batch_size: int, seed: int, n_samples: int = 2048, n_features: int = 8,
                         noise: float = 0.1, val_fraction: float = 0.2, data_seed: int = 0) -> Loaders:
    """A seeded nonlinear regression task, ``y = x·w + 0.5·sin(3·x·v) + noise``, a small MLP learns in a few epochs."""
    if n_samples < 2 or n_features < 1:
        raise ValueError(f"need n_samples >= 2 and n_features >= 1, got {n_samples}, {n_features}")
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n_samples, n_features, generator=g)
    w = torch.randn(n_features, 1, generator=g) / math.sqrt(n_features)
    v = torch.randn(n_features, 1, generator=g) / math.sqrt(n_features)
    y = x @ w + 0.5 * torch.sin(3.0 * (x @ v)) + noise * torch.randn(n_samples, 1, generator=g)
    return _split(x, y, val_fraction, batch_size, seed)


def digits(*, batch_size: int, seed: int, val_fraction: float = 0.2, data_seed: int = 0) -> Loaders:
    """scikit-learn's bundled 8x8 digits (1797 rows, 64 features in [0, 1], 10 classes; the ``[examples]`` extra)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data builder needs scikit-learn: pip install 'fsmtrain[examples]'") from exc
    bunch: Any = load_digits()
    x_all = np.asarray(bunch.data, dtype=np.float32) / 16.0
    y_all = np.asarray(bunch.target, dtype=np.int64)
    order = np.random.default_rng(data_seed).permutation(len(y_all))
    return _split(torch.from_numpy(x_all[order]), torch.from_numpy(y_all[order]), val_fraction, batch_size, seed)


def two_moons(*, batch_size: int, seed: int, n_samples: int = 512, noise: float = 0.05, val_fraction: float = 0.25,
              data_seed: int = 0) -> Loaders:
    """Points on two interleaved half circles, as batches of inputs alone (no targets), e.g. for a GAN."""
    if n_samples < 4:
        raise ValueError(f"need n_samples >= 4, got {n_samples}")
    g = torch.Generator().manual_seed(data_seed)
    angle = torch.rand(n_samples, generator=g) * math.pi
    upper = torch.rand(n_samples, generator=g) < 0.5
    x = torch.where(upper, torch.cos(angle), 1.0 - torch.cos(angle))
    y = torch.where(upper, torch.sin(angle), 0.5 - torch.sin(angle))
    points = torch.stack([x, y], 1) + noise * torch.randn(n_samples, 2, generator=g)
    return _split(points, None, val_fraction, batch_size, seed)
