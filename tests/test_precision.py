"""Mixed precision and torch.compile: bf16 trains as well as fp32, fp16's scaler skips an overflowing
step through the step flags, gradient norms stay finite in float32, compiled runs train."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fsmtrain import Trainer
from fsmtrain.app.config import load_config
from fsmtrain.app.job import train_seed
from fsmtrain.callbacks import GradientMonitorCallback
from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.core.slots import MAX_GRAD_NORM

REPO = Path(__file__).resolve().parents[1]


def _quickstart(tmp: Path, precision: str) -> float:
    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["wandb.enabled=false", f"precision={precision}"])
    run = train_seed(cfg, 0, tmp / precision)
    assert run.error is None and run.result is not None
    return run.result.best_val_loss


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_mixed_trains_the_quickstart_within_5_percent_of_fp32(tmp_path: Path) -> None:
    fp32, bf16 = _quickstart(tmp_path, "32"), _quickstart(tmp_path, "bf16-mixed")
    assert math.isfinite(bf16)
    assert abs(bf16 - fp32) <= 0.05 * fp32, (fp32, bf16)


class _SetGrads(TrainingCallback):
    """Before the gradient monitor (priority 12): every gradient element set to ``value``."""

    priority = 11

    def __init__(self, value: float) -> None:
        self.value = value

    def on_after_backward(self, step: StepContext) -> None:
        model = step.run.model
        assert model is not None
        for p in model.parameters():
            assert p.grad is not None
            p.grad.fill_(self.value)


class _Record(TrainingCallback):
    priority = 60
    reads = (MAX_GRAD_NORM,)

    def __init__(self) -> None:
        self.norms: list[float | None] = []

    def on_epoch_end(self, epoch: EpochContext) -> None:
        self.norms.append(epoch.get(MAX_GRAD_NORM))


def test_an_fp16_gradient_norm_of_1e5_is_reported_finite() -> None:
    model = nn.Linear(8, 1).half()  # 9 parameters
    value = 1e5 / 3.0  # each element fits fp16 (< 65504); the sum of their squares does not
    rec = _Record()
    batches = [(torch.randn(4, 8).half(), torch.randn(4, 1).half())]
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), batches, max_epochs=1,
            callbacks=[_SetGrads(value), GradientMonitorCallback(warn_threshold=1e9), rec],
            default_callbacks=False, console_level="error").fit()
    (norm,) = rec.norms
    assert norm is not None and math.isfinite(norm)
    assert norm == pytest.approx(1e5, rel=1e-3)


class _Steps(TrainingCallback):
    """Counts the optimizer steps that ran (their after-step hook) and the batches."""

    priority = 60

    def __init__(self) -> None:
        self.steps = 0
        self.batches = 0

    def on_after_optimizer_step(self, step: StepContext) -> None:
        self.steps += 1

    def on_train_step_end(self, step: StepContext) -> None:
        self.batches += 1


def test_fp16_overflow_skips_the_step_through_the_step_flags_and_shrinks_the_scale() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    before = [p.detach().clone() for p in model.parameters()]
    steps = _Steps()
    # Targets so large that the scaled fp16 gradients overflow: every step is skipped.
    batches = [(torch.randn(16, 8), torch.full((16, 1), 6e4)) for _ in range(3)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), batches, max_epochs=1,
                      callbacks=[steps], default_callbacks=False, console_level="error", precision="16-mixed")
    scale = trainer.precision.scaler.get_scale() if trainer.precision.scaler is not None else None
    trainer.fit()
    assert scale is not None and trainer.precision.scaler is not None
    assert steps.batches == 3 and steps.steps == 0  # the flag left the step and its hooks out
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert trainer.precision.scaler.get_scale() < scale


def test_fp16_steps_unless_it_overflows_and_the_scaler_state_is_checkpointed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    steps = _Steps()
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(3)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), batches, batches,
                      max_epochs=2, callbacks=[steps], console_level="error", precision="16-mixed",
                      run_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.precision.scaler is not None
    skipped = round(math.log2(65536.0 / trainer.precision.scaler.get_scale()))  # each overflow halves the scale
    assert steps.steps >= 1 and steps.steps + skipped == 6
    state = torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)
    assert state["scaler"]["scale"] == trainer.precision.scaler.get_scale()


def test_an_unknown_precision_is_refused() -> None:
    model = nn.Linear(8, 1)
    with pytest.raises(ValueError, match="precision must be one of 32, bf16-mixed, 16-mixed; got 'fp8'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), [(torch.zeros(1, 8),
                torch.zeros(1, 1))], precision="fp8", default_callbacks=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="16-mixed on CUDA needs a GPU; none on this machine"))])
def test_16_mixed_trains_the_quickstart_on_cuda(tmp_path: Path, device: str) -> None:
    """On CUDA where a GPU is lent; on CPU everywhere, so CI runs all of it but the CUDA calls."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      ["wandb.enabled=false", "precision=16-mixed", f"device={device}"])
    run = train_seed(cfg, 0, tmp_path / device)
    assert run.error is None and run.result is not None and math.isfinite(run.result.best_val_loss)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compile_trains_and_checkpoints_the_plain_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
    result = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), batches, batches,
                     max_epochs=2, compile=True, run_dir=tmp_path / "run", console_level="error").fit()
    assert math.isfinite(result.best_val_loss)
    saved = torch.load(tmp_path / "run" / "model.pt")
    assert set(saved) == set(model.state_dict())  # no _orig_mod. prefix
