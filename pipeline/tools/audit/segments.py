"""Where a process's run begins in a log, mixed into the auditor: a later ``run_start`` must be a resume
from where a commit and the log allow (or a restart), and says how the process before it ended."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.events import LEVELS
from fsmtrain.core.lifecycle import INITIAL
from fsmtrain.tools.audit.checkpoints import CheckpointLines
from fsmtrain.tools.audit.ending import EndingChecks, Segment, Unfinished
from fsmtrain.tools.audit.verdict import Explanation, Verdict, shown_epoch

__all__ = ["SegmentChecks"]


class SegmentChecks(EndingChecks):
    """Needs the auditor's ``seg``, ``ex``, ``first_ts`` and ``ckpts``."""

    seg: Segment | None
    ex: Explanation
    first_ts: float | None
    ckpts: CheckpointLines

    def _open_segment(self, n: int, rec: Mapping[str, Any], payload: Mapping[str, Any]) -> Segment:
        max_epochs = payload.get("max_epochs")
        start_epoch = payload.get("start_epoch", 0)
        if type(max_epochs) is not int or type(start_epoch) is not int:
            self.bad("run_start", "run_start needs integer max_epochs and start_epoch in its payload", n)
            max_epochs = max_epochs if type(max_epochs) is int else 1 << 62
            start_epoch = start_epoch if type(start_epoch) is int else 0
        callbacks = payload.get("callbacks")
        listed = callbacks if isinstance(callbacks, list) else []
        resumed = payload.get("resumed_from")
        seg = Segment(n, str(rec.get("run_id")), max_epochs, start_epoch, None if resumed is None else str(resumed),
                      [str(c.get("name", "?")) for c in listed if isinstance(c, dict)])
        config = payload.get("config")
        if isinstance(config, dict):
            level = config.get("log_level")
            seg.min_level = LEVELS.get(level, 0) if isinstance(level, str) else 0
            epochs = config.get("epochs")
            if type(epochs) is int and epochs != max_epochs:
                self.bad("run_start", f"max_epochs={max_epochs}, but the recorded config says epochs={epochs}", n)
        rank, world, launch = payload.get("rank"), payload.get("world_size", 1), payload.get("launch")
        seg.rank = rank if type(rank) is int else 0
        seg.world = world if type(world) is int else None
        seg.launch = launch if isinstance(launch, str) else None
        seg.sharded = isinstance(payload.get("sharding"), dict)
        seg.next_epoch = start_epoch
        seg.max_steps = payload["max_steps"] if type(payload.get("max_steps")) is int else None
        seg.val_every = payload["val_every_n_steps"] if type(payload.get("val_every_n_steps")) is int else None
        seg.last_line = n
        seg.global_step = rec["global_step"] if type(rec.get("global_step")) is int else 0
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
            if seg.resumed_from is not None and _rank_left_out(seg, payload):
                seg.unlogged.update(range(seg.start_epoch))  # this rank joined the run at a resume on more ranks
            return
        if seg.resumed_from is None:  # a restart, if its restart event follows; else two runs in one file
            self.ckpts.second_start(n, seg)
            if prev.end_line is None:
                seg.after = Unfinished(n, prev.last_line, prev.phase, prev.next_epoch, None)
            return
        ckpt = self.ckpts.named(seg.resumed_from)
        if ckpt is not None:
            seg.resumed_write = (ckpt.line, ckpt.sha256, ckpt.epoch)
        unlogged = None
        if (ckpt is not None and ckpt.epoch == prev.next_epoch and seg.start_epoch == ckpt.epoch + 1
                and prev.end_line is None and ckpt.line > prev.first_line):
            # Killed between committing the epoch's checkpoint and logging the epoch: done, unlogged.
            seg.unlogged.add(ckpt.epoch)
            unlogged = (ckpt.epoch, f"its checkpoint (line {ckpt.line})")
        elif (ckpt is None and seg.rank != 0 and not self.ckpts.writes and prev.end_line is None
              and seg.start_epoch == prev.next_epoch + 1):
            # The same on a rank without checkpoint lines: its resume event must name that commit.
            seg.commit_unseen = prev.next_epoch
        elif seg.start_epoch > prev.next_epoch and _rank_left_out(seg, payload):
            # The run went on with fewer ranks, without this one: those epochs are in rank 0's log.
            seg.unlogged.update(range(prev.next_epoch, seg.start_epoch))
        elif seg.start_epoch > prev.next_epoch:
            self.bad("resume", _skipped(seg.start_epoch, prev.next_epoch), n)
        if ckpt is not None and ckpt.epoch is not None and seg.start_epoch != ckpt.epoch + (ckpt.step is None):
            self.bad("resume", f"resume from {seg.resumed_from} (epoch {epoch_number(ckpt.epoch)}, line {ckpt.line}) "
                     f"must start at epoch {epoch_number(ckpt.epoch + (ckpt.step is None))}, starts at "
                     f"{epoch_number(seg.start_epoch)}", n)
        if prev.end_line is None:  # said once the resume event tells whether it cut off a torn line
            seg.after = Unfinished(n, prev.last_line, prev.phase, prev.next_epoch, unlogged)

    def _resume(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        payload = rec["payload"]
        if rec["event"] == "resume":
            seg.resumed = tuple(payload.get(k) for k in ("checkpoint", "sha256", "checkpoint_epoch", "next_epoch"))
            seg.resumed_batch = payload["batch"] if type(payload.get("batch")) is int else 0
            for key in ("validations", "validated_at"):
                if type(payload.get(key)) is int:
                    setattr(seg, key, payload[key])
        self._resumed_commit(n, payload, seg)
        torn = payload.get("torn_line_bytes")
        self.report_previous_end(seg, (torn, n) if type(torn) is int else None)

    def _resumed_commit(self, n: int, p: Mapping[str, Any], seg: Segment) -> None:
        """The checkpoint the ``resume`` event says it loaded is the commit its ``run_start`` named."""
        name, sha, epoch = p.get("checkpoint"), p.get("sha256"), p.get("checkpoint_epoch")
        if seg.resumed_write is not None:
            line, want_sha, want_epoch = seg.resumed_write
            if sha != want_sha or epoch != want_epoch:
                self.bad("resume", f"the resume loaded {name} with sha256 {str(sha)[:12]}... (epoch "
                         f"{shown_epoch(epoch)}), but line {line} committed {want_sha[:12]}... (epoch "
                         f"{shown_epoch(want_epoch)})", n)
        awaited, seg.commit_unseen = seg.commit_unseen, None
        if awaited is None or seg.after is None:
            return
        if (name == seg.resumed_from and isinstance(sha, str) and epoch == awaited
                and p.get("next_epoch") == seg.start_epoch):
            seg.unlogged.add(awaited)
            where = (f"rank 0's checkpoint {name} (sha256 {sha[:12]}..., as this rank's resume event at line {n} "
                     "records; the audit of the run directory checks it against rank 0's log)")
            seg.after = replace(seg.after, unlogged=(awaited, where))
        else:
            self.bad("resume", f"{_skipped(seg.start_epoch, awaited)}, and the resume event (line {n}) names "
                     f"checkpoint {name!r} of epoch {shown_epoch(epoch)}, not {seg.resumed_from!r} of epoch "
                     f"{epoch_number(awaited)}", n)

    def _restart(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        self.ckpts.restart(n, seg)
        self._resume(n, rec, seg)

    def report_previous_end(self, seg: Segment, torn: tuple[int, int] | None) -> None:
        """Say how the process before ``seg`` ended, once known: ``torn`` is (bytes of a torn last line
        the resume cut off, the line of its ``resume`` event); None when no resume event says."""
        u, seg.after = seg.after, None
        if u is None:
            return
        if seg.commit_unseen is not None:  # no resume event says which commit this rank went on from
            self.bad("resume", f"{_skipped(seg.start_epoch, seg.commit_unseen)}, and no resume event names the "
                     "checkpoint it continued from", u.resume_line)
            seg.commit_unseen = None
        again = "resume" if seg.resumed_from is not None else "restart"
        where = f"phase {u.phase!r}, epoch {epoch_number(u.next_epoch)}"
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
            epoch, commit = u.unlogged
            self.warn("resume", f"epoch {epoch_number(epoch)} was committed by {commit}, but the process {ended}: its "
                      "figures are not in the log", u.resume_line)



def _rank_left_out(seg: Segment, payload: Mapping[str, Any]) -> bool:
    """This rank's log resumes a run that ran on fewer ranks than its rank needs in between."""
    return type(before := payload.get("world_size_before")) is int and seg.rank >= before


def _skipped(start: int, reached: int) -> str:
    return f"resume starts at epoch {epoch_number(start)}, but the log never logged epoch {epoch_number(reached)}"
