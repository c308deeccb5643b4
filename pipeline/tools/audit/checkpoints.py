"""The checkpoint and resume lines of a log, mixed into the auditor: each path's latest commit, removal or
quarantine; a ``checkpoint`` or ``checkpoint_skipped`` for every epoch the logged policy saves; and each later
``run_start`` a resume from where a commit and the log allow (or a restart), saying how the process before ended."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.events import LEVELS
from fsmtrain.core.lifecycle import INITIAL
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.ending import EndingChecks, as_int
from fsmtrain.tools.audit.segment import Segment, Unfinished
from fsmtrain.tools.audit.verdict import Explanation, Verdict, shown_epoch

__all__ = ["CheckpointChecks", "CheckpointLines", "CheckpointWrite", "Damaged", "SegmentChecks"]

CHECKPOINT_SOURCE = "CheckpointCallback"


@dataclass(frozen=True)
class CheckpointWrite:
    """The log's latest ``checkpoint`` event for one path."""

    sha256: str
    line: int
    epoch: int | None
    chain_head: str | None
    step: int | None = None  # a checkpoint at a step: its epoch goes on after it
    shards: Mapping[str, Any] | None = None  # a sharded checkpoint's folder: each file's sha256


@dataclass(frozen=True)
class Damaged:
    """A committed file a resume found damaged and moved aside."""

    line: int
    moved_to: str | None
    found_sha256: str | None


@dataclass
class CheckpointLines:
    """Each path's latest commit, removal or quarantine, as the log's checkpoint lines say them."""

    writes: dict[str, CheckpointWrite] = field(default_factory=dict)  # path -> its latest write
    removed: dict[str, int] = field(default_factory=dict)  # path -> line of a later removal
    damaged: dict[str, Damaged] = field(default_factory=dict)  # path -> the resume that moved it to damaged/
    first_commit: dict[str, tuple[int, str, int | None]] = field(default_factory=dict)  # sha256 -> (line, path, epoch)

    def live(self) -> list[str]:
        """The paths whose latest commit still stands."""
        return [p for p in self.writes if p not in self.removed and p not in self.damaged]

    def named(self, resumed_from: str | None) -> CheckpointWrite | None:
        """The commit a resume's ``resumed_from`` names (by path, or by file and folder name)."""
        if resumed_from is None:
            return None
        want = Path(resumed_from)
        return next((info for path, info in self.writes.items() if path == resumed_from
                     or (Path(path).name, Path(path).parent.name) == (want.name, want.parent.name)), None)


