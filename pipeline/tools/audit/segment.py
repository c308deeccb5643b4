"""One process's part of a run log, as the audit keeps it while it reads (:class:`Segment`): where the run is,
what it said about how it stops and checkpoints, and the moves it made (:class:`Moves`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fsmtrain.core.lifecycle import INITIAL

__all__ = ["Move", "Moves", "Segment", "SegmentCheckpoints", "StopInfo", "Unfinished"]


@dataclass
class StopInfo:
    reason: str
    source: str
    message: str
    immediate: bool
    epoch: int | None
    line: int
    rank: int | None = None  # the rank a stop agreed from another rank came from
    phase: str | None = None  # where the request was made


@dataclass(frozen=True)
class Unfinished:
    """A process that ended without its ``result``, as the resume after it found the log."""

    resume_line: int  # the resume's run_start
    last_line: int  # the process's last whole line
    phase: str
    next_epoch: int
    unlogged: tuple[int, str] | None  # (epoch, the commit that holds it): committed, never logged


Move = tuple[str, str, str, int]  # trigger, from, to, epoch


class Moves:
    """A segment's phase-level moves in order, each a :data:`Move`. Whole epochs taken together are kept as one
    entry (each epoch's moves, the first epoch and how many), made into moves when read: a long run's millions of
    moves are not kept one by one."""

    __slots__ = ("_len", "_parts")

    def __init__(self) -> None:
        self._parts: list[list[Move] | tuple[tuple[tuple[str, str, str], ...], int, int]] = []
        self._len = 0

    def append(self, move: Move) -> None:
        last = self._parts[-1] if self._parts else None
        if type(last) is list:
            last.append(move)
        else:
            self._parts.append([move])
        self._len += 1

    def add_epochs(self, moves: tuple[tuple[str, str, str], ...], first: int, count: int) -> None:
        """``moves`` (each a trigger, from and to) made in each of ``count`` epochs from ``first`` on."""
        self._parts.append((moves, first, count))
        self._len += len(moves) * count

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Move]:
        for part in self._parts:
            if isinstance(part, list):
                yield from part
            else:
                moves, first, count = part
                yield from ((trig, src, dst, e) for e in range(first, first + count) for trig, src, dst in moves)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Moves) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # (mutable)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class SegmentCheckpoints:
    """A segment's logged checkpoint policy, and its word for each epoch the policy saves."""

    every: int | None = None  # save_every_n_epochs, when the policy was logged
    latest: bool = False  # save_latest: every epoch
    committed: set[int] = field(default_factory=set)
    skipped: dict[int, int] = field(default_factory=dict)  # epoch -> line of its checkpoint_skipped
    start_line: int | None = None  # a run_start that is neither the first nor a resume: awaits its restart
    restarted: bool = False

    def expects(self, epoch: int) -> bool:
        return self.every is not None and (self.latest or (epoch + 1) % self.every == 0)


@dataclass
class Segment:
    """One process's part of the log; a resume appends another."""

    first_line: int
    run_id: str
    max_epochs: int
    start_epoch: int
    resumed_from: str | None
    callbacks: list[str]
    min_level: int = 0  # the config's log_level, when recorded
    rank: int = 0
    phase: str = INITIAL.value
    next_epoch: int = 0
    epochs: int = 0
    epoch_starts: int = 0
    stop: StopInfo | None = None
    faulted: bool = False
    exception: dict[str, Any] | None = None
    exception_line: int | None = None
    end_line: int | None = None
    end_reason: str | None = None
    end_said: tuple[Any, Any] = (None, None)  # train_end's (source, message)
    end_global_step: Any = None
    max_steps: int | None = None
    val_every: int | None = None  # val_every_n_steps: validations inside epochs
    validations: int = 0  # the validation lines so far
    validated_at: int = -1  # the global step of the last validation
    val_open: bool = False  # in a validation whose line is not logged yet
    resumed_batch: int = 0  # a resume inside its first epoch: the batches of it done before
    result_line: int | None = None  # its result (None: none yet)
    last_line: int = 0
    last_epoch_field: Any = None
    global_step: int = 0
    nonfinite: dict[int, tuple[int, str]] = field(default_factory=dict)  # epoch -> (line, loss key)
    vals: list[tuple[float, int]] = field(default_factory=list)  # per logged epoch: (val_loss or nan, line)
    last_trial_report: tuple[bool, int] | None = None
    unlogged: set[int] = field(default_factory=set)  # epochs a resume's checkpoint holds but the log lacks
    after: Unfinished | None = None  # the process before this resume, until the resume says how it ended
    resumed_write: tuple[int, str, int | None] | None = None  # the commit resumed from: (line, sha256, epoch)
    # A rank without checkpoint lines resumed one epoch past its log: the epoch its resume must name.
    commit_unseen: int | None = None
    # global_step where the epoch began and entered val, and the per-batch lines
    step_begin: int | None = None
    step_val: int | None = None
    step_prev: int = 0
    batch_lines: int = 0
    # what the audit of a run directory compares across ranks
    world: int | None = 1  # run_start's world_size (None: not an integer)
    launch: str | None = None  # the launch this segment belongs to, the same on every rank
    sharded: bool = False  # run_start records a sharding (strategy fsdp on several ranks)
    moves: Moves = field(default_factory=Moves)  # phase-level
    failed_rank: int | None = None  # the rank whose failure ended this one (its exception names it)
    resumed: tuple[Any, ...] | None = None  # its resume event's checkpoint, sha256, checkpoint_epoch, next_epoch
    ckpts: SegmentCheckpoints = field(default_factory=SegmentCheckpoints)
