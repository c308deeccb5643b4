import pytest
import torch
from pytorch_optimizer import ScheduleFreeAdamW, SPlus
from torch import nn

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.callbacks import OptimizerModeCallback
from fsmtrain.callbacks.optimizer_mode import has_modes


class ModeSpy(TrainingCallback):
    """Test-only: the optimizer's mode flag (``train_mode`` in each param group) where it matters."""

    priority = 50

    def __init__(self):
        self.trace = []

    def _mode(self, run):
        return run.optimizer.param_groups[0].get("train_mode")

    def on_train_epoch_begin(self, epoch):
        self.trace.append(("epoch_begin", epoch.index, self._mode(epoch.run)))

    def on_val_begin(self, epoch):
        self.trace.append(("val_begin", epoch.index, self._mode(epoch.run)))

    def on_val_end(self, epoch):
        self.trace.append(("val_end", epoch.index, self._mode(epoch.run)))


def _fit(tiny, make_opt, callbacks):
    train, val = tiny.loaders(n=32, batch=8)
    model = tiny.model()
    opt = make_opt(model.parameters())
    Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=2, callbacks=callbacks, console_level="error",
            default_callbacks=False).fit()
    return model, opt


@pytest.mark.parametrize("make_opt", [lambda p: SPlus(p, lr=0.01), lambda p: ScheduleFreeAdamW(p, lr=0.01)],
                         ids=["SPlus", "ScheduleFreeAdamW"])
def test_modes_switch_around_validation(tiny, make_opt):
    spy = ModeSpy()
    _model, _opt = _fit(tiny, make_opt, [OptimizerModeCallback(), spy])
    assert spy.trace == [
        ("epoch_begin", 0, True), ("val_begin", 0, False), ("val_end", 0, False),
        ("epoch_begin", 1, True), ("val_begin", 1, False), ("val_end", 1, False),
    ]


def test_validation_sees_eval_weights(tiny):
    # SPlus evaluates on its EMA weights: with the callback, val losses differ from a run without it
    train, val = tiny.loaders(n=32, batch=8)
    out = []
    for cbs in ([OptimizerModeCallback()], []):
        model = tiny.model()
        opt = SPlus(model.parameters(), lr=0.01)
        r = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=2, callbacks=cbs, console_level="error",
                    default_callbacks=False).fit()
        out.append(r.history[-1].val_loss)
    assert out[0] != out[1]


def test_adamw_is_untouched(tiny):
    assert not has_modes(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), None)
    spy = ModeSpy()
    with_cb, _ = _fit(tiny, lambda p: torch.optim.AdamW(p, lr=0.01), [OptimizerModeCallback(), spy])
    without, _ = _fit(tiny, lambda p: torch.optim.AdamW(p, lr=0.01), [])
    assert all(mode is None for *_, mode in spy.trace)
    for a, b in zip(with_cb.parameters(), without.parameters(), strict=True):
        assert torch.equal(a, b)


def test_model_is_never_treated_as_optimizer():
    model = nn.Linear(1, 1)
    assert not has_modes(model, model)
