"""Which epochs a run checkpointed, and the log's word for each one it did not, per segment:

- with the policy logged (``checkpoint_settings``), every epoch it saves has a ``checkpoint`` or a
  ``checkpoint_skipped`` (a slow disk): all of them once the segment wrote its ``result``, else up to
  the last committed epoch (states are written in order);
- a skipped epoch is one the segment reached, never committed after;
- a ``restart`` (a second ``run_start`` without ``resumed_from``) starts at epoch 0 with no committed
  checkpoint left (else it should have resumed); ``checkpoint_damaged`` names committed files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.ending import Segment
from fsmtrain.tools.audit.verdict import Explanation, Finding

__all__ = ["CheckpointCoverage", "Damaged"]

CHECKPOINT_SOURCE = "CheckpointCallback"


@dataclass(frozen=True)
class Damaged:
    """A committed file a resume found damaged and moved aside."""

    line: int
    moved_to: str | None
    found_sha256: str | None


@dataclass
class _SegmentCheckpoints:
    """One segment's checkpoint lines."""

    every: int | None = None  # save_every_n_epochs, when the policy was logged
    latest: bool = False  # save_latest: every epoch
    committed: set[int] = field(default_factory=set)
    skipped: dict[int, int] = field(default_factory=dict)  # epoch -> line of its checkpoint_skipped
    start_line: int | None = None  # a run_start that is neither the first nor a resume: awaits its restart
    restarted: bool = False

    def expects(self, epoch: int) -> bool:
        return self.every is not None and (self.latest or (epoch + 1) % self.every == 0)


class CheckpointCoverage:
    """Fed the checkpoint lines of a log (see the module docstring); :meth:`finish` gives the findings."""

    def __init__(self, ex: Explanation) -> None:
        self.ex = ex
        self.by_segment: dict[int, _SegmentCheckpoints] = {}  # by the segment's first line
        self.findings: list[Finding] = []

    def _of(self, seg: Segment) -> _SegmentCheckpoints:
        return self.by_segment.setdefault(seg.first_line, _SegmentCheckpoints())

    def _bad(self, message: str, line: int | None, check: str = "checkpoint") -> None:
        self.findings.append(Finding(check, message, line))

    # --- lines -----------------------------------------------------------------------------------
    def second_start(self, n: int, seg: Segment) -> None:
        """A run_start after the first, without ``resumed_from``: a restart, if its ``restart`` comes."""
        self._of(seg).start_line = n

    def settings(self, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        settings = p.get("settings")
        if p.get("source") != CHECKPOINT_SOURCE or not isinstance(settings, dict):
            return
        every = settings.get("save_every_n_epochs")
        if type(every) is int and every >= 1:
            ckpts = self._of(seg)
            ckpts.every, ckpts.latest = every, settings.get("save_latest") is True

    def committed(self, n: int, epoch: int | None, path: str, seg: Segment) -> None:
        if epoch is None:
            return
        ckpts = self._of(seg)
        ckpts.committed.add(epoch)
        if epoch in ckpts.skipped:
            self._bad(f"checkpoint {path} commits epoch {epoch_number(epoch)}, whose state line {ckpts.skipped[epoch]} "
                      "says was skipped (never written)", n)

    def skipped(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        epoch, reason = p.get("epoch"), p.get("reason")
        if type(epoch) is not int or not isinstance(reason, str) or not reason:
            self._bad("checkpoint_skipped needs the epoch left out (an integer) and the reason (a text)", n)
            return
        if not seg.start_epoch <= epoch <= seg.next_epoch:
            self._bad(f"checkpoint_skipped names epoch {epoch_number(epoch)}, which this process (epochs "
                      f"{epoch_number(seg.start_epoch)} to {epoch_number(seg.next_epoch)}) did not train", n)
        self._of(seg).skipped[epoch] = n
        self.ex.checkpoints_skipped += 1

    def damaged(self, n: int, rec: Mapping[str, Any], writes: Iterable[str], out: dict[str, Damaged]) -> None:
        p = rec["payload"]
        paths, moved = p.get("paths"), p.get("moved_to")
        if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths) or not paths:
            self._bad("checkpoint_damaged needs the damaged files' paths (a list of texts)", n)
            return
        known = set(writes)
        moved_to = moved if isinstance(moved, list) and len(moved) == len(paths) else [None] * len(paths)
        found = p.get("found_sha256")
        digests = found if isinstance(found, list) and len(found) == len(paths) else [None] * len(paths)
        for path, target, digest in zip(paths, moved_to, digests, strict=True):
            if path not in known:
                self._bad(f"checkpoint_damaged names {path}, which the log never committed", n)
                continue
            out[path] = Damaged(n, target if isinstance(target, str) else None,
                                digest if isinstance(digest, str) else None)
        self.ex.checkpoints_damaged += 1

    def restart(self, n: int, rec: Mapping[str, Any], seg: Segment, live: Iterable[str]) -> None:
        ckpts = self._of(seg)
        if ckpts.start_line is None and seg.first_line != 1:
            self._bad("a restart event in a segment that is not a restart (its run_start resumes or is the first)", n,
                      "resume")
        ckpts.restarted = True
        self.ex.restarts += 1
        if seg.start_epoch != 0:
            self._bad(f"a restart starts the run over at epoch 1; this one starts at epoch "
                      f"{epoch_number(seg.start_epoch)}", n, "resume")
        left = sorted(live)
        if left:
            self._bad(f"a restart, but the log still commits {', '.join(left[:3])}: the run had a checkpoint to "
                      "resume from", n, "resume")

    # --- the end ---------------------------------------------------------------------------------
    def finish(self, segments: list[Segment]) -> list[Finding]:
        for seg in segments:
            ckpts = self.by_segment.get(seg.first_line)
            if ckpts is None:
                continue
            if ckpts.start_line is not None and not ckpts.restarted:
                self._bad("a second run_start without resumed_from and no restart event: two runs written into one "
                          "file", ckpts.start_line, "resume")
            self._gaps(seg, ckpts)
        return self.findings

    def _gaps(self, seg: Segment, ckpts: _SegmentCheckpoints) -> None:
        ended = seg.result_seen and seg.end_reason != StopReason.ERROR.value
        horizon = max(ckpts.committed, default=-1)
        lines = dict(zip(sorted(seg.epochs_seen), (line for _, line in seg.vals), strict=False))
        for epoch in sorted(seg.epochs_seen):
            if not ckpts.expects(epoch) or (not ended and epoch > horizon):
                continue
            if epoch not in ckpts.committed and epoch not in ckpts.skipped:
                self._bad(f"epoch {epoch_number(epoch)} has no checkpoint, and no checkpoint_skipped says why (the "
                          "checkpoint policy this process logged saves that epoch)", lines.get(epoch), "coverage")
