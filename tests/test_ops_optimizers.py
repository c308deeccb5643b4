"""Several named optimizers and manual steps in one process: the engine steps them all once per batch
(or, for a manual step, leaves that to the step through the table's skip flags); gradient monitoring
and clipping span every optimizer's parameters, or are refused by name at build time; config mistakes
are one line, exit 2; predict runs the model's forward on batches of inputs alone, evaluate refuses them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fsmtrain import NamedOptimizers, NamedSchedulers, StopReason, Trainer, TrainingCallback, manual_step
from fsmtrain.callbacks import (
    GradientClippingCallback,
    GradientMonitorCallback,
    LRSchedulerCallback,
    NaNDetectionCallback,
    OptimizerModeCallback,
)
from fsmtrain.cli import main
from fsmtrain.core.context import StepContext
from fsmtrain.training.inference import InferenceError, run_over
from fsmtrain.training.models import GAN, MLP

REPO = Path(__file__).resolve().parents[1]


class TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.body(x)))
        return out


def _data(n: int = 40, scale: float = 1.0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g) * scale
    return DataLoader(TensorDataset(x, x[:, :2] * 3.0), batch_size=8)


class AroundForward(TrainingCallback):
    priority = 50

    def __init__(self, model: nn.Module) -> None:
        self.model, self.norms, self.hooks = model, list[float](), list[str]()

    def on_before_forward(self, step: StepContext) -> None:
        self.hooks.append("before_forward")

    def on_after_forward(self, step: StepContext) -> None:
        self.hooks.append("after_forward")


class Seen(AroundForward):
    """Also the gradient norm over every parameter as the optimizer step begins (after clipping)."""

    def on_before_optimizer_step(self, step: StepContext) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def _steps(opt: torch.optim.Optimizer) -> list[int]:
    count = [0]
    opt.register_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def test_two_optimizers_each_step_once_a_batch_clipped_and_monitored_over_both() -> None:
    torch.manual_seed(0)
    model = TwoPart()
    body, head = torch.optim.SGD(model.body.parameters(), lr=0.1), torch.optim.Adam(model.head.parameters(), lr=0.01)
    counts = {"body": _steps(body), "head": _steps(head)}
    seen = Seen(model)
    trainer = Trainer(model, {"body": body, "head": head}, nn.MSELoss(), _data(scale=50.0), max_epochs=2,
                      callbacks=[GradientMonitorCallback(warn_threshold=1e9), GradientClippingCallback(max_norm=0.5),
                                 seen], default_callbacks=False)
    history = trainer.fit().history
    assert {k: c[0] for k, c in counts.items()} == {"body": 10, "head": 10}  # 5 batches x 2 epochs, each once
    assert len(seen.norms) == 10 and max(seen.norms) <= 0.5 + 1e-5  # clipped over both optimizers' parameters
    assert all(e.slots["max_grad_norm"] > 0.5 for e in history)  # the monitor saw the norm before clipping
    state = trainer.optimizer.state_dict()
    assert set(state["optimizers"]) == {"body", "head"} and state["optimizers"]["head"]["state"]


@manual_step
def two_step(model: TwoPart, batch: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> torch.Tensor:
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y)
    for name in ("body", "head"):
        optimizers[name].zero_grad()
    loss.backward()
    optimizers["head"].step()
    optimizers["body"].step()
    return loss.detach()


def test_a_manual_step_steps_its_optimizers_and_the_engine_does_not() -> None:
    torch.manual_seed(0)
    model = TwoPart()
    body, head = torch.optim.SGD(model.body.parameters(), lr=0.1), torch.optim.SGD(model.head.parameters(), lr=0.1)
    counts = [_steps(body), _steps(head)]
    before = [p.detach().clone() for p in model.parameters()]
    seen = AroundForward(model)
    trainer = Trainer(model, {"body": body, "head": head}, None, _data(), _data(16), max_epochs=2, callbacks=[seen],
                      default_callbacks=False, step=two_step, val_step=lambda m, b: nn.functional.mse_loss(m(b[0]),
                                                                                                            b[1]))
    result = trainer.fit()
    assert [c[0] for c in counts] == [10, 10]  # the step's own, once a batch; the engine's left out
    assert seen.hooks == ["before_forward", "after_forward"] * 10  # the hooks around forward fire
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert result.history[-1].metrics["train_loss"] < result.history[0].metrics["train_loss"]


def test_a_manual_step_with_one_optimizer_gets_it_by_the_name_optimizer() -> None:
    got: list[Any] = []

    @manual_step
    def step(model: nn.Module, batch: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> torch.Tensor:
        got.append(dict(optimizers))
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizers["optimizer"].step()
        return loss.detach()

    model = TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Trainer(model, opt, None, _data(16), max_epochs=1, step=step, default_callbacks=False).fit()
    assert got == [{"optimizer": opt}] * 2


def test_nan_detection_and_optimizer_modes_with_a_manual_step_and_two_optimizers() -> None:
    class Modes(torch.optim.SGD):  # an optimizer with train/eval weights (SPlus, ScheduleFree)
        def __init__(self, params: Any) -> None:
            super().__init__(params, lr=1e9)  # diverges: the losses go non-finite
            self.modes: list[str] = []

        def train(self) -> None:
            self.modes.append("train")

        def eval(self) -> None:
            self.modes.append("eval")

    model = TwoPart()
    body, head = Modes(model.body.parameters()), torch.optim.SGD(model.head.parameters(), lr=1e9)
    result = Trainer(model, {"body": body, "head": head}, None, _data(), _data(16), max_epochs=5, step=two_step,
                     val_step=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), default_callbacks=False,
                     callbacks=[NaNDetectionCallback(), OptimizerModeCallback()]).fit()
    assert result.stop_reason is StopReason.NAN and result.epochs_completed < 5
    assert body.modes[:2] == ["train", "eval"]  # each of several optimizers switched, by its own modes


def test_callbacks_that_need_the_engines_step_are_refused_by_name_with_a_manual_step() -> None:
    model = TwoPart()
    opts = {"body": torch.optim.SGD(model.body.parameters()), "head": torch.optim.SGD(model.head.parameters())}
    with pytest.raises(ValueError, match=r"GradientMonitorCallback \(on_after_backward\); "
                                         r"GradientClippingCallback \(on_after_backward\)"):
        Trainer(model, opts, None, _data(), max_epochs=1, step=two_step, default_callbacks=False,
                callbacks=[GradientMonitorCallback(), GradientClippingCallback(max_norm=1.0)])
    with pytest.raises(ValueError, match="share a parameter"):
        NamedOptimizers({"a": torch.optim.SGD(model.parameters()), "b": torch.optim.SGD(model.head.parameters())})


def test_lr_scheduler_callback_steps_named_schedulers_and_a_manual_step_takes_it_per_epoch() -> None:
    torch.manual_seed(0)
    model = TwoPart()
    body, head = torch.optim.SGD(model.body.parameters(), lr=0.1), torch.optim.SGD(model.head.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(head, patience=0, factor=0.5, threshold=10.0)
    named = NamedSchedulers({"body": torch.optim.lr_scheduler.StepLR(body, 1, 0.1), "head": plateau})
    trainer = Trainer(model, {"body": body, "head": head}, None, _data(), _data(16), max_epochs=3, step=two_step,
                      val_step=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), default_callbacks=False,
                      callbacks=[LRSchedulerCallback(named)])  # per epoch: no optimizer-step hook needed
    trainer.fit()
    assert body.param_groups[0]["lr"] == pytest.approx(1e-4)  # StepLR, three epochs
    assert head.param_groups[0]["lr"] < 0.1  # the plateau got val_loss (no improvement by 10x: halved)
    with pytest.raises(ValueError, match=r"LRSchedulerCallback \(on_after_optimizer_step\)"):
        Trainer(model, {"body": body, "head": head}, None, _data(), max_epochs=1, step=two_step,
                default_callbacks=False, callbacks=[LRSchedulerCallback(named["body"], interval="step")])


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], **changes: Any) -> tuple[int, str]:
    cfg = yaml.safe_load((REPO / "configs" / "gan.yaml").read_text())
    for path, value in changes.items():
        *head, leaf = path.split("__")
        node = cfg
        for key in head:
            node = node[key]
        node[leaf] = value
    (tmp_path / "gan.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = main(["validate", str(tmp_path / "gan.yaml")])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("changes", "expected"), [
    ({"optimizers__gen__params": "generatr"},
     "optimizers.gen.params: expected a submodule of the model (generator, "),
    ({"schedulers": {"gne": {"target": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1}}}},
     "schedulers.gne: expected the name of an optimizer in optimizers (gen, disc); found 'gne' (did you mean gen?)"),
    ({"optimizers__disc__kwargs": {"lr": 1e-3, "betaz": [0.5, 0.9]}},
     "optimizers.disc.kwargs.betaz: expected an argument of"),
    ({"optimizer": "torch.optim.SGD"}, "expected optimizers or optimizer, not both"),
    ({"callbacks__gradient_monitor__enabled": True},
     "callbacks: expected no callback on the hooks around backward and the optimizer step"),
])
def test_optimizer_config_mistakes_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       changes: dict[str, Any], expected: str) -> None:
    code, err = _validate(tmp_path, capsys, **changes)
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert "Traceback" not in err


def test_gan_yaml_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(REPO / "configs" / "gan.yaml")]) == 0
    assert "optimizers gen, disc" in capsys.readouterr().out


def test_predict_on_inputs_alone_gives_one_row_per_example_in_order_and_evaluate_refuses_them() -> None:
    torch.manual_seed(0)
    model = MLP(4, 3, [8])
    trainer = Trainer(model, torch.optim.SGD(model.parameters()), nn.MSELoss(), _data(), default_callbacks=False)
    x = torch.randn(23, 4)
    with torch.no_grad():
        want = model(x)
    rows, keyed = cast("Dataset[Any]", x), cast("Dataset[Any]", [{"inputs": r} for r in x])
    for data in (DataLoader(rows, batch_size=7), DataLoader(TensorDataset(x), batch_size=5),
                 DataLoader(keyed, batch_size=6)):
        got = trainer.predict(data)
        assert got.shape == (23, 3) and torch.allclose(got, want), type(data.dataset)
    with pytest.raises(InferenceError, match=r"holds inputs alone .*evaluate compares outputs with targets"):
        run_over(trainer.driver, trainer.run, None, DataLoader(rows, batch_size=7), keep=False)
    trainer.close()


def test_gan_forward_is_the_discriminators_score() -> None:
    model = GAN(2, 4, [8])
    x = torch.randn(5, 2)
    assert torch.equal(model(x), model.discriminator(x))
