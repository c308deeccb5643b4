"""Where a process's run begins in a log: ``run_start`` opens a segment (its epochs, config,
callbacks), and a later one must be a resume that starts where a committed checkpoint and the log
allow. A resume after a process that never reached its ``result`` says how that process ended once
its ``resume`` event is read: killed between two lines, or in the middle of one, whose torn bytes
the resume cut off (``torn_line_bytes``). Mixed into the auditor."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.core.events import LEVELS
from pipeline.core.lifecycle import (
    INITIAL,
)
from pipeline.tools.audit.coverage import CheckpointAccount, Damaged
from pipeline.tools.audit.ending import EndingChecks, Segment, Unfinished
from pipeline.tools.audit.files import CheckpointWrite
from pipeline.tools.audit.verdict import Explanation, Verdict

__all__ = ["SegmentChecks"]


class SegmentChecks(EndingChecks):
    """Needs the auditor's ``seg``, ``ex``, ``first_ts``, checkpoint maps and ``account``."""

    seg: Segment | None
    ex: Explanation
    first_ts: float | None
    ckpt_writes: dict[str, CheckpointWrite]
    ckpt_removed: dict[str, int]
    ckpt_damaged: dict[str, Damaged]
    account: CheckpointAccount

    def _open_segment(self, n: int, rec: Mapping[str, Any], payload: Mapping[str, Any]) -> Segment:
        max_epochs = payload.get("max_epochs")
        start_epoch = payload.get("start_epoch", 0)
        if type(max_epochs) is not int or type(start_epoch) is not int:
            self.bad("run_start", "run_start needs integer max_epochs and start_epoch in its payload", n)
            max_epochs = max_epochs if type(max_epochs) is int else 1 << 62
            start_epoch = start_epoch if type(start_epoch) is int else 0
        callbacks = payload.get("callbacks")
        listed = callbacks if isinstance(callbacks, list) else []
        names = [str(c.get("name", "?")) for c in listed if isinstance(c, dict)]
        resumed = payload.get("resumed_from")
        seg = Segment(n, str(rec.get("run_id")), max_epochs, start_epoch,
                      None if resumed is None else str(resumed), names)
        config = payload.get("config")
        if isinstance(config, dict):
            level = config.get("log_level")
            seg.min_level = LEVELS.get(level, 0) if isinstance(level, str) else 0
            epochs = config.get("epochs")
            if type(epochs) is int and epochs != max_epochs:
                self.bad("run_start", f"max_epochs={max_epochs}, but the recorded config says epochs={epochs}", n)
        rank = payload.get("rank")
        seg.rank = rank if type(rank) is int else 0
        seg.next_epoch = start_epoch
        seg.last_line = n
        step = rec.get("global_step")
        seg.global_step = step if type(step) is int else 0
        self.segments.append(seg)
        self.seg = seg
        if self.ex.run_id is None:
            self.ex.run_id = seg.run_id
            rank, world = payload.get("rank"), payload.get("world_size")
            if type(rank) is int and type(world) is int:  # one rank of a multi-process run
                self.ex.rank, self.ex.world_size = rank, world
        return seg

    def _run_start(self, n: int, rec: Mapping[str, Any]) -> None:
        payload = rec["payload"]
        if self.first_ts is None and isinstance(rec["ts"], (int, float)):
            self.first_ts = float(rec["ts"])
        if rec["phase"] not in (None, INITIAL.value):
            self.bad("start", f"run_start in phase {rec['phase']!r}; a run starts in {INITIAL.value!r}", n)
        prev = self.seg
        seg = self._open_segment(n, rec, payload)
        if prev is None:
            if seg.resumed_from is not None and self._sat_out(seg, payload.get("world_size_before")):
                seg.unlogged.update(range(seg.start_epoch))  # this rank joined the run at a resume on more ranks
            return
        if seg.resumed_from is None:  # a restart, if its restart event follows; else two runs in one file
            self.account.second_start(n, seg)
            if prev.end_line is None:
                seg.after = Unfinished(n, prev.last_line, prev.phase, prev.next_epoch, None)
            return
        ckpt = self._checkpoint_named(seg.resumed_from)
        unlogged = None
        if (ckpt is not None and ckpt.epoch == prev.next_epoch and seg.start_epoch == ckpt.epoch + 1
                and prev.end_line is None and ckpt.line > prev.first_line):
            # Killed between committing the epoch's checkpoint and logging its epoch event: the
            # epoch is done (the checkpoint holds it), but the log never got its figures.
            seg.unlogged.add(ckpt.epoch)
            unlogged = (ckpt.epoch, ckpt.line)
        elif seg.start_epoch > prev.next_epoch and self._sat_out(seg, payload.get("world_size_before")):
            # The run went on with fewer ranks, and this rank was not one of them: its epochs are in
            # rank 0's log (the audit of the run directory checks that every rank of each segment ran).
            seg.unlogged.update(range(prev.next_epoch, seg.start_epoch))
        elif seg.start_epoch > prev.next_epoch:
            self.bad("resume", f"resume starts at epoch {seg.start_epoch}, but the log only reached epoch "
                     f"{prev.next_epoch}", n)
        if ckpt is not None and ckpt.epoch is not None and seg.start_epoch != ckpt.epoch + 1:
            self.bad("resume", f"resume from {seg.resumed_from} (epoch {ckpt.epoch}, line {ckpt.line}) must start at "
                     f"epoch {ckpt.epoch + 1}, starts at {seg.start_epoch}", n)
        if prev.end_line is None:  # said once the resume event tells whether it cut off a torn line
            seg.after = Unfinished(n, prev.last_line, prev.phase, prev.next_epoch, unlogged)

    def _resume(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        torn = rec["payload"].get("torn_line_bytes")
        self.said_unfinished(seg, (torn, n) if type(torn) is int else None)

    def _restart(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """A run that had committed nothing started over in place (from epoch 0)."""
        standing = [p for p in self.ckpt_writes if p not in self.ckpt_removed and p not in self.ckpt_damaged]
        self.account.restart(n, rec, seg, standing)
        self._resume(n, rec, seg)

    def said_unfinished(self, seg: Segment, torn: tuple[int, int] | None) -> None:
        """How the process before ``seg`` ended, once known: ``torn`` is (bytes of a torn last line
        the resume cut off, the line of its ``resume`` event); None when no resume event says."""
        u, seg.after = seg.after, None
        if u is None:
            return
        again = "resume" if seg.resumed_from is not None else "restart"
        where = f"phase {u.phase!r}, epoch {u.next_epoch}"
        if torn is not None and torn[0] > 0:
            self.warn("resume", f"the run before this {again} ended in the middle of writing a line (a kill, or a full "
                      f"disk), and the resume repaired the log: it cut off its torn line ({torn[0]} bytes), as line "
                      f"{torn[1]} records; the log goes on from line {u.last_line}, the last whole line ({where})",
                      u.resume_line, Verdict.TORN_LINE_REPAIRED)
            ended = "ended while it was writing the log (the torn line the resume cut off)"
        else:
            how = "killed" if torn is None else (f"killed between two lines (the resume at line {torn[1]} found no "
                                                 "torn line)")
            self.warn("resume", f"the run before this {again} never reached train_end (last line {u.last_line}, "
                      f"{where}): the process was {how}", u.resume_line, Verdict.KILLED)
            ended = "was killed before it logged the epoch"
        if u.unlogged is not None:
            epoch, line = u.unlogged
            self.warn("resume", f"epoch {epoch} was committed by its checkpoint (line {line}), but the process "
                      f"{ended}: its figures are not in the log", u.resume_line)

    @staticmethod
    def _sat_out(seg: Segment, before: object) -> bool:
        """This rank's log resumes a run that ran on fewer ranks than its rank needs in between."""
        return type(before) is int and seg.rank >= before

    def _checkpoint_named(self, resumed_from: str | None) -> CheckpointWrite | None:
        if resumed_from is None:
            return None
        for path, info in self.ckpt_writes.items():
            if resumed_from == path or (Path(resumed_from).name == Path(path).name and
                                        Path(resumed_from).parent.name == Path(path).parent.name):
                return info
        return None
