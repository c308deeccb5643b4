"""How the ranks agree on the stop facts, so every rank fires the same trigger: at each agreement point one
all-gather of every rank's stop request and signal, and the same verdict (:func:`decide`) on every rank:
a signal on any rank interrupts all; else the highest precedence wins, then the first by (epoch, phase, rank).
A rank that raises posts its failure on the :class:`FailureBoard`; the others end naming it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fsmtrain.core.context import RunContext, StopRequest
from fsmtrain.core.lifecycle import ABORT, TRANSITIONS, Guard, Phase
from fsmtrain.core.stop import StopReason

__all__ = ["FIRST_ROUNDS_EVERY", "MAX_ROUNDS_EVERY", "ROUND_SPACING_S", "AgreementTimeout", "Collective",
           "Failure", "FailureBoard", "RankAgreement", "RankFailed", "Verdict", "agreement_points", "decide",
           "log_name_for_rank", "may_override", "on_rank", "proposal_of", "rounds_every_for", "verdict_order"]

_REASONS: tuple[StopReason, ...] = tuple(StopReason)
_PHASES: tuple[Phase, ...] = tuple(Phase)
_WIDTH = 6  # has_request, reason, epoch, phase, immediate, signal


def agreement_points(per_batch: bool) -> frozenset[Phase]:
    """The phases whose moves read ``can_continue`` (with ``per_batch``: ``immediate_stop`` too), the guards
    whose facts can differ between ranks."""
    wanted = {Guard.CAN_CONTINUE, Guard.IMMEDIATE_STOP} if per_batch else {Guard.CAN_CONTINUE}
    return frozenset(t.source for t in TRANSITIONS
                     if t.trigger != ABORT and wanted & {*t.conditions, *t.unless})


def log_name_for_rank(rank: int) -> str:
    """Each rank's event log: ``events.jsonl`` for rank 0, else ``events-rank<r>.jsonl``."""
    return "events.jsonl" if rank == 0 else f"events-rank{rank}.jsonl"


def on_rank(source: str, rank: int) -> str:
    """How every rank's log names where a stop or a fault of another rank came from."""
    return f"{source} on rank {rank}"


@dataclass(frozen=True)
class Failure:
    """An exception that ended one rank: where (``source``) and what (``message``, type: text)."""

    rank: int
    source: str
    message: str

    def encode(self) -> str:
        return f"{self.rank}\n{self.source}\n{self.message}"

    @classmethod
    def decode(cls, text: str) -> Failure | None:
        rank, _, rest = text.partition("\n")
        source, _, message = rest.partition("\n")
        return cls(int(rank), source, message) if rank.isdigit() else None


class RankFailed(Exception):
    """Another rank failed first; this rank stops (INTERRUPTED) and names it (``symptom``: what it met itself)."""

    def __init__(self, failure: Failure, symptom: str | None = None) -> None:
        self.failure = failure
        self.symptom = symptom
        super().__init__(f"rank {failure.rank} failed in {failure.source}: {failure.message}")


class AgreementTimeout(TimeoutError):
    """No answer from every rank at an agreement point within the bound (``distributed.agreement_timeout_s``)."""


