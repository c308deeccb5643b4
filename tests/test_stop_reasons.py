"""Every fact about a stop reason lives in one row of ``fsmtrain.core.stop.FACTS``.

A new reason is one member of ``StopReason`` plus its row, both in ``pipeline/core/stop.py``: an
``Enum`` cannot gain a member from anywhere else, so that one edit is the least there can be. What
this file proves is that nothing else needs editing: change a reason's row and the CLI's exit code,
the diagram's edges, the audit's expectations, W&B's verdict and the objective all follow.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from fsmtrain.callbacks.wandb_logging import WandbLoggingCallback
from fsmtrain.cli import ExitCode, exit_code_for
from fsmtrain.core.context import StopRequest
from fsmtrain.core.drawing import stop_reasons_for
from fsmtrain.core.lifecycle import ABORT, TRANSITIONS, Phase, transition_for
from fsmtrain.core.stop import FACTS, Evidence, Route, StopFacts, StopReason
from fsmtrain.tools.audit.ending import EndingChecks
from fsmtrain.tools.audit.segment import Segment


def test_every_reason_has_exactly_one_row() -> None:
    assert set(FACTS) == set(StopReason)


def test_the_shipped_rows_say_what_the_readme_says() -> None:
    ok = {r for r in StopReason if exit_code_for(r) is ExitCode.OK}
    assert ok == {StopReason.COMPLETED, StopReason.STEPS, StopReason.EARLY_STOP, StopReason.PRUNED,
                  StopReason.TARGET_REACHED}
    assert {r for r in StopReason if r.fault} == {StopReason.INTERRUPTED, StopReason.ERROR}
    assert StopReason.NAN.objective(0.5) == math.inf and StopReason.EARLY_STOP.objective(0.5) == 0.5
    assert StopReason.NAN.outranks(StopReason.EARLY_STOP)


class _Finish:
    """What ``WandbLoggingCallback.on_train_end`` hands W&B: a recording stand-in for a ``wandb`` run
    object, since the question is which exit code our code passes, not what W&B does with it."""

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self.exit_code: int | None = None

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code


def _wandb_exit_code(reason: StopReason) -> int | None:
    cb = WandbLoggingCallback(project="p")
    wb = cb.wandb_run = _Finish()
    run = SimpleNamespace(stop=StopRequest(reason, "cb", "msg", False, 0, 0, Phase.VAL), stop_reason=reason,
                          best=lambda: 0.5)
    cb.on_train_end(run)  # type: ignore[arg-type]
    return wb.exit_code


def _missing_evidence(reason: StopReason) -> str | None:
    seg = Segment(first_line=1, run_id="r", max_epochs=3, start_epoch=0, resumed_from=None, callbacks=[])
    seg.next_epoch = 3
    abort = {"trigger": ABORT}
    return EndingChecks._missing_evidence(reason, abort, seg)


def test_a_changed_row_reaches_every_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = StopReason.EARLY_STOP
    stop_now = transition_for("stop_now", Phase.VAL)
    abort = next(t for t in TRANSITIONS if t.trigger == ABORT and t.source is Phase.VAL)
    assert exit_code_for(reason) is ExitCode.OK
    assert reason in stop_reasons_for(stop_now) and reason not in stop_reasons_for(abort)
    assert _wandb_exit_code(reason) == 0
    assert _missing_evidence(reason) is None

    # The scratch row: early stopping becomes a fault that fails the run, like an error.
    monkeypatch.setitem(FACTS, reason, StopFacts(Route.FAULT, 2, 1, 2, True, True, Evidence.EXCEPTION))
    assert exit_code_for(reason) is ExitCode.ERROR
    assert reason not in stop_reasons_for(stop_now) and reason in stop_reasons_for(abort)
    assert _wandb_exit_code(reason) == 1
    assert _missing_evidence(reason) == "no exception event precedes this abort"
    assert reason.objective(0.5) == math.inf
