"""The Trainer walking the real machine: phase sequence, strict vs fast, stops, faults, skip flags."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import Recorder, events_of, make_trainer, phases_visited, tiny_model
from torch import nn

from fsmtrain import StopReason, Trainer, TrainingCallback
from fsmtrain.core.context import EpochContext, StepContext
from fsmtrain.core.lifecycle import TRANSITIONS

LEGAL = {(t.source.value, t.dest.value, t.trigger) for t in TRANSITIONS}
_VOLATILE = {"ts", "run_id", "prev", "seal"}  # prev, seal: the hash chain digests the ts too
_TIMINGS = {"seconds", "phase_seconds", "callback_seconds"}


def _stable(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        e = {k: v for k, v in e.items() if k not in _VOLATILE}
        e["payload"] = {k: v for k, v in e["payload"].items() if k not in _TIMINGS and k != "strict"}
        out.append(e)
    return out


def test_phase_sequence_and_legal_moves(tmp_path: Path) -> None:
    result = make_trainer(tmp_path, epochs=3).fit()
    events = events_of(tmp_path)
    assert phases_visited(events) == (
        ["created", "train_begin"] + ["epoch_begin", "train_step", "val", "epoch_end"] * 3 + ["train_end"]
    )
    for e in events:
        if e["event"] == "transition":
            assert (e["from"], e["to"], e["trigger"]) in LEGAL
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["event"] == "result"
    assert result.stop_reason is StopReason.COMPLETED
    assert result.epochs_completed == 3
    assert [r.epoch for r in result.history] == [0, 1, 2]
    assert result.history[-1].val_loss < result.history[0].val_loss  # it really trained
    assert result.objective == result.best_val_loss == min(r.val_loss for r in result.history)


def test_train_loss_is_the_sample_weighted_mean_of_batch_losses(tmp_path: Path) -> None:
    losses: list[tuple[float, int]] = []

    class Spy(TrainingCallback):
        def on_after_forward(self, step: StepContext) -> None:
            assert step.loss is not None
            losses.append((step.loss.item(), step.batch[1].shape[0]))

    result = make_trainer(None, [Spy()], epochs=1).fit()
    expected = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    assert result.history[0].train_loss == pytest.approx(expected, rel=1e-6)


def test_strict_and_fast_mode_give_identical_traces_and_weights(tmp_path: Path) -> None:
    runs: dict[bool, tuple[list[dict[str, Any]], list[torch.Tensor]]] = {}
    for strict in (False, True):
        d = tmp_path / ("strict" if strict else "fast")
        trainer = make_trainer(d, [Recorder()], epochs=2, strict=strict, log_level="debug")
        trainer.fit()
        runs[strict] = (events_of(d), [p.detach().clone() for p in trainer.model.parameters()])
    (fast_events, fast_weights), (strict_events, strict_weights) = runs[False], runs[True]
    assert sum(1 for e in fast_events if e["trigger"] == "batch") > 4  # per-batch moves were logged
    assert _stable(fast_events) == _stable(strict_events)
    for a, b in zip(fast_weights, strict_weights, strict=True):
        assert torch.equal(a, b)


def test_strict_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSMTRAIN_STRICT_FSM", "1")
    assert make_trainer(None).engine.strict
    monkeypatch.setenv("FSMTRAIN_STRICT_FSM", "0")
    assert not make_trainer(None).engine.strict


class StopAt(Recorder):
    def __init__(self, hook: str, epoch: int, immediate: bool, batch: int = 0) -> None:
        super().__init__()
        self.hook, self.at_epoch, self.immediate, self.batch = hook, epoch, immediate, batch

    def _maybe(self, hook: str, epoch: int, batch: int = 0) -> None:
        if hook == self.hook and epoch == self.at_epoch and batch == self.batch:
            self.calls.append("REQUEST")
            self.run_ctx.request_stop(StopReason.EARLY_STOP, "StopAt", "test", immediate=self.immediate)

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self.run_ctx = epoch.run
        super().on_train_epoch_begin(epoch)

    def on_train_step_end(self, step: StepContext) -> None:
        super().on_train_step_end(step)
        self._maybe("on_train_step_end", step.epoch.index, step.batch_index)

    def on_val_end(self, epoch: EpochContext) -> None:
        super().on_val_end(epoch)
        self._maybe("on_val_end", epoch.index)


def test_normal_stop_lets_epoch_end_run_then_finishes(tmp_path: Path) -> None:
    cb = StopAt("on_val_end", epoch=1, immediate=False)
    result = make_trainer(tmp_path, [cb], epochs=5).fit()
    assert result.stop_reason is StopReason.EARLY_STOP
    assert result.epochs_completed == 2
    tail = cb.calls[cb.calls.index("REQUEST"):]
    assert tail == ["REQUEST", "on_epoch_end", "on_train_end"]
    last = [e for e in events_of(tmp_path) if e["event"] == "transition"][-1]
    assert (last["from"], last["to"], last["trigger"]) == ("epoch_end", "train_end", "finish")
    assert last["payload"]["reason"] == "early_stop"


def test_immediate_stop_from_a_batch_skips_the_rest_of_the_epoch(tmp_path: Path) -> None:
    cb = StopAt("on_train_step_end", epoch=1, immediate=True, batch=1)
    result = make_trainer(tmp_path, [cb], epochs=5).fit()
    assert result.stop_reason is StopReason.EARLY_STOP
    assert result.epochs_completed == 1  # epoch 1 never completed
    assert cb.calls[cb.calls.index("REQUEST"):] == ["REQUEST", "on_train_end"]
    last = [e for e in events_of(tmp_path) if e["event"] == "transition"][-1]
    assert (last["from"], last["to"], last["trigger"]) == ("train_step", "train_end", "stop_now")
    assert result.global_step == 5 + 2  # 72 samples / 16 = 5 batches in epoch 0, then batches 0 and 1


def test_immediate_stop_from_validation_skips_epoch_end(tmp_path: Path) -> None:
    cb = StopAt("on_val_end", epoch=0, immediate=True)
    result = make_trainer(tmp_path, [cb], epochs=5).fit()
    assert result.epochs_completed == 0
    assert cb.calls[cb.calls.index("REQUEST"):] == ["REQUEST", "on_train_end"]
    last = [e for e in events_of(tmp_path) if e["event"] == "transition"][-1]
    assert (last["from"], last["to"], last["trigger"]) == ("val", "train_end", "stop_now")


def test_first_stop_request_wins(tmp_path: Path) -> None:
    class Two(TrainingCallback):
        def on_val_end(self, epoch: EpochContext) -> None:
            assert epoch.request_stop(StopReason.PRUNED, "first", "a")
            assert not epoch.request_stop(StopReason.EARLY_STOP, "second", "b", immediate=True)

    result = make_trainer(tmp_path, [Two()], epochs=3).fit()
    assert result.stop_reason is StopReason.PRUNED
    assert result.epochs_completed == 1  # the ignored immediate request did not cut the epoch
    reqs = [e["payload"] for e in events_of(tmp_path) if e["event"] == "stop_request"]
    assert [(r["source"], r["accepted"]) for r in reqs] == [("first", True), ("second", False)]


def test_max_epochs_completes_and_zero_epochs_finishes_from_train_begin(tmp_path: Path) -> None:
    rec = Recorder()
    result = make_trainer(tmp_path / "a", [rec], epochs=2).fit()
    assert result.stop_reason is StopReason.COMPLETED
    assert rec.calls.count("on_train_end") == 1
    rec0 = Recorder()
    result0 = make_trainer(tmp_path / "b", [rec0], epochs=0).fit()
    assert result0.stop_reason is StopReason.COMPLETED and result0.epochs_completed == 0
    assert rec0.calls == ["on_train_begin", "on_train_end"]
    assert phases_visited(events_of(tmp_path / "b")) == ["created", "train_begin", "train_end"]


class Boom(RuntimeError):
    pass


class RaiseIn(Recorder):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def on_val_end(self, epoch: EpochContext) -> None:
        super().on_val_end(epoch)
        if epoch.index == 1:
            raise self.exc


def test_exception_in_a_callback_routes_to_train_end_and_reraises(tmp_path: Path) -> None:
    exc = Boom("callback failed")
    rec = RaiseIn(exc)
    with pytest.raises(Boom) as info:
        make_trainer(tmp_path, [rec], epochs=4).fit()
    assert info.value is exc
    assert rec.calls[-2:] == ["on_exception", "on_train_end"]
    assert rec.calls.count("on_train_end") == 1
    events = events_of(tmp_path)
    last_move = [e for e in events if e["event"] == "transition"][-1]
    assert (last_move["from"], last_move["to"], last_move["trigger"]) == ("val", "train_end", "abort")
    assert last_move["payload"]["reason"] == "error"
    assert "RaiseIn.on_val_end" in last_move["payload"]["source"]
    result = next(e for e in events if e["event"] == "result")["payload"]
    assert result["stop_reason"] == "error"


def test_exception_in_the_model_routes_to_train_end_and_reraises(tmp_path: Path) -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:
                raise ValueError("shape mismatch in the model")
            return self.lin(x)

    rec = Recorder()
    with pytest.raises(ValueError, match="shape mismatch in the model"):
        make_trainer(tmp_path, [rec], epochs=2, model=Broken()).fit()
    assert rec.calls[-2:] == ["on_exception", "on_train_end"]
    last_move = [e for e in events_of(tmp_path) if e["event"] == "transition"][-1]
    assert (last_move["from"], last_move["trigger"], last_move["payload"]["reason"]) == ("train_step", "abort", "error")


def test_ctrl_c_gives_interrupted(tmp_path: Path) -> None:
    class CtrlC(Recorder):
        def on_train_step_end(self, step: StepContext) -> None:
            if step.epoch.index == 1 and step.batch_index == 2:
                os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, delivered as KeyboardInterrupt

    rec = CtrlC()
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path, [rec], epochs=3).fit()
    assert rec.calls[-2:] == ["on_exception", "on_train_end"]
    result = next(e for e in events_of(tmp_path) if e["event"] == "result")["payload"]
    assert result["stop_reason"] == "interrupted"
    assert result["epochs_completed"] == 1


def test_on_train_end_failure_is_not_run_twice(tmp_path: Path) -> None:
    class FailAtEnd(Recorder):
        def on_train_end(self, run: Any) -> None:
            super().on_train_end(run)
            raise Boom("teardown failed")

    rec = FailAtEnd()
    with pytest.raises(Boom):
        make_trainer(tmp_path, [rec], epochs=1).fit()
    assert rec.calls.count("on_train_end") == 1
    assert "on_exception" not in rec.calls


def test_fit_twice_is_refused() -> None:
    trainer = make_trainer(None, epochs=1)
    trainer.fit()
    with pytest.raises(Exception, match="already been executed"):
        trainer.fit()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_skipping_the_optimizer_step_leaves_weights_unchanged() -> None:
    class NoStep(TrainingCallback):
        def on_after_forward(self, step: StepContext) -> None:
            step.skip_optimizer_step = True

    trainer = make_trainer(None, [NoStep()], epochs=2)
    before = _params(trainer.model)
    trainer.fit()
    for a, b in zip(before, _params(trainer.model), strict=True):
        assert torch.equal(a, b)


def test_skipping_zero_grad_accumulates_gradients() -> None:
    model = tiny_model()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]

    # Expected: the sum of the two batches' gradients, computed by hand on a copy.
    ref = tiny_model()
    for xb, yb in batches:
        nn.MSELoss()(ref(xb), yb).backward()
    expected = [p.grad.clone() for p in ref.parameters() if p.grad is not None]

    class Accumulate(TrainingCallback):
        def on_after_forward(self, step: StepContext) -> None:
            step.skip_optimizer_step = True
            step.skip_zero_grad = True

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Trainer(model, opt, nn.MSELoss(), batches, None, max_epochs=1, callbacks=[Accumulate()],
            console_level="error", default_callbacks=False).fit()
    got = [p.grad for p in model.parameters()]
    for g, e in zip(got, expected, strict=True):
        assert g is not None
        torch.testing.assert_close(g, e)


def test_skip_backward_skips_backward_hooks_and_gradients() -> None:
    class NoBackward(Recorder):
        def on_after_forward(self, step: StepContext) -> None:
            step.skip_backward = True

        def on_after_backward(self, step: StepContext) -> None:
            self.calls.append("on_after_backward")

    rec = NoBackward()
    trainer = make_trainer(None, [rec], epochs=1)
    trainer.fit()
    assert "on_after_backward" not in rec.calls
    assert all(p.grad is None for p in trainer.model.parameters())


def test_scheduler_steps_once_per_epoch_and_lr_is_recorded() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    from core_helpers import tiny_task

    train, val = tiny_task()
    result = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=3, scheduler=sched,
                     console_level="error", default_callbacks=False).fit()
    assert [r.metrics["lr"] for r in result.history] == [1.0, 0.5, 0.25]


def test_bad_arguments_get_clear_errors() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_epochs must be an integer >= 0, got -1"):
        Trainer(model, opt, nn.MSELoss(), [(torch.zeros(1, 8), torch.zeros(1, 1))], max_epochs=-1,
                default_callbacks=False)
    with pytest.raises(ValueError, match="train_loader yields no batches"):
        Trainer(model, opt, nn.MSELoss(), [], max_epochs=1, default_callbacks=False)
    with pytest.raises(TypeError, match=r"callbacks\[0\] must be a TrainingCallback, got str"):
        Trainer(model, opt, nn.MSELoss(), [(torch.zeros(1, 8), torch.zeros(1, 1))],
                callbacks=["x"], default_callbacks=False)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="a batch must be"):
        Trainer(model, opt, nn.MSELoss(), [torch.zeros(1, 8)], max_epochs=1, console_level="error",
                default_callbacks=False).fit()


def test_a_metric_named_like_a_builtin_one_is_refused_by_the_trainer(tmp_path: Path) -> None:
    """The Python API refuses what the config schema refuses: a metric that would replace val_loss."""
    with pytest.raises(ValueError, match="metrics named val_loss would replace"):
        make_trainer(tmp_path, metrics={"val_loss": lambda out, y: (out - y).abs().mean()})
