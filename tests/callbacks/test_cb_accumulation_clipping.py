import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.callbacks import GradientAccumulationCallback, GradientClippingCallback, GradientMonitorCallback
from fsmtrain.core.slots import MAX_GRAD_NORM


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x @ torch.randn(4, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)


def _fit(tiny, loader, callbacks, epochs=2, opt=None):
    model = tiny.model()
    optimizer = (opt or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)))(model.parameters())
    Trainer(model, optimizer, nn.MSELoss(), loader, max_epochs=epochs, callbacks=callbacks,
            console_level="error", default_callbacks=False).fit()
    return model


def _assert_same(a, b):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_four_micro_batches_equal_one_big_batch(tiny):
    x, y = _data(96)
    ds = TensorDataset(x, y)
    accumulated = _fit(tiny, DataLoader(ds, batch_size=8), [GradientAccumulationCallback(4)])
    big = _fit(tiny, DataLoader(ds, batch_size=32), [])
    _assert_same(accumulated, big)
    # and it is not trivially so: stepping every micro-batch gives different weights
    small = _fit(tiny, DataLoader(ds, batch_size=8), [])
    assert not torch.allclose(next(small.parameters()), next(big.parameters()), atol=1e-4)


def test_partial_window_is_flushed_as_the_mean_of_what_it_saw(tiny):
    # 48 samples in micro-batches of 8: windows of 4 and 2 == big batches of 32 and 16
    x, y = _data(48)
    ds = TensorDataset(x, y)
    accumulated = _fit(tiny, DataLoader(ds, batch_size=8), [GradientAccumulationCallback(4)])
    big = _fit(tiny, DataLoader(ds, batch_size=32), [])
    _assert_same(accumulated, big)


def test_drop_last_discards_the_partial_window(tiny):
    x, y = _data(48)
    accumulated = _fit(tiny, DataLoader(TensorDataset(x, y), batch_size=8),
                       [GradientAccumulationCallback(4, drop_last=True)])
    only_full = _fit(tiny, DataLoader(TensorDataset(x[:32], y[:32]), batch_size=32), [])
    _assert_same(accumulated, only_full)


def test_steps_one_is_plain_training(tiny):
    x, y = _data(32)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    _assert_same(_fit(tiny, loader, [GradientAccumulationCallback(1)]), _fit(tiny, loader, []))


class SeenByOptimizer(TrainingCallback):
    priority = 50

    def __init__(self):
        self.norms = []
        self.max_abs = []

    def on_before_optimizer_step(self, step):
        grads = [p.grad for p in step.run.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        self.max_abs.append(max(float(g.abs().max()) for g in grads))


def _spiky():
    x, y = _data(64)
    return DataLoader(TensorDataset(x, y * 50.0), batch_size=16)


def test_clipping_by_norm_bounds_what_the_optimizer_sees(tiny):
    free, clipped = SeenByOptimizer(), SeenByOptimizer()
    mon = GradientMonitorCallback()
    epoch_max: list[float] = []

    class Slot(TrainingCallback):  # reads what the monitor wrote for each epoch
        priority = 99
        reads = (MAX_GRAD_NORM,)

        def on_epoch_end(self, epoch):
            epoch_max.append(epoch.get(MAX_GRAD_NORM))
    _fit(tiny, _spiky(), [free], opt=lambda p: torch.optim.SGD(p, lr=1e-4))
    _fit(tiny, _spiky(), [GradientClippingCallback(max_norm=1.0), clipped, mon, Slot()],
         opt=lambda p: torch.optim.SGD(p, lr=1e-4))
    assert max(free.norms) > 10
    assert len(clipped.norms) == 8
    assert all(n <= 1.0 + 1e-5 for n in clipped.norms)
    # the monitor (priority 12) measured before clipping (priority 20)
    assert len(epoch_max) == 2 and max(epoch_max) > 10


def test_clipping_by_value(tiny):
    seen = SeenByOptimizer()
    _fit(tiny, _spiky(), [GradientClippingCallback(max_value=0.5), seen], opt=lambda p: torch.optim.SGD(p, lr=1e-4))
    assert all(m <= 0.5 for m in seen.max_abs)


def test_clipping_with_accumulation_clips_the_whole_gradient_once(tiny):
    seen = SeenByOptimizer()
    _fit(tiny, _spiky(), [GradientAccumulationCallback(2), GradientClippingCallback(max_norm=1.0), seen],
         opt=lambda p: torch.optim.SGD(p, lr=1e-4))
    assert len(seen.norms) == 4  # 8 micro-batches, 2 per step, 2 epochs
    assert all(n <= 1.0 + 1e-5 for n in seen.norms)


@pytest.mark.parametrize(("cls", "kwargs", "field"), [
    (GradientClippingCallback, {}, "max_norm or max_value"),
    (GradientClippingCallback, {"max_norm": -1.0}, "max_norm"),
    (GradientAccumulationCallback, {"steps": 0}, "steps"),
])
def test_bad_arguments(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)