@runtime_checkable
class FailureBoard(Protocol):
    """Where the ranks of a run post the exception that ended one of them (the first post wins)."""

    def post_failure(self, failure: Failure) -> Failure:
        """Post ``failure`` unless another is there; the first one posted."""

    def posted_failure(self) -> Failure | None: ...


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

    # Optional: ``all_reduce_max_async(values)`` starts a non-blocking element-wise max over the ranks
    # and returns what waits for it (the per-batch signal round of :meth:`RankAgreement.poll_signal`).


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed: a signal (0: none) and the winning stop request, from ``stop_rank``."""

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


def verdict_order(reason: StopReason, epoch: int, phase: Phase, rank: int) -> tuple[int, int, int, int]:
    """The sort key of a stop request in the verdict; the lowest wins."""
    return -reason.precedence, epoch, _PHASES.index(phase), rank


def may_override(agreed: tuple[StopReason, int, Phase, int], held: tuple[StopReason, int, Phase, int]) -> bool:
    """Whether the agreed request (reason, epoch, phase, rank) may replace the one a rank ``held``."""
    return verdict_order(*agreed) < verdict_order(*held)


def decide(rows: Sequence[Sequence[int]]) -> Verdict:
    """The verdict every rank computes from the same gathered rows (a pure function of them)."""
    if any(len(r) != _WIDTH for r in rows):
        raise ValueError(f"agreement rows must have {_WIDTH} integers, got {[len(r) for r in rows]}")
    signal, signal_rank = next(((row[5], rank) for rank, row in enumerate(rows) if row[5]), (0, -1))
    requests = [(rank, row) for rank, row in enumerate(rows) if row[0]]
    if not requests:
        return Verdict(signal, signal_rank)
    rank, row = min(requests, key=lambda rr: verdict_order(_REASONS[rr[1][1]], rr[1][2], _PHASES[rr[1][3]], rr[0]))
    return Verdict(signal, signal_rank, rank, _REASONS[row[1]], bool(row[4]), row[2], _PHASES[row[3]])


FIRST_ROUNDS_EVERY = 1  # the first two rounds (auto), before any batch time is known: at once, a long step or not
ROUND_SPACING_S = 0.5  # auto: a round (0.6-1.6 ms of CPU with gloo's threads on 2 CPU ranks) every 500 ms
MAX_ROUNDS_EVERY = 256  # auto never spaces two rounds further apart: a signal is agreed within 512 steps


def rounds_every_for(seconds_per_batch: float) -> int:
    """Auto's spacing of the signal rounds, in batches: about :data:`ROUND_SPACING_S` of training, 1 to
    :data:`MAX_ROUNDS_EVERY`, so a round costs under 1% of the time between rounds however long a step is."""
    if not seconds_per_batch > 0:
        return MAX_ROUNDS_EVERY
    return max(1, min(MAX_ROUNDS_EVERY, round(ROUND_SPACING_S / seconds_per_batch)))


class RankAgreement:
    """One rank's side: :meth:`agree` at each of :attr:`points`; the guards read :attr:`stop`, :attr:`signal`.
    ``rounds_every``: the batches between the per-batch signal rounds (None: auto, :func:`rounds_every_for`)."""

    def __init__(self, collective: Collective, run: RunContext, *, per_batch: bool, rounds_every: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.collective = collective
        self.run = run
        self.per_batch = per_batch
        self.points = agreement_points(per_batch)
        self.stop: StopRequest | None = None
        self.signal: tuple[int, int] | None = None  # (signal, rank)
        self.held = False  # the engine holds the agreed signal for one move (a move the table marks signal_after)
        # Per batch, without blocking: a round (a non-blocking all-reduce of the signals) every `every` batches,
        # read at the next round, so every rank stops after the same step. The round also carries each rank's
        # proposal for the spacing after it (auto: from its own batch time), and the ranks take the largest.
        self.rounds_every = rounds_every  # None: auto
        self.every = rounds_every or FIRST_ROUNDS_EVERY  # the batches from this round to the next
        self._send = getattr(collective, "all_reduce_max_async", None)
        self._round: Callable[[], list[int]] | None = None
        self._left = self.every
        self._sent_at: float | None = None
        self._clock = clock

    def poll_signal(self) -> None:
        """Before a batch: at a round, read the round before (a signal, the spacing agreed) and send this one."""
        self._left -= 1
        if self._left > 0 or self._send is None:
            return
        since, now = self.every, self._clock()
        if self._round is not None:
            signum, rank, every = self._round()
            if signum and self.signal is None:
                self.signal = (signum, rank - 1)
            self.every = every
        proposal = self.rounds_every or (FIRST_ROUNDS_EVERY if self._sent_at is None
                                         else rounds_every_for((now - self._sent_at) / since))
        mine = self.run.pending_signal or 0
        self._round = self._send([mine, self.collective.rank + 1 if mine else 0, proposal])
        self._sent_at, self._left = now, self.every

    def account(self, exc: BaseException, source: str) -> BaseException:
        """``exc``, posted as this rank's failure, or :class:`RankFailed` naming another rank's, posted first."""
        board = self.collective
        if isinstance(exc, RankFailed) or not isinstance(board, FailureBoard):
            return exc
        rank = self.collective.rank
        try:
            first = board.posted_failure() if isinstance(exc, KeyboardInterrupt) else board.post_failure(
                Failure(rank, source, f"{type(exc).__name__}: {exc}"))
        except Exception as err:  # the board is gone too: this rank's own exception stands, and says so
            self.run.warn("engine", f"could not read or post the run's failure board: {type(err).__name__}: {err}")
            return exc
        if first is None or first.rank == rank:
            return exc
        failed = RankFailed(first, f"{type(exc).__name__}: {exc}")
        failed.__cause__ = exc
        return failed

    def immediate_stop(self) -> bool:
        stop = self.stop
        return (stop is not None and stop.immediate) or (self.signal is not None and not self.held)

    def agree(self) -> None:
        """One all-gather of every rank's new stop request and signal; every rank applies the same verdict."""
        collective, run = self.collective, self.run
        mine = run.stop if run.stop is not self.stop else None
        signal_seen = run.pending_signal if self.signal is None else None
        verdict = decide(collective.all_gather_ints(proposal_of(mine, signal_seen)))
        if verdict.signal and self.signal is None:
            self.signal = (verdict.signal, verdict.signal_rank)
        if verdict.reason is None:
            return
        source, message = collective.broadcast_object(
            (mine.source, mine.message) if mine is not None and collective.rank == verdict.stop_rank else None,
            verdict.stop_rank)
        if collective.rank != verdict.stop_rank or mine is None:
            source = on_rank(source, verdict.stop_rank)
            replaced = run.stop
            run.stop = StopRequest(verdict.reason, source, message, verdict.immediate, verdict.epoch,
                                   run.global_step, verdict.phase)
            extra = {"overrides": replaced.reason.value} if replaced is not None else {}
            run.emit("stop_request", reason=verdict.reason.value, source=source, message=message,
                     immediate=verdict.immediate, accepted=True, rank=verdict.stop_rank,
                     requested_epoch=verdict.epoch, requested_phase=verdict.phase.value, **extra)
        self.stop = run.stop
        if verdict.immediate and not self.per_batch and verdict.phase not in self.points:
            run.warn("engine", f"an immediate stop from {source} is honoured at this epoch's end: no callback of "
                     "this run declares may_stop_immediately, so the ranks agree once per epoch")
