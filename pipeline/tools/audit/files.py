"""The checkpoint files a log names, checked against it: each file's sha256 against the log's last
record of it, and the chain head the file stores against the chain.

A file whose sha256 differs from the log is classified by the head it pins: a write the process
never got to log (it pins the last line a killed process wrote: a note), an older file than the log
records, or a file committed at a point the log no longer has (the log was cut back or rewritten).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.tools.audit.chain import ChainCheck, stored_head
from pipeline.tools.audit.coverage import Damaged
from pipeline.tools.audit.ending import Segment
from pipeline.tools.audit.verdict import Explanation, Finding, Severity

__all__ = ["CheckpointWrite", "verify_checkpoints"]


@dataclass(frozen=True)
class CheckpointWrite:
    """The log's latest ``checkpoint`` event for one path."""

    sha256: str
    line: int
    epoch: int | None
    chain_head: str | None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoints(log: Path, writes: dict[str, CheckpointWrite], removed: dict[str, int], chain: ChainCheck,
                       segments: list[Segment], lines: int, ex: Explanation,
                       damaged: Mapping[str, Damaged] | None = None) -> list[Finding]:
    out: list[Finding] = []
    base = log.parent
    # The lines of each process that was killed (no result: killed before or during teardown): a
    # checkpoint pinning one of these is a write that process never got to log; a background write
    # lands while later lines are logged.
    killed = [(s.first_line, s.last_line) for s in segments if not s.result_seen]
    if segments and not segments[-1].result_seen:
        killed.append((segments[-1].first_line, lines))
    for rel, w in writes.items():
        if rel in removed:
            ex.checkpoints_removed += 1
            continue
        if damaged is not None and rel in damaged:
            out += _quarantined(base, rel, damaged[rel])
            continue
        file = Path(rel) if Path(rel).is_absolute() else base / rel
        if not file.is_file():
            ex.checkpoints_missing += 1
            out.append(Finding("checkpoint", f"checkpoint {rel} is not present; its sha256 was not verified", w.line,
                               Severity.WARNING))
            continue
        actual = _sha256(file)
        found, head = stored_head(file)
        if actual == w.sha256:
            ex.checkpoints_verified += 1
            if w.chain_head is not None and found:
                if head != w.chain_head:
                    out.append(Finding("checkpoint", f"checkpoint {rel} stores chain head {_short(head)}, but its "
                                       f"checkpoint event records {_short(w.chain_head)}", w.line))
                else:
                    ex.checkpoints_pinned += 1
            continue
        changed = (f"sha256 {actual[:12]}... but the log recorded {w.sha256[:12]}... at line {w.line}")
        if not found or head is None:
            out.append(Finding("checkpoint", f"checkpoint {rel} changed after the run: {changed}", w.line))
            continue
        at = chain.locate(log, head)
        if at is None:
            out.append(Finding("checkpoint", f"checkpoint {rel} pins chain head {_short(head)}, which is no line of "
                               f"this log: the log was cut back or rewritten after that checkpoint was committed "
                               f"({changed})", w.line))
        elif at < w.line:
            out.append(Finding("checkpoint", f"checkpoint {rel} is an older write (it pins line {at}) than the one "
                               f"line {w.line} records: {changed}", w.line))
        elif any(first <= at <= last for first, last in killed):
            out.append(Finding("checkpoint", f"checkpoint {rel} was written after line {at} by a process that ended "
                               f"before its result: an uncommitted write interrupted by the process's end "
                               f"({changed})", at, Severity.WARNING))
        else:
            out.append(Finding("checkpoint", f"checkpoint {rel} was written after line {at} (the chain head it "
                               f"pins), but the log goes on without recording it: lines after line {at} were "
                               f"removed or rewritten ({changed})", at + 1))
    return out


def _quarantined(base: Path, rel: str, d: Damaged) -> list[Finding]:
    """A file a resume moved to ``damaged/``: the evidence is kept as the log says it found it."""
    if d.moved_to is None:
        return []
    kept = Path(d.moved_to) if Path(d.moved_to).is_absolute() else base / d.moved_to
    if not kept.is_file():
        return [Finding("checkpoint", f"damaged checkpoint {rel} was moved to {d.moved_to} (line {d.line}), which "
                        "is not there", d.line, Severity.WARNING)]
    if d.found_sha256 is not None and _sha256(kept) != d.found_sha256:
        return [Finding("checkpoint", f"{d.moved_to} (damaged {rel}, line {d.line}) changed after it was moved "
                        "aside", d.line, Severity.WARNING)]
    return []


def _short(head: str | None) -> str:
    return "none" if head is None else f"{head[:12]}..."
