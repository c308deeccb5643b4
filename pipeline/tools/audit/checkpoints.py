"""The checkpoint lines of a log: each path's latest commit (or its removal or quarantine), and per
segment a ``checkpoint`` or ``checkpoint_skipped`` for every epoch its logged policy saves (all its
epochs once it wrote its ``result``, else up to its last commit: states are written in order)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.ending import Segment
from fsmtrain.tools.audit.verdict import Explanation, Finding

__all__ = ["CheckpointLines", "CheckpointWrite", "Damaged"]

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


class CheckpointLines:
    """Fed the checkpoint lines of a log; :meth:`finish` gives the findings."""

    def __init__(self, ex: Explanation, chain: ChainCheck) -> None:
        self.ex = ex
        self.chain = chain
        self.writes: dict[str, CheckpointWrite] = {}  # path -> its latest write
        self.removed: dict[str, int] = {}  # path -> line of a later removal
        self.damaged: dict[str, Damaged] = {}  # path -> the resume that moved it to damaged/
        self.first_commit: dict[str, tuple[int, str, int | None]] = {}  # sha256 -> (line, path, epoch)
        self.findings: list[Finding] = []

    def _bad(self, message: str, line: int | None, check: str = "checkpoint") -> None:
        self.findings.append(Finding(check, message, line))

    def live(self) -> list[str]:
        """The paths whose latest commit still stands."""
        return [p for p in self.writes if p not in self.removed and p not in self.damaged]

    def named(self, resumed_from: str | None) -> CheckpointWrite | None:
        """The commit a resume's ``resumed_from`` names (by path, or by file and folder name)."""
        if resumed_from is None:
            return None
        want = Path(resumed_from)
        for path, info in self.writes.items():
            if resumed_from == path or (want.name, want.parent.name) == (Path(path).name, Path(path).parent.name):
                return info
        return None

    def second_start(self, n: int, seg: Segment) -> None:
        """A run_start after the first, without ``resumed_from``: a restart, if its ``restart`` comes."""
        seg.ckpts.start_line = n

    def settings(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        settings = p.get("settings")
        if p.get("source") != CHECKPOINT_SOURCE or not isinstance(settings, dict):
            return
        every = settings.get("save_every_n_epochs")
        if type(every) is int and every >= 1:
            seg.ckpts.every, seg.ckpts.latest = every, settings.get("save_latest") is True

    def commit(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        path, sha = p.get("path"), p.get("sha256")
        if not isinstance(path, str) or not isinstance(sha, str):
            self._bad("a checkpoint event needs string path and sha256", n)
            return
        head = p.get("chain_head")
        if head is not None and not isinstance(head, str):
            self._bad(f"chain_head must be a digest string, found {head!r}", n)
            head = None
        if head is not None and self.chain.active is not None and not self.chain.unchained:
            pinned = self.chain.pinned_line(head)
            if pinned is None:
                self._bad(f"checkpoint {path} pins chain head {head[:12]}..., which is the digest of no line logged "
                          "since the previous epoch began (nor of an epoch's end since the last commit): the lines "
                          "before it were altered after the checkpoint was committed", n)
            else:
                self.chain.pinned(pinned)
        epoch = p.get("epoch") if type(p.get("epoch")) is int else None
        self.writes[path] = CheckpointWrite(sha, n, epoch, head, p["step"] if type(p.get("step")) is int else None,
                                            p["shards"] if isinstance(p.get("shards"), Mapping) else None)
        self.first_commit.setdefault(sha, (n, path, epoch))
        self.removed.pop(path, None)
        self.damaged.pop(path, None)
        if epoch is None or "step" in p:  # a checkpoint at a step: the epoch's own state is still due
            return
        ckpts = seg.ckpts
        ckpts.committed.add(epoch)
        if epoch in ckpts.skipped:
            self._bad(f"checkpoint {path} commits epoch {epoch_number(epoch)}, whose state line {ckpts.skipped[epoch]} "
                      "says was skipped (never written)", n)

    def remove(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        path = rec["payload"].get("path")
        if isinstance(path, str):
            self.removed[path] = n

    def skipped(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        epoch, reason = p.get("epoch"), p.get("reason")
        if type(epoch) is not int or not isinstance(reason, str) or not reason:
            self._bad("checkpoint_skipped needs the epoch left out (an integer) and the reason (a text)", n)
            return
        if not seg.start_epoch <= epoch <= seg.next_epoch:
            self._bad(f"checkpoint_skipped names epoch {epoch_number(epoch)}, which this process (epochs "
                      f"{epoch_number(seg.start_epoch)} to {epoch_number(seg.next_epoch)}) did not train", n)
        if "step" not in p:
            seg.ckpts.skipped[epoch] = n
        self.ex.checkpoints_skipped += 1

    def quarantined(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """``checkpoint_damaged``: committed files a resume moved to ``damaged/``."""
        p = rec["payload"]
        paths, moved = p.get("paths"), p.get("moved_to")
        if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths) or not paths:
            self._bad("checkpoint_damaged needs the damaged files' paths (a list of texts)", n)
            return
        moved_to = moved if isinstance(moved, list) and len(moved) == len(paths) else [None] * len(paths)
        found = p.get("found_sha256")
        digests = found if isinstance(found, list) and len(found) == len(paths) else [None] * len(paths)
        for path, target, digest in zip(paths, moved_to, digests, strict=True):
            if path not in self.writes:
                self._bad(f"checkpoint_damaged names {path}, which the log never committed", n)
                continue
            self.damaged[path] = Damaged(n, target if isinstance(target, str) else None,
                                         digest if isinstance(digest, str) else None)
        self.ex.checkpoints_damaged += 1

    def restart(self, n: int, seg: Segment) -> None:
        ckpts = seg.ckpts
        if ckpts.start_line is None and seg.first_line != 1:
            self._bad("a restart event in a segment that is not a restart (its run_start resumes or is the first)", n,
                      "resume")
        ckpts.restarted = True
        self.ex.restarts += 1
        if seg.start_epoch != 0:
            self._bad(f"a restart starts the run over at epoch 1; this one starts at epoch "
                      f"{epoch_number(seg.start_epoch)}", n, "resume")
        left = sorted(self.live())
        if left:
            self._bad(f"a restart, but the log still commits {', '.join(left[:3])}: the run had a checkpoint to "
                      "resume from", n, "resume")

    def finish(self, segments: list[Segment]) -> list[Finding]:
        for seg in segments:
            ckpts = seg.ckpts
            if ckpts.start_line is not None and not ckpts.restarted:
                self._bad("a second run_start without resumed_from and no restart event: two runs written into one "
                          "file", ckpts.start_line, "resume")
            ended = seg.result_line is not None and seg.end_reason != StopReason.ERROR.value
            horizon = max(ckpts.committed, default=-1)
            for epoch, (_, line) in enumerate(seg.vals, seg.start_epoch):
                if not ckpts.expects(epoch) or (not ended and epoch > horizon):
                    continue
                if epoch not in ckpts.committed and epoch not in ckpts.skipped:
                    self._bad(f"epoch {epoch_number(epoch)} has no checkpoint, and no checkpoint_skipped says why "
                              "(the checkpoint policy this process logged saves that epoch)", line, "coverage")
        return self.findings
