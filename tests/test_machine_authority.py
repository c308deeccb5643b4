"""The machine owns the run: a stubbed machine breaks a run, hooks fire in the table's
order on both paths, NaN outranks other stops, teardown cannot be skipped, and validation batch
hooks see every batch."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from core_helpers import Recorder, events_of, make_trainer
from sklearn.metrics import f1_score
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsmtrain.core.engine as engine_mod
from fsmtrain import Trainer, TrainingCallback
from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback, NaNDetectionCallback, PrunerCallback
from fsmtrain.core.context import EpochContext, FaultContext, RunContext, Slot, StepContext, ValStepContext
from fsmtrain.core.epoch_work import END
from fsmtrain.core.lifecycle import (
    BATCH,
    HOOKS,
    TRANSITIONS,
    Guard,
    HookScope,
    LifecycleError,
    Phase,
)
from fsmtrain.core.machine import build_machine
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]


# --- 1. a stubbed machine breaks the run --------------------------------------------------------------
class _AcceptsEverything:
    """Moves wherever the table's first transition of a trigger goes, ignoring guards and handlers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        model.state = Phase.CREATED.value
        model.trigger = self.trigger

    def trigger(self, name: str) -> bool:
        for t in TRANSITIONS:
            if t.trigger == name and t.source.value == self.model.state:
                self.model.state = t.dest.value
                return True
        return True


class _NeverMoves:
    def __init__(self, model: Any) -> None:
        model.state = Phase.CREATED.value
        model.trigger = lambda name: True


def _guardless(model: Any, guards: Mapping[Guard, Callable[[], bool]], handlers: Any) -> Any:
    """A real ``transitions`` machine with the real handlers whose conditions always pass."""
    return build_machine(model, {g: (lambda: True) for g in guards}, handlers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stub", [
    lambda model, guards, handlers: _AcceptsEverything(model),
    lambda model, guards, handlers: _NeverMoves(model),
    _guardless,
], ids=["accepts-every-trigger", "never-changes-state", "guards-always-pass"])
def test_a_stubbed_machine_cannot_run_a_training(monkeypatch: pytest.MonkeyPatch, stub: Any) -> None:
    monkeypatch.setattr(engine_mod, "build_machine", stub)
    rec = Recorder()
    with pytest.raises((LifecycleError, TypeError, ValueError)):
        make_trainer(None, [rec], epochs=2).fit()
    assert rec.calls.count("on_epoch_end") < 2  # it did not train as if nothing were wrong


def _permissive(model: Any, guards: Mapping[Guard, Callable[[], bool]], handlers: Any) -> Any:
    """A real ``transitions`` machine that believes there is always another batch and never a stop."""
    facts = {Guard.HAS_BATCH: True, Guard.IMMEDIATE_STOP: False, Guard.CAN_CONTINUE: True, Guard.FAULTED: True,
             Guard.VAL_DUE: False}
    return build_machine(model, {g: facts[g].__bool__ for g in guards}, handlers)


