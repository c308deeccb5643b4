"""One rank of a multi-process run, replayed: :class:`RecordedRanks` is the run's collective and
failure board, as this rank's log recorded the others: it gives back another rank's stop request,
signal or failure at the phase, epoch and step where this rank met it, so the engine agrees as it did."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsmtrain.core.consensus import Failure, RankFailed, proposal_of
from fsmtrain.core.context import RunContext, StopRequest
from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.replay.recording import interrupt_of, split_source

__all__ = ["RecordedRanks", "recorded_ranks"]


@dataclass(frozen=True)
class _Contribution:
    where: tuple[str, int, int]  # where the ranks agreed (the log line's phase, epoch and global step)
    rank: int
    row: list[int]
    said: tuple[str, str] | None  # the winner's source and message


@dataclass(frozen=True)
class PeerFailure:
    """Where another rank's failure ended this rank's run, as its log recorded it."""

    failure: Failure
    symptom: str | None  # what broke here (a collective's error); None: seen at an agreement point
    where: tuple[str, int, int]  # the phase, epoch and global step


class RecordedRanks:
    """The other ranks of a recorded multi-process run, for the replay of one of them."""

    def __init__(self, rank: int, world_size: int, contributions: Sequence[_Contribution],
                 peer_failure: PeerFailure | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self._todo = list(contributions)
        self._said: dict[int, tuple[str, str]] = {}
        self.peer_failure = peer_failure
        self.run: RunContext | None = None  # set by the replay before it runs

    def post_failure(self, failure: Failure) -> Failure:
        return self.peer_failure.failure if self.peer_failure is not None else failure

    def posted_failure(self) -> Failure | None:
        return self.peer_failure.failure if self.peer_failure is not None else None

    def breaks_in(self, phase: Phase, epoch: int) -> bool:
        """Whether another rank's failure broke this rank's collective in that phase of that epoch."""
        f = self.peer_failure
        return f is not None and f.symptom is not None and f.where[:2] == (phase.value, epoch)

    def symptom_at(self, phase: Phase, epoch: int) -> str | None:
        """The collective's error this rank met here, when another rank's failure broke it here."""
        f, run = self.peer_failure, self.run
        if f is None or run is None or not self.breaks_in(phase, epoch) or run.global_step != f.where[2]:
            return None
        return f.symptom

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        assert self.run is not None
        rows = [[0] * len(values) for _ in range(self.world_size)]
        rows[self.rank] = list(values)
        here = (self.run.phase.value, self.run.epoch, self.run.global_step)
        f = self.peer_failure
        if f is not None and f.symptom is None and f.where == here:
            raise RankFailed(f.failure)  # seen on the board while this rank waited here
        for c in [c for c in self._todo if c.where == here]:
            self._todo.remove(c)
            rows[c.rank] = [max(a, b) for a, b in zip(rows[c.rank], c.row, strict=True)] if any(
                rows[c.rank]) else list(c.row)
            if c.said is not None:
                self._said[c.rank] = c.said
        return rows

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj if src == self.rank else self._said.get(src)


def recorded_ranks(run_start: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> RecordedRanks | None:
    """The other ranks of the run whose ``events`` these are; None for a one-process run."""
    world, rank = run_start.get("world_size"), run_start.get("rank")
    if not isinstance(world, int) or world < 2 or not isinstance(rank, int):
        return None
    out: list[_Contribution] = []
    for e in events:
        payload = e.get("payload") or {}
        where = (str(e.get("phase")), int(e.get("epoch") or 0), int(e.get("global_step") or 0))
        if e.get("event") == "stop_request" and isinstance(payload.get("rank"), int) and payload["rank"] != rank:
            source, _ = split_source(str(payload.get("source", "")))
            request = StopRequest(StopReason(payload["reason"]), source, str(payload.get("message", "")),
                                  bool(payload.get("immediate")), int(payload.get("requested_epoch", where[1])), 0,
                                  Phase(payload.get("requested_phase", where[0])))
            out.append(_Contribution(where, payload["rank"], proposal_of(request, None), (source, request.message)))
        elif (sig := interrupt_of(e)) is not None and isinstance(origin := sig[1], int) and origin != rank:
            out.append(_Contribution(where, origin, proposal_of(None, sig[0]), None))
    return RecordedRanks(rank, world, out, _peer_failure(events))


def _peer_failure(events: Sequence[Mapping[str, Any]]) -> PeerFailure | None:
    """The ``RankFailed`` of the log's last segment: the failing rank, its source and exception."""
    found = None
    for e in events:
        payload = e.get("payload") or {}
        if e.get("event") == "run_start":
            found = None
        elif e.get("event") == "exception" and isinstance(payload.get("failed_rank"), int):
            source, origin = split_source(str(payload.get("source", "")))
            said = str(payload.get("message", ""))
            prefix = f"rank {origin} failed in {source}: "
            symptom = payload.get("symptom")
            found = PeerFailure(Failure(payload["failed_rank"], source, said.removeprefix(prefix)),
                                symptom if isinstance(symptom, str) else None,
                                (str(e.get("phase")), int(e.get("epoch") or 0), int(e.get("global_step") or 0)))
    return found
