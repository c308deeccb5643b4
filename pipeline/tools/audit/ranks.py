"""Audit a run directory: every rank's log on its own, then that the ranks agreed.

A multi-process run leaves one log per rank (``events.jsonl`` for rank 0, which owns the run's
files, ``events-rank<r>.jsonl`` for the others). Each is audited like a one-process log (chain,
lifecycle, content; checkpoint files only against rank 0's log, which committed them). Then the
ranks are compared:

- there is one log per rank of the world size rank 0's ``run_start`` records (a one-process run:
  1), no more and no fewer: a missing rank's log, or a log of a rank beyond the world size, is
  named;
- every log names its own rank and the same world size;
- each segment (a resume starts another) took the same phase-level moves, in the same order, in
  the same epochs, on every rank; a segment that was killed may have got further on one rank than
  on another, so there one rank's moves need only be a prefix of the other's;
- every rank ended for the same stop reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from pipeline.core.consensus import log_name_for_rank
from pipeline.core.events import first_run_start
from pipeline.core.lifecycle import FINAL
from pipeline.tools.audit.auditor import audit_file
from pipeline.tools.audit.verdict import EXIT_OK, EXIT_VIOLATIONS, AuditReadError, AuditReport, Finding

__all__ = ["RankedAudit", "audit_run_dir", "rank_logs"]

Move = tuple[str, str, str, int]  # trigger, from, to, epoch
_NAMED = 8  # missing rank logs named one by one; the rest are counted


def rank_logs(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's logs by rank: rank 0's ``events.jsonl``, then ``events-rank<r>.jsonl`` in rank order."""
    found = [(0, run_dir / log_name_for_rank(0))]
    for path in run_dir.glob("events-rank*.jsonl"):
        digits = path.stem.removeprefix("events-rank")
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


@dataclass
class _Story:
    """What the comparison needs from one rank's log."""

    rank: int | None = None
    world_size: int | None = None
    segments: list[list[Move]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    reason: str | None = None


def _story(path: Path) -> _Story:
    story = _Story()
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # the rank's own audit reports it
            if not isinstance(rec, dict):
                continue
            event, payload = rec.get("event"), rec.get("payload")
            payload = payload if isinstance(payload, dict) else {}
            if event == "run_start":
                story.segments.append([])
                story.ended.append(False)
                if not story.segments[:-1]:  # the first run_start names the rank and the world size
                    rank, world = payload.get("rank", 0), payload.get("world_size", 1)
                    story.rank = rank if type(rank) is int else None
                    story.world_size = world if type(world) is int else None
            elif event == "transition" and story.segments and rec.get("from") != rec.get("to"):
                move = (str(rec.get("trigger")), str(rec.get("from")), str(rec.get("to")), int(rec.get("epoch") or 0))
                story.segments[-1].append(move)
                story.ended[-1] = story.ended[-1] or move[2] == FINAL.value
                if move[2] == FINAL.value:
                    story.reason = payload.get("reason")
    return story


def _declared_world_size(path: Path) -> int | None:
    """The world size the first ``run_start`` of ``path`` records (1 when it names none: one
    process); None when the log has no readable ``run_start`` (its own audit reports that)."""
    payload = first_run_start(path)
    world = None if payload is None else payload.get("world_size", 1)
    return world if type(world) is int else None


def _files(ranks: list[int]) -> str:
    return ", ".join(log_name_for_rank(r) for r in ranks)


def _census(world: int | None, ranks: list[int]) -> list[Finding]:
    """One log per rank of the world size rank 0 recorded: the missing ones and the strays, by name."""
    if world is None:
        return []
    if world < 1:
        return [Finding("ranks", f"run_start says world_size {world}: a run has at least one rank")]
    out: list[Finding] = []
    have = set(ranks)
    n_missing = world - len(have.intersection(range(world)))
    if n_missing:
        named = list(islice((r for r in range(world) if r not in have), _NAMED))  # a forged world size stays cheap
        more = f" and {n_missing - len(named)} more" if n_missing > len(named) else ""
        out.append(Finding("ranks", f"run_start says world_size {world}; {_files(named)}{more} "
                                    f"{'is' if n_missing == 1 else 'are'} missing"))
    beyond = [r for r in ranks if r >= world]
    if beyond:
        out.append(Finding("ranks", f"run_start says world_size {world}; {_files(beyond)} "
                                    f"{'is' if len(beyond) == 1 else 'are'} beyond it (no such rank)"))
    return out


def _compare(stories: dict[int, _Story]) -> list[Finding]:
    base = stories[0]  # rank 0's log: it owns the run, so its run_start's world size is the reference
    out = _census(base.world_size, sorted(stories))
    worlds = {s.world_size for s in stories.values()}
    if len(worlds) != 1:
        out.append(Finding("ranks", f"the logs disagree on the world size: {sorted(map(str, worlds))}"))
    for rank, story in stories.items():
        if story.rank != rank:
            out.append(Finding("ranks", f"{log_name_for_rank(rank)} says it is rank {story.rank}"))
    for rank, story in sorted(stories.items()):
        if rank == 0 or (base.world_size is not None and rank >= base.world_size):
            continue  # a stray log (named above) is no rank of this run to compare
        if len(story.segments) != len(base.segments):
            out.append(Finding("ranks", f"rank {rank} ran {len(story.segments)} segment(s), rank 0 "
                                        f"{len(base.segments)}: the ranks were not started and resumed together"))
        for i, (a, b) in enumerate(zip(base.segments, story.segments, strict=False)):
            both_ended = base.ended[i] and story.ended[i]
            n = len(a) if both_ended else min(len(a), len(b))
            if (len(a) != len(b) and both_ended) or a[:n] != b[:n]:
                at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), n)
                out.append(Finding("ranks", f"segment {i + 1}: rank {rank} took {_move(b, at)} where rank 0 took "
                                            f"{_move(a, at)} (move {at + 1})"))
        if story.reason != base.reason:
            out.append(Finding("ranks", f"rank {rank} ended with {story.reason}, rank 0 with {base.reason}"))
    return out