class SeesBatches(TrainingCallback):
    def __init__(self) -> None:
        self.batches: list[Any] = []

    def on_batch_begin(self, step: StepContext) -> None:
        self.batches.append(step.batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strict", [False, True])
def test_a_permissive_machine_runs_no_handler_of_a_move_the_table_forbids(
        monkeypatch: pytest.MonkeyPatch, strict: bool) -> None:
    """Under a machine whose conditions always pass, the `batch` handler never runs on the end-of-data
    sentinel: the move's legality is checked before its handlers."""
    monkeypatch.setattr(engine_mod, "build_machine", _permissive)
    seen = SeesBatches()
    with pytest.raises(LifecycleError, match=r"fired 'batch' from 'train_step'.*has_batch.*its handlers did not run"):
        make_trainer(None, [seen], epochs=2, strict=strict).fit()
    assert seen.batches and not any(b is END for b in seen.batches)
    assert len(seen.batches) == 5  # every real batch of the first epoch, and nothing after them


def _refuses_abort(model: Any, guards: Mapping[Guard, Callable[[], bool]], handlers: Any) -> Any:
    """A real ``transitions`` machine whose ``abort`` condition never holds."""
    return build_machine(model, {**guards, Guard.FAULTED: lambda: False}, handlers)


@pytest.mark.timeout(60)
def test_a_machine_that_refuses_abort_still_tears_down_and_writes_an_error_result(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused `abort` still runs the teardown and writes the `result`."""
    monkeypatch.setattr(engine_mod, "build_machine", _refuses_abort)
    log: list[str] = []
    with pytest.raises(LifecycleError, match=r"refused 'abort' from 'val'") as info:
        make_trainer(tmp_path, [FailsIn(), Ends("a", 10, log)], epochs=2).fit()
    assert isinstance(info.value.__cause__, ValueError)  # the fault the abort was for
    assert log == ["a.on_exception", "a.on_train_end"]
    events = events_of(tmp_path)
    assert events[-1]["event"] == "result"
    result = events[-1]["payload"]
    assert result["stop_reason"] == "error"
    assert "refused 'abort' from 'val'" in result["stop_message"] and "the original fault" in result["stop_message"]


# --- 2. hooks fire in the order lifecycle.HOOKS lists, on both paths ----------------------------------
class EveryHook(TrainingCallback):
    """Overrides every hook the table declares and records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []


def _recorder(name: str) -> Callable[[EveryHook, Any], None]:
    def hook(self: EveryHook, ctx: Any) -> None:
        self.calls.append(name)

    return hook


for _spec in HOOKS:
    setattr(EveryHook, _spec.name, _recorder(_spec.name))


def _expected_calls(epochs: int, batches: int, val_batches: int) -> list[str]:
    """The order HOOKS lists, unrolled for a run: once-per-phase hooks once, per-batch hooks once per
    batch, fired-by-the-store (checkpoint) and fault hooks not at all."""
    def phase_hooks(phase: Phase) -> list[str]:
        return [h.name for h in HOOKS if h.phase is phase and h.scope not in (HookScope.CHECKPOINT, HookScope.FAULT)]

    out = phase_hooks(Phase.TRAIN_BEGIN)
    for _ in range(epochs):
        out += phase_hooks(Phase.EPOCH_BEGIN)
        out += phase_hooks(Phase.TRAIN_STEP) * batches
        val = phase_hooks(Phase.VAL)
        once = [h for h in val if h not in {s.name for s in HOOKS if s.per_batch}]
        per = [h for h in val if h not in once]
        out += once[:1] + per * val_batches + once[1:]
        out += phase_hooks(Phase.EPOCH_END)
    return out + phase_hooks(Phase.TRAIN_END)


@pytest.mark.parametrize("strict", [False, True])
def test_hooks_fire_in_the_table_order(strict: bool) -> None:
    cb = EveryHook()
    make_trainer(None, [cb], epochs=2, strict=strict).fit()
    assert cb.calls == _expected_calls(epochs=2, batches=5, val_batches=2)  # 72/16 and 24/16 batches
    # the table's order is the documented loop, not something else that happens to match
    assert cb.calls[:4] == ["on_train_begin", "on_train_epoch_begin", "on_batch_begin", "on_before_forward"]
    assert cb.calls[-4:] == ["on_val_end", "on_before_scheduler_step", "on_epoch_end", "on_train_end"]


def test_default_fast_loop_and_strict_mode_give_identical_traces_and_weights(tmp_path: Path) -> None:
    """No per-batch hook, no debug logging: the compiled fast path against the real trigger per batch."""
    out = {}
    for strict in (False, True):
        d = tmp_path / str(strict)
        trainer = make_trainer(d, [], epochs=3, strict=strict)
        trainer.fit()
        trace = [(e["event"], e["from"], e["to"], e["trigger"], e["epoch"], e["global_step"], e["payload"])
                 for e in events_of(d) if e["event"] != "run_start"]
        for i, e in enumerate(trace):
            if e[0] == "epoch":  # timings differ run to run
                payload = {k: v for k, v in e[6].items() if k not in ("seconds", "phase_seconds", "callback_seconds")}
                trace[i] = (*e[:6], payload)
        out[strict] = (trace, [p.detach().clone() for p in trainer.model.parameters()])
    assert out[False][0] == out[True][0]
    assert all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1], strict=True))


