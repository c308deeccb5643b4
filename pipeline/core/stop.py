"""Why a run reached ``train_end``: :class:`StopReason`, every fact of each reason in one row of
:data:`FACTS`: its route (budget, request, fault), precedence, exit status, severity over several seeds,
W&B failed, infinite objective, and the evidence the audit needs. A new reason is a member and its row."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["FACTS", "Evidence", "Route", "StopFacts", "StopReason", "budget_end"]


class Route(str, Enum):
    EPOCHS = "epochs"
    REQUEST = "request"
    FAULT = "fault"


class Evidence(str, Enum):
    """What the audit must find in a log that ended for a reason."""

    LAST_EPOCH = "last_epoch"  # every epoch up to max_epochs ran
    LAST_STEP = "last_step"  # the steps reached max_steps
    NONFINITE_LOSS = "nonfinite_loss"  # a loss of the stopping epoch is not finite
    REQUEST = "request"  # the stop_request in force names the reason
    PRUNE_DECISION = "prune_decision"  # and the last trial_report said should_prune
    EXCEPTION = "exception"  # an exception (not an interrupt) precedes the abort
    INTERRUPT = "interrupt"  # an interrupt precedes the abort


@dataclass(frozen=True)
class StopFacts:
    """One row of the table."""

    route: Route
    precedence: int
    exit_code: int
    severity: int
    failed: bool
    infinite_objective: bool
    evidence: Evidence


class StopReason(str, Enum):
    """Why a run reached ``train_end``; its facts (``route``, ``exit_code``...) are its row of :data:`FACTS`."""

    route: Route
    precedence: int
    exit_code: int
    severity: int
    failed: bool
    evidence: Evidence

    COMPLETED = "completed"
    STEPS = "steps"  # max_steps reached
    NAN = "nan"
    EARLY_STOP = "early_stop"
    PRUNED = "pruned"
    TARGET_REACHED = "target_reached"  # a callback stopped because a goal was met
    INTERRUPTED = "interrupted"
    ERROR = "error"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # the enum machinery's own lookups
            raise AttributeError(name)
        return getattr(FACTS[self], name)

    @property
    def fault(self) -> bool:
        """Forced by the engine on an exception or a signal, never requested."""
        return FACTS[self].route is Route.FAULT

    @property
    def requested(self) -> bool:
        """Only a callback's ``request_stop`` ends a run for this reason."""
        return FACTS[self].route is Route.REQUEST

    def outranks(self, other: StopReason) -> bool:
        return self.precedence > other.precedence

    def objective(self, best_val_loss: float) -> float:
        """What a run that ended for this reason reports as its objective."""
        return math.inf if FACTS[self].infinite_objective else best_val_loss


_R, _E = Route, Evidence
FACTS: Mapping[StopReason, StopFacts] = {
    #                                route       prec exit sev  failed inf-objective evidence
    StopReason.COMPLETED: StopFacts(_R.EPOCHS, 0, 0, 0, False, False, _E.LAST_EPOCH),
    StopReason.STEPS: StopFacts(_R.EPOCHS, 0, 0, 0, False, False, _E.LAST_STEP),
    StopReason.NAN: StopFacts(_R.REQUEST, 1, 3, 1, True, True, _E.NONFINITE_LOSS),
    StopReason.EARLY_STOP: StopFacts(_R.REQUEST, 0, 0, 0, False, False, _E.REQUEST),
    StopReason.PRUNED: StopFacts(_R.REQUEST, 0, 0, 0, False, False, _E.PRUNE_DECISION),
    StopReason.TARGET_REACHED: StopFacts(_R.REQUEST, 0, 0, 0, False, False, _E.REQUEST),
    StopReason.INTERRUPTED: StopFacts(_R.FAULT, 2, 130, 3, True, False, _E.INTERRUPT),
    StopReason.ERROR: StopFacts(_R.FAULT, 2, 1, 2, True, False, _E.EXCEPTION),
}


def budget_end(max_epochs: int, max_steps: int | None, global_step: int) -> tuple[StopReason, str, str]:
    """Why a run with no stop requested ended (its reason, source, message): whichever budget ran out."""
    if max_steps is not None and global_step >= max_steps:
        return StopReason.STEPS, "max_steps", f"reached max_steps={max_steps}"
    return StopReason.COMPLETED, "max_epochs", f"reached max_epochs={max_epochs}"
