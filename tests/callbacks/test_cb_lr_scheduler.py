import pytest
import torch
from pytorch_optimizer import get_wsd_schedule
from torch import nn

from fsmtrain import Trainer
from fsmtrain.callbacks import LRSchedulerCallback


def _fit(tiny, make_sched, epochs=4, batch=8, **kw):
    train, val = tiny.loaders(n=32, batch=batch)
    model = tiny.model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = make_sched(opt)
    cb = LRSchedulerCallback(sched, **kw)
    result = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=[cb],
                     console_level="error", default_callbacks=False).fit()
    return result, opt, cb


def test_per_epoch_step(tiny):
    result, opt, _ = _fit(tiny, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert [r.metrics["lr"] for r in result.history] == [1.0, 0.5, 0.25, 0.125]
    assert opt.param_groups[0]["lr"] == 0.0625


def test_per_step(tiny):
    # 4 optimizer steps per epoch, 2 epochs: lr at each epoch begin is 0.9**(4*epoch)
    result, opt, _ = _fit(tiny, lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9), epochs=2,
                          interval="step")
    assert [r.metrics["lr"] for r in result.history] == pytest.approx([1.0, 0.9**4])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.9**8)


def test_reduce_on_plateau_is_fed_the_monitored_value(tiny, monkeypatch):
    fed = []
    real = torch.optim.lr_scheduler.ReduceLROnPlateau.step

    def step(self, metrics, *a, **k):
        fed.append(float(metrics))
        return real(self, metrics, *a, **k)

    monkeypatch.setattr(torch.optim.lr_scheduler.ReduceLROnPlateau, "step", step)
    result, _, _ = _fit(tiny, lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0))
    assert fed == [r.metrics["val_loss"] for r in result.history]


def test_pytorch_optimizer_schedule(tiny):
    # 4 steps per epoch, 3 epochs = 12 steps through a warmup-stable-decay schedule
    result, _opt, _ = _fit(
        tiny, lambda o: get_wsd_schedule(o, num_warmup_steps=4, num_stable_steps=4, num_decay_steps=4),
        epochs=3, interval="step",
    )
    lrs = [r.metrics["lr"] for r in result.history]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(1.0)


def test_state_dict_round_trip(tiny):
    _, _, cb = _fit(tiny, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    state = cb.state_dict()
    assert state["scheduler"]["last_epoch"] == 4
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    fresh = LRSchedulerCallback(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    fresh.load_state_dict(state)
    assert fresh.scheduler.last_epoch == 4


def test_bad_arguments():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with pytest.raises(ValueError, match="interval"):
        LRSchedulerCallback(torch.optim.lr_scheduler.StepLR(opt, 1), interval="batch")
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        LRSchedulerCallback(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), interval="step")
    with pytest.raises(TypeError, match="step"):
        LRSchedulerCallback(object())