class CheckpointChecks(EndingChecks):
    """The checkpoint lines, mixed into the auditor; needs its ``ex``, ``chain`` and ``ckpts``."""

    ex: Explanation
    chain: ChainCheck
    ckpts: CheckpointLines

    def _on_checkpoint_settings(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        settings = p.get("settings")
        if p.get("source") != CHECKPOINT_SOURCE or not isinstance(settings, dict):
            return
        every = settings.get("save_every_n_epochs")
        if type(every) is int and every >= 1:
            seg.ckpts.every, seg.ckpts.latest = every, settings.get("save_latest") is True

    def _on_checkpoint(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p, ck = rec["payload"], self.ckpts
        path, sha = p.get("path"), p.get("sha256")
        if not isinstance(path, str) or not isinstance(sha, str):
            self.bad("checkpoint", "a checkpoint event needs string path and sha256", n)
            return
        head = p.get("chain_head")
        if head is not None and not isinstance(head, str):
            self.bad("checkpoint", f"chain_head must be a digest string, found {head!r}", n)
            head = None
        if head is not None and self.chain.active is not None and not self.chain.unchained:
            pinned = self.chain.pinned_line(head)
            if pinned is None:
                self.bad("checkpoint", f"checkpoint {path} pins chain head {head[:12]}..., which is the digest of no "
                         "line logged since the previous epoch began (nor of an epoch's end since the last commit): "
                         "the lines before it were altered after the checkpoint was committed", n)
            else:
                self.chain.pinned(pinned)
        epoch = as_int(p.get("epoch"))
        ck.writes[path] = CheckpointWrite(sha, n, epoch, head, as_int(p.get("step")),
                                          p["shards"] if isinstance(p.get("shards"), Mapping) else None)
        ck.first_commit.setdefault(sha, (n, path, epoch))
        ck.removed.pop(path, None)
        ck.damaged.pop(path, None)
        if epoch is None or "step" in p:  # a checkpoint at a step: the epoch's own state is still due
            return
        seg.ckpts.committed.add(epoch)
        if epoch in seg.ckpts.skipped:
            self.bad("checkpoint", f"checkpoint {path} commits epoch {epoch_number(epoch)}, whose state line "
                     f"{seg.ckpts.skipped[epoch]} says was skipped (never written)", n)

    def _on_checkpoint_removed(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        path = rec["payload"].get("path")
        if isinstance(path, str):
            self.ckpts.removed[path] = n

    def _on_checkpoint_skipped(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        epoch, reason = p.get("epoch"), p.get("reason")
        if type(epoch) is not int or not isinstance(reason, str) or not reason:
            self.bad("checkpoint", "checkpoint_skipped needs the epoch left out (an integer) and the reason (a text)",
                     n)
            return
        if not seg.start_epoch <= epoch <= seg.next_epoch:
            self.bad("checkpoint", f"checkpoint_skipped names epoch {epoch_number(epoch)}, which this process (epochs "
                     f"{epoch_number(seg.start_epoch)} to {epoch_number(seg.next_epoch)}) did not train", n)
        if "step" not in p:
            seg.ckpts.skipped[epoch] = n
        self.ex.checkpoints_skipped += 1

    def _on_checkpoint_damaged(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """``checkpoint_damaged``: committed files a resume moved to ``damaged/``."""
        p = rec["payload"]
        paths = p.get("paths")
        if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths) or not paths:
            self.bad("checkpoint", "checkpoint_damaged needs the damaged files' paths (a list of texts)", n)
            return
        per_path = [v if isinstance(v, list) and len(v) == len(paths) else [None] * len(paths)
                    for v in (p.get("moved_to"), p.get("found_sha256"))]
        for path, target, digest in zip(paths, *per_path, strict=True):
            if path not in self.ckpts.writes:
                self.bad("checkpoint", f"checkpoint_damaged names {path}, which the log never committed", n)
                continue
            self.ckpts.damaged[path] = Damaged(n, target if isinstance(target, str) else None,
                                               digest if isinstance(digest, str) else None)
        self.ex.checkpoints_damaged += 1

    def _coverage(self) -> None:
        """Each segment's ``checkpoint`` or ``checkpoint_skipped`` for every epoch its logged policy saves."""
        for seg in self.segments:
            ckpts = seg.ckpts
            if ckpts.start_line is not None and not ckpts.restarted:
                self.bad("resume", "a second run_start without resumed_from and no restart event: two runs written "
                         "into one file", ckpts.start_line)
            if ckpts.every is None:
                continue  # no policy logged: none is due
            ended = seg.result_line is not None and seg.end_reason != StopReason.ERROR.value
            horizon = max(ckpts.committed, default=-1)
            for epoch, (_, line) in enumerate(seg.vals, seg.start_epoch):
                due = ckpts.expects(epoch) and (ended or epoch <= horizon)
                if due and epoch not in ckpts.committed and epoch not in ckpts.skipped:
                    self.bad("coverage", f"epoch {epoch_number(epoch)} has no checkpoint, and no checkpoint_skipped "
                             "says why (the checkpoint policy this process logged saves that epoch)", line)


class SegmentChecks(CheckpointChecks):
    """Needs the auditor's ``seg`` and ``first_ts`` too."""

    seg: Segment | None
    first_ts: float | None

    def _open_segment(self, n: int, rec: Mapping[str, Any], payload: Mapping[str, Any]) -> Segment:
        max_epochs, start_epoch = as_int(payload.get("max_epochs")), as_int(payload.get("start_epoch", 0))
        if max_epochs is None or start_epoch is None:
            self.bad("run_start", "run_start needs integer max_epochs and start_epoch in its payload", n)
            max_epochs, start_epoch = 1 << 62 if max_epochs is None else max_epochs, start_epoch or 0
        callbacks = payload.get("callbacks")
        listed = callbacks if isinstance(callbacks, list) else []
        resumed = payload.get("resumed_from")
        launch, rank, world = payload.get("launch"), as_int(payload.get("rank")), as_int(payload.get("world_size", 1))
        seg = Segment(n, str(rec.get("run_id")), max_epochs, start_epoch, None if resumed is None else str(resumed),
                      [str(c.get("name", "?")) for c in listed if isinstance(c, dict)], rank=rank or 0, world=world,
                      launch=launch if isinstance(launch, str) else None, next_epoch=start_epoch,
                      sharded=isinstance(payload.get("sharding"), dict), max_steps=as_int(payload.get("max_steps")),
                      val_every=as_int(payload.get("val_every_n_steps")), last_line=n,
                      global_step=as_int(rec.get("global_step")) or 0)
        config = payload.get("config")
        if isinstance(config, dict):
            level = config.get("log_level")
            seg.min_level = LEVELS.get(level, 0) if isinstance(level, str) else 0
            epochs = config.get("epochs")
            if type(epochs) is int and epochs != max_epochs:
                self.bad("run_start", f"max_epochs={max_epochs}, but the recorded config says epochs={epochs}", n)
        self.segments.append(seg)
        self.seg = seg
        if self.ex.run_id is None:
            self.ex.run_id = seg.run_id
            if rank is not None and "world_size" in payload and world is not None:  # one rank of several
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
            seg.ckpts.start_line = n
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

    def _on_resume(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        payload = rec["payload"]
        if rec["event"] == "resume":
            seg.resumed = tuple(payload.get(k) for k in ("checkpoint", "sha256", "checkpoint_epoch", "next_epoch"))
            seg.resumed_batch = as_int(payload.get("batch")) or 0
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

    def _on_restart(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        self._on_resume(n, rec, seg)
        if seg.ckpts.start_line is None and seg.first_line != 1:
            self.bad("resume", "a restart event in a segment that is not a restart (its run_start resumes or is the "
                     "first)", n)
        seg.ckpts.restarted = True
        self.ex.restarts += 1
        if seg.start_epoch != 0:
            self.bad("resume", f"a restart starts the run over at epoch 1; this one starts at epoch "
                     f"{epoch_number(seg.start_epoch)}", n)
        left = sorted(self.ckpts.live())
        if left:
            self.bad("resume", f"a restart, but the log still commits {', '.join(left[:3])}: the run had a checkpoint "
                     "to resume from", n)

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
