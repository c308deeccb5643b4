"""The gradient monitor's per-step work: the global norm it records is the norm of every gradient, and a
small model's step costs two kernels (one copy of all gradients, one norm) on the CPU and on CUDA, where a
small model's step is host-bound and each launch is paid in Python time."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fsmtrain import Trainer
from fsmtrain.callbacks import GradientMonitorCallback
from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.slots import MAX_GRAD_NORM

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device; none here"))]
VIEWS = {"aten::reshape", "aten::view", "aten::_reshape_alias", "aten::alias"}


class _Watch(GradientMonitorCallback):
    """The monitor, with each step's reference norm (float64, on the host) and the ops of its third step."""

    def __init__(self) -> None:
        super().__init__(warn_threshold=1e9)
        self.norms: list[float] = []
        self.maxima: list[float | None] = []
        self.kernels: list[str] = []

    def on_after_backward(self, step: StepContext) -> None:
        grads = [p.grad.double().cpu() for p in self._params if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))))
        if len(self.norms) != 3:
            super().on_after_backward(step)
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            super().on_after_backward(step)
        self.kernels = [e.name for e in prof.events() if e.cpu_parent is None and e.name not in VIEWS]

    def on_epoch_end(self, epoch: EpochContext) -> None:
        super().on_epoch_end(epoch)
        self.maxima.append(epoch.get(MAX_GRAD_NORM))


def _fit(width: int, device: str) -> _Watch:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1)).to(device)
    batches = [(torch.randn(16, 8, device=device), torch.randn(16, 1, device=device)) for _ in range(4)]
    watch = _Watch()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-4), nn.MSELoss(), batches, max_epochs=2,
            callbacks=[watch], default_callbacks=False, console_level="error").fit()
    return watch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [64, 8192])  # 641 parameters (one flat copy) and 81,921 (a norm per tensor)
def test_the_epochs_max_is_the_largest_global_norm_of_its_steps(width: int, device: str) -> None:
    watch = _fit(width, device)
    assert len(watch.norms) == 8 and len(watch.maxima) == 2
    for epoch, got in enumerate(watch.maxima):
        assert got == pytest.approx(max(watch.norms[4 * epoch: 4 * epoch + 4]), rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_models_step_costs_one_copy_and_one_norm(device: str) -> None:
    assert _fit(64, device).kernels == ["aten::cat", "aten::linalg_vector_norm"]
