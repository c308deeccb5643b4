"""What a run ends with: :class:`TrainResult`, written as its ``result`` and returned by ``fit()``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fsmtrain.core.context import EpochRecord, RunContext, StopRequest
from fsmtrain.core.stop import StopReason

__all__ = ["TrainResult"]

_SUMMARY_FIELDS = ("epochs_completed", "last_val_loss", "best_val_loss", "best_epoch", "objective", "global_step")


@dataclass
class TrainResult:
    """What ``fit()`` returns. ``objective`` is the best finite ``val_loss`` (``inf`` for NAN)."""

    run_id: str
    stop_reason: StopReason
    stop: StopRequest | None
    epochs_completed: int
    last_val_loss: float
    best_val_loss: float
    best_epoch: int | None
    objective: float
    history: list[EpochRecord] = field(default_factory=list)
    global_step: int = 0
    run_dir: str | None = None

    @classmethod
    def from_run(cls, run: RunContext, reason: StopReason) -> TrainResult:
        vals = [(r.val_loss, r.epoch) for r in run.history if math.isfinite(r.val_loss)]
        best, best_epoch = min(vals) if vals else (math.inf, None)
        last = run.history[-1].val_loss if run.history else math.nan
        objective = reason.objective(best)
        return cls(run.run_id, reason, run.stop, len(run.history), last, best, best_epoch, objective,
                   list(run.history), run.global_step, None if run.run_dir is None else str(run.run_dir))

    def summary(self) -> dict[str, Any]:
        return {"stop_reason": self.stop_reason.value, "stop_source": self.stop.source if self.stop else None,
                "stop_message": self.stop.message if self.stop else None,
                **{k: getattr(self, k) for k in _SUMMARY_FIELDS}}