def _move(moves: list[Move], i: int) -> str:
    if i >= len(moves):
        return "no move"
    trigger, src, dst, epoch = moves[i]
    return f"{src}->{dst} ({trigger}) at epoch index {epoch}"


@dataclass
class RankedAudit:
    """The audit of every rank's log and of their agreement."""

    run_dir: str
    reports: dict[int, AuditReport]
    findings: list[Finding]
    moves: int = 0
    world_size: int | None = None  # what rank 0's run_start records (None: it records nothing readable)

    def ok(self, strict: bool = False) -> bool:
        return not self.findings and all(r.ok(strict) for r in self.reports.values())

    def exit_code(self, strict: bool = False) -> int:
        return EXIT_OK if self.ok(strict) else EXIT_VIOLATIONS

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir, "ok": self.ok(strict),
            "world_size": self.world_size if self.world_size is not None else len(self.reports),
            "ranks": {str(r): rep.to_dict(strict) for r, rep in self.reports.items()},
            "agreement": [{"check": f.check, "message": f.message} for f in self.findings],
        }

    def render(self, strict: bool = False) -> str:
        if len(self.reports) == 1 and not self.findings:  # a one-process run: its log's audit
            return self.reports[0].render(strict)
        out = []
        for rank, report in self.reports.items():
            out.append(f"== rank {rank}")
            out.append(report.render(strict).rstrip("\n"))
        if not self.findings:
            out.append(f"== ranks: {len(self.reports)} ranks agree "
                       f"({self.moves} phase-level moves each, same order, same stop)")
        else:
            world = "?" if self.world_size is None else self.world_size
            out.append(f"== ranks: FAILED (world size {world}; logs of rank(s) "
                       f"{', '.join(map(str, self.reports))})")
        out += [f"  {f.render()}" for f in self.findings]
        out.append(f"audit {self.run_dir}: {'OK' if self.ok(strict) else 'FAILED'}")
        return "\n".join(out) + "\n"


def audit_run_dir(run_dir: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None) -> RankedAudit:
    """Audit every rank's log in ``run_dir`` and their agreement."""
    root = Path(run_dir)
    logs = rank_logs(root)
    if not logs[0][1].is_file():
        raise AuditReadError(f"{root} holds no events.jsonl: is it a run directory?")
    reports = {rank: audit_file(path, verify_checkpoints=verify_checkpoints and rank == 0, key=key)
               for rank, path in logs}
    if len(logs) == 1:  # rank 0's log alone: fine for one process, not when it records more ranks
        world = _declared_world_size(logs[0][1])
        return RankedAudit(str(root), reports, _census(world, [0]), world_size=world)
    stories = {rank: _story(path) for rank, path in logs}
    moves = sum(len(seg) for seg in stories[0].segments)
    return RankedAudit(str(root), reports, _compare(stories), moves, stories[0].world_size)