def test_batch_moves_count_through_the_machine_in_strict_mode() -> None:
    trainer = make_trainer(None, [], epochs=1, strict=True)
    fired: list[str] = []
    original = trainer.engine._model.trigger

    def counting(name: str) -> bool:
        fired.append(name)
        return original(name)

    trainer.engine._model.trigger = counting
    trainer.fit()
    assert fired.count(BATCH) == 5 + 1  # five batches fire; the sixth offer is refused by the guard


# --- 3. NaN wins ---------------------------------------------------------------------------------------
class NaNFrom(nn.Module):
    """A real model whose output turns NaN from epoch ``at`` on (the weights follow it into NaN)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.at = at
        self.epoch = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return y * math.nan if self.epoch >= self.at else y


class EpochTell(TrainingCallback):
    def __init__(self, model: NaNFrom) -> None:
        self.model = model

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        self.model.epoch = epoch.index


def _nan_run(tmp_path: Path, other: TrainingCallback, at: int = 2) -> tuple[Any, list[dict[str, Any]]]:
    model = NaNFrom(at)
    ck = CheckpointCallback(tmp_path / "checkpoints", keep_last_k=0)
    trainer = make_trainer(tmp_path, [EpochTell(model), NaNDetectionCallback(), other, ck], epochs=8, model=model)
    return trainer.fit(), events_of(tmp_path)


def test_nan_wins_over_early_stopping_in_the_same_epoch(tmp_path: Path) -> None:
    # min_delta 0.99: nothing improves after epoch 0, so patience 2 runs out in epoch index 2, the NaN epoch
    result, events = _nan_run(tmp_path, EarlyStoppingCallback(patience=2, min_delta=0.99))
    requests = [e["payload"] for e in events if e["event"] == "stop_request"]
    assert [(r["reason"], r["accepted"]) for r in requests] == [("early_stop", True), ("nan", True)]
    assert requests[1]["overrides"] == "early_stop"
    assert result.stop_reason is StopReason.NAN and result.objective == math.inf
    assert result.epochs_completed == 3
    _assert_best_finite_and_audit_passes(tmp_path)


def test_nan_wins_over_a_real_optuna_prune_in_the_same_epoch(tmp_path: Path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=1e9))  # prunes NaN values
    trial = study.ask()
    result, events = _nan_run(tmp_path, PrunerCallback(trial))
    requests = [e["payload"] for e in events if e["event"] == "stop_request"]
    assert [(r["reason"], r["accepted"]) for r in requests] == [("pruned", True), ("nan", True)]
    assert result.stop_reason is StopReason.NAN and result.objective == math.inf
    _assert_best_finite_and_audit_passes(tmp_path)


def _assert_best_finite_and_audit_passes(run_dir: Path) -> None:
    best = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    assert all(torch.isfinite(t).all() for t in best["model"].values())
    report = audit_file(run_dir / "events.jsonl")
    assert report.ok, report.render(False)


# --- 4. teardown cannot be skipped ---------------------------------------------------------------------
class Ends(TrainingCallback):
    def __init__(self, name: str, priority: int, log: list[str], fail: str | None = None) -> None:
        self.label, self.priority, self.log, self.fail = name, priority, log, fail

    @property
    def name(self) -> str:
        return self.label

    def on_exception(self, fault: FaultContext) -> None:
        self.log.append(f"{self.label}.on_exception")
        if self.fail == "on_exception":
            raise RuntimeError(f"{self.label} failed in on_exception")

    def on_train_end(self, run: RunContext) -> None:
        self.log.append(f"{self.label}.on_train_end")
        if self.fail == "on_train_end":
            raise RuntimeError(f"{self.label} failed in on_train_end")


def test_a_failing_on_train_end_skips_no_other_handler(tmp_path: Path) -> None:
    log: list[str] = []
    cbs = [Ends("a", 10, log), Ends("b", 20, log, fail="on_train_end"), Ends("c", 30, log, fail="on_train_end")]
    with pytest.raises(RuntimeError, match="b failed in on_train_end"):  # the first error
        make_trainer(tmp_path, cbs, epochs=1).fit()
    assert log == ["a.on_train_end", "b.on_train_end", "c.on_train_end"]
    events = events_of(tmp_path)
    assert [e["payload"]["source"] for e in events if e["event"] == "exception"] == [
        "b.on_train_end", "c.on_train_end"]
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "completed"
    report = audit_file(tmp_path / "events.jsonl")
    assert report.ok, report.render(False)


class FailsIn(TrainingCallback):
    def on_val_end(self, epoch: EpochContext) -> None:
        raise ValueError("the original fault")


def test_a_failing_on_exception_skips_no_other_handler(tmp_path: Path) -> None:
    log: list[str] = []
    cbs = [FailsIn(), Ends("a", 10, log, fail="on_exception"), Ends("b", 20, log)]
    with pytest.raises(ValueError, match="the original fault"):
        make_trainer(tmp_path, cbs, epochs=2).fit()
    assert log == ["a.on_exception", "b.on_exception", "a.on_train_end", "b.on_train_end"]
    events = events_of(tmp_path)
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "error"
    report = audit_file(tmp_path / "events.jsonl")
    assert report.ok, report.render(False)


_TWO_SIGINTS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from core_helpers import make_trainer
    from fsmtrain import TrainingCallback

    class Slow(TrainingCallback):
        def on_train_step_end(self, step):
            time.sleep(0.005)
        def on_epoch_end(self, epoch):
            Path({ready!r}).touch()
        def on_train_end(self, run):
            time.sleep(0.5)  # the second SIGINT lands here, during teardown

    try:
        make_trainer(Path({run!r}), [Slow()], epochs=1000).fit()
    except KeyboardInterrupt:
        sys.exit(130)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_sigints_20ms_apart_still_write_the_result(tmp_path: Path) -> None:
    run, ready = tmp_path / "run", tmp_path / "ready"
    code = _TWO_SIGINTS.format(tests=str(REPO / "tests"), ready=str(ready), run=str(run))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 90
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    events = events_of(run)
    result = [e for e in events if e["event"] == "result"]
    assert len(result) == 1 and result[0]["payload"]["stop_reason"] == "interrupted"
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)


# --- 8. validation batch hooks: a metric over the whole validation set -----------------------------------
F1 = Slot[float]("val_f1")


class MacroF1(TrainingCallback):
    """Accumulates predictions over every validation batch; F1 is not a mean of batch F1s."""

    writes = (F1,)

    def __init__(self) -> None:
        self.preds: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def on_val_begin(self, epoch: EpochContext) -> None:
        self.preds, self.targets = [], []

    def on_val_batch_end(self, step: ValStepContext) -> None:
        self.preds.append(step.output.argmax(dim=1))
        self.targets.append(step.batch[1])

    def on_val_end(self, epoch: EpochContext) -> None:
        preds, targets = torch.cat(self.preds), torch.cat(self.targets)
        epoch.set(F1, float(f1_score(targets.numpy(), preds.numpy(), average="macro")))


def test_f1_through_validation_batch_hooks_matches_sklearn() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    train = DataLoader(TensorDataset(x[:200], y[:200]), batch_size=32)
    val = DataLoader(TensorDataset(x[200:], y[200:]), batch_size=17)  # uneven last batch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    cb = MacroF1()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), train, val,
                      max_epochs=3, callbacks=[cb], console_level="error", default_callbacks=False)
    result = trainer.fit()
    with torch.no_grad():
        preds = model(x[200:]).argmax(dim=1)
    expected = f1_score(y[200:].numpy(), preds.numpy(), average="macro")
    assert result.history[-1].slots["val_f1"] == pytest.approx(expected, abs=1e-12)
    assert 0.3 < expected < 1.0


def test_val_step_context_carries_batch_output_and_loss() -> None:
    seen: list[tuple[int, int, bool]] = []

    class Look(TrainingCallback):
        def on_val_batch_begin(self, step: ValStepContext) -> None:
            assert step.output is None and step.loss is None

        def on_val_batch_end(self, step: ValStepContext) -> None:
            assert not torch.is_grad_enabled()  # inference mode holds for the hooks too
            seen.append((step.batch_index, step.output.shape[0], bool(torch.isfinite(step.loss))))

    make_trainer(None, [Look()], epochs=1).fit()
    assert seen == [(0, 16, True), (1, 8, True)]


def test_step_context_is_what_the_per_batch_hooks_get() -> None:
    kinds: set[type] = set()

    class Kind(TrainingCallback):
        def on_batch_begin(self, step: StepContext) -> None:
            kinds.add(type(step))

    make_trainer(None, [Kind()], epochs=1).fit()
    assert kinds == {StepContext}
