"""The built-in data builders and models the shipped configs use."""

from __future__ import annotations

import pytest
import torch

from fsmtrain.training.data import Loaders, digits, synthetic_regression
from fsmtrain.training.models import MLP, accuracy


def _batches(loaders: Loaders) -> list[torch.Tensor]:
    return [x for x, _ in loaders.train]


def test_synthetic_regression_is_seeded() -> None:
    a = synthetic_regression(batch_size=16, seed=1, n_samples=100, n_features=3)
    b = synthetic_regression(batch_size=16, seed=1, n_samples=100, n_features=3)
    c = synthetic_regression(batch_size=16, seed=2, n_samples=100, n_features=3)
    assert len(a.train.dataset) == 80 and a.val is not None and len(a.val.dataset) == 20  # type: ignore[arg-type]
    assert all(torch.equal(x, y) for x, y in zip(_batches(a), _batches(b), strict=True))
    assert not torch.equal(_batches(a)[0], _batches(c)[0])  # the seed changes the shuffle order...
    x_a = torch.cat(_batches(a)).sort(dim=0).values
    x_c = torch.cat(_batches(c)).sort(dim=0).values
    assert torch.equal(x_a, x_c)  # ...but not the data (data_seed does)
    x, y = next(iter(a.train))
    assert x.shape == (16, 3) and y.shape == (16, 1)


def test_builders_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        synthetic_regression(batch_size=4, seed=0, val_fraction=1.5)
    with pytest.raises(ValueError, match="activation"):
        MLP(2, 1, activation="swish")


def test_digits_split_and_scaling() -> None:
    pytest.importorskip("sklearn")
    loaders = digits(batch_size=64, seed=0)
    assert loaders.val is not None
    assert len(loaders.train.dataset) + len(loaders.val.dataset) == 1797  # type: ignore[arg-type]
    x, y = next(iter(loaders.train))
    assert x.shape == (64, 64) and x.dtype == torch.float32 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and int(y.max()) <= 9


def test_mlp_shapes_and_accuracy_metric() -> None:
    torch.manual_seed(0)
    model = MLP(4, 3, hidden=[5], dropout=0.1)
    assert model(torch.randn(7, 4)).shape == (7, 3)
    assert sum(p.numel() for p in MLP(4, 1, hidden=[]).parameters()) == 5  # linear model
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 5.0]])
    assert float(accuracy(logits, torch.tensor([0, 1, 1, 0]))) == pytest.approx(0.5)


@pytest.mark.slow
def test_digits_config_reaches_90_percent(tmp_path: object) -> None:
    """Acceptance: configs/digits.yaml reaches >= 90% val accuracy within its configured epochs."""
    from pathlib import Path

    from fsmtrain.app.config import load_config
    from fsmtrain.app.job import train_seed

    pytest.importorskip("sklearn")
    torch.set_num_threads(1)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "digits.yaml",
                      ["checkpoint.enabled=false"])
    run = train_seed(cfg, cfg.seeds[0], Path(str(tmp_path)) / "run")
    assert run.error is None and run.result is not None
    best_acc = max(r.metrics["val_accuracy"] for r in run.result.history)
    assert run.result.epochs_completed <= cfg.max_epochs
    assert best_acc >= 0.90, best_acc
