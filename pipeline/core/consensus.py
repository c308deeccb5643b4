"""How the ranks of a multi-process run agree on the guard facts, so every rank fires the same trigger.

A stop can be decided on one rank only: a NaN it saw, a callback's request, a signal sent to that
one process. If that rank alone moved to ``train_end``, the others would wait for it in their next
collective for ever. So in a multi-process run the guards that read stop facts
(:data:`pipeline.core.lifecycle.SHARED_GUARDS`) read the *agreed* facts: at the phases of
:func:`pipeline.core.lifecycle.agreement_points` every rank contributes what it has seen since the
last agreement (its own stop request, a signal) in one small all-gather, and every rank applies
the same verdict:

- a signal on any rank interrupts every rank (the lowest rank's signal names it);
- otherwise the winning stop request is the one of highest precedence (NaN over early stop, as in
  one process), then the first by (epoch, phase, rank); its source and message are broadcast
  from the rank that made it, and every other rank logs it as an accepted ``stop_request`` that
  names that rank.

The collective itself is the training layer's (``pipeline.training.distributed``); this module
is torch-free and only decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.core.lifecycle import Phase, StopReason

__all__ = ["Collective", "Verdict", "decide", "log_name_for_rank", "proposal_of"]

_REASONS: tuple[StopReason, ...] = tuple(StopReason)
_PHASES: tuple[Phase, ...] = tuple(Phase)
_WIDTH = 6  # has_request, reason, epoch, phase, immediate, signal


def log_name_for_rank(rank: int) -> str:
    """Each rank's event log: ``events.jsonl`` for rank 0 (the run's log), ``events-rank<r>.jsonl``."""
    return "events.jsonl" if rank == 0 else f"events-rank{rank}.jsonl"


class Collective(Protocol):
    """The collective operations the engine needs; every rank calls them in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (all of one length), indexed by rank."""

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` as rank ``src`` has it, on every rank."""


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed. ``signal``/``signal_rank``: a signal to act on (0: none).
    ``stop``: the winning stop request's fields, from rank ``stop_rank``."""

    signal: int = 0
    signal_rank: int = -1
    stop_rank: int = -1
    reason: StopReason | None = None
    immediate: bool = False
    epoch: int = 0
    phase: Phase = Phase.CREATED


def proposal_of(stop: Any, signal: int | None) -> list[int]:
    """A rank's contribution: its pending stop request (a ``StopRequest`` or None) and signal."""
    if stop is None:
        return [0, 0, 0, 0, 0, int(signal or 0)]
    return [1, _REASONS.index(stop.reason), int(stop.epoch), _PHASES.index(stop.phase), int(bool(stop.immediate)),
            int(signal or 0)]


def decide(rows: Sequence[Sequence[int]]) -> Verdict:
    """The verdict every rank computes from the same gathered rows (a pure function of them)."""
    if any(len(r) != _WIDTH for r in rows):
        raise ValueError(f"agreement rows must have {_WIDTH} integers, got {[len(r) for r in rows]}")
    signal, signal_rank = 0, -1
    for rank, row in enumerate(rows):
        if row[5]:
            signal, signal_rank = row[5], rank
            break
    requests = [(rank, row) for rank, row in enumerate(rows) if row[0]]
    if not requests:
        return Verdict(signal, signal_rank)
    rank, row = min(requests, key=lambda rr: (-_REASONS[rr[1][1]].precedence, rr[1][2], rr[1][3], rr[0]))
    return Verdict(signal, signal_rank, rank, _REASONS[row[1]], bool(row[4]), row[2], _PHASES[row[3]])
