"""Audit a run directory (or its nodes' directories): every rank's log, then that the ranks agreed: each
segment (matched by its ``launch``) ran on the ranks its world size says, took the same phase-level
moves, resumed from the same checkpoint and ended as :mod:`fsmtrain.core.consensus` ends a run."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from fsmtrain.core.consensus import log_name_for_rank
from fsmtrain.core.lifecycle import ABORT
from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.auditor import read_log
from fsmtrain.tools.audit.segment import Segment
from fsmtrain.tools.audit.verdict import FAULTS, AuditReadError, AuditReport, Finding, Outcome, shown_epoch

__all__ = ["RankedAudit", "audit_run_dir"]

_NAMED = 8  # missing rank logs named one by one; the rest are counted
_ON_RANK = re.compile(r" on rank (\d+)$")
_LOG_NAME = re.compile(r"events(?:-rank(\d+))?\.jsonl")


def _rank_logs(*run_dirs: Path) -> list[tuple[int, Path]]:
    """(rank, log) of every rank's log (:func:`~fsmtrain.core.consensus.log_name_for_rank`), in rank order."""
    logs = [(path, _LOG_NAME.fullmatch(path.name)) for run_dir in run_dirs for path in run_dir.glob("events*.jsonl")]
    return sorted((int(m[1] or 0), path) for path, m in logs if m is not None)


def _files(ranks: Sequence[int]) -> str:
    return ", ".join(log_name_for_rank(r) for r in ranks)


def _census(world: int | None, ranks: list[int]) -> list[Finding]:
    """The logs missing from the world size rank 0 recorded, and the strays beyond it."""
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


def _largest_world(segs: list[Segment]) -> int | None:
    worlds = [s.world for s in segs]
    return None if not worlds or None in worlds else max(worlds)  # type: ignore[type-var]


def _move(moves: list[tuple[str, str, str, int]], i: int) -> str:
    return "no move" if i >= len(moves) else "{1}->{2} ({0}) at epoch index {3}".format(*moves[i])


def _named_rank(source: Any) -> int | None:
    """The rank a stop or failure from another rank names (:func:`~fsmtrain.core.consensus.on_rank`)."""
    found = _ON_RANK.search(str(source)) if source is not None else None
    return int(found.group(1)) if found else None


def _failed_rank(seg: Segment) -> int | None:
    """The rank named as the one that failed, when a rank's failure ended this segment."""
    if seg.end_reason not in FAULTS:
        return None
    named = _named_rank(seg.end_said[0])
    if seg.end_reason == StopReason.INTERRUPTED.value:
        return seg.failed_rank if seg.failed_rank is not None and seg.failed_rank == named else None
    return named


def _ended_alike(base: Segment, other: Segment, rank: int) -> str | None:
    """Why rank ``rank``'s end of a segment disagrees with rank 0's, or None."""
    failed = _failed_rank(base)
    if failed is not None and (base.failed_rank is not None or other.failed_rank is not None):
        # one rank failed: ERROR there, INTERRUPTED on every other, all naming it with its exception
        want = StopReason.ERROR.value if rank == failed else StopReason.INTERRUPTED.value
        if other.end_reason != want:
            return f"rank {failed} failed, so rank {rank} ends {want}; it ended {other.end_reason}"
        if other.end_said != base.end_said:
            return (f"rank {rank} names the failure {other.end_said[0]!r}: {other.end_said[1]!r}, rank 0 "
                    f"{base.end_said[0]!r}: {base.end_said[1]!r}")
        return None
    if other.end_reason != base.end_reason:
        return f"rank {rank} ended with {other.end_reason}, rank 0 with {base.end_reason}"
    return None


def _moves_agree(base: Segment, other: Segment) -> int | None:
    """The index of the first move where two ranks' segments part, or None."""
    a, b = list(base.moves), list(other.moves)
    cut_short = not (base.end_line is not None and other.end_line is not None) or _failed_rank(base) is not None
    if cut_short:  # each rank aborted where it was when the run broke off
        a, b = ([m for m in moves if m[0] != ABORT] for moves in (a, b))
    if (a[:len(b)] == b[:len(a)]) if cut_short else a == b:
        return None
    return next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))


Pairs = list[tuple[int, Segment, Segment]]  # (index on rank 0, rank 0's segment, the other rank's)


def _aligned(base: list[Segment], segs: list[Segment], rank: int) -> tuple[Pairs, list[Finding]]:
    """Rank 0's segments paired with rank ``rank``'s by ``launch`` (by position in logs without one),
    and what does not line up."""
    out: list[Finding] = []
    pairs: Pairs = []
    # A segment on one process (world size 1: rank 0 alone) names no launch; every other does.
    launched = all(s.launch is not None for s in [*base, *segs] if s.world != 1)
    if not launched:
        if len(segs) != len(base):
            out.append(Finding("ranks", f"rank {rank} ran {len(segs)} segment(s), rank 0 "
                                        f"{len(base)}: the ranks were not started and resumed together"))
        return [(i, a, b) for i, (a, b) in enumerate(zip(base, segs, strict=False))], out
    theirs = {s.launch: s for s in segs if s.launch is not None}
    ours = {s.launch for s in base}
    for i, seg in enumerate(base):
        expected = seg.world is not None and rank < seg.world
        if seg.launch in theirs and expected:
            pairs.append((i, seg, theirs[seg.launch]))
        elif expected:
            out.append(Finding("ranks", f"segment {i + 1} ran on {seg.world} ranks, but {log_name_for_rank(rank)} "
                                        "has no segment of it"))
        elif seg.launch in theirs:
            out.append(Finding("ranks", f"segment {i + 1} ran on {seg.world} rank(s), but rank {rank} has a segment "
                                        "of it"))
    strays = [s for s in segs if s.launch not in ours]
    if strays:
        out.append(Finding("ranks", f"rank {rank} ran {len(strays)} segment(s) that rank 0 did not"))
    return pairs, out


def _compare(by_rank: dict[int, list[Segment]]) -> list[Finding]:
    base = by_rank[0]  # rank 0's log: it owns the run, so its run_start's world size is the reference
    world = _largest_world(base)
    out = _census(world, sorted(by_rank))
    for rank, segs in by_rank.items():
        said = segs[0].rank if segs else None  # its first run_start names it
        if said != rank:
            out.append(Finding("ranks", f"{log_name_for_rank(rank)} says it is rank {said}"))
    for rank, segs in sorted(by_rank.items()):
        if rank == 0 or (world is not None and rank >= world):
            continue  # a stray log (named above) is no rank of this run to compare
        pairs, misaligned = _aligned(base, segs, rank)
        out += misaligned
        for i, a, b in pairs:
            if a.world != b.world:
                out.append(Finding("ranks", f"segment {i + 1}: rank {rank} says world_size {b.world}, "
                                            f"rank 0 {a.world}"))
            if a.resumed != b.resumed:  # rank 0's own audit holds its record to the commit in its log
                out.append(Finding("ranks", f"segment {i + 1}: rank {rank} resumed from {_resumed(b)}, rank 0 "
                                            f"from {_resumed(a)}"))
            at = _moves_agree(a, b)
            if at is not None:
                out.append(Finding("ranks", f"segment {i + 1}: rank {rank} took {_move(list(b.moves), at)} where "
                                            f"rank 0 took {_move(list(a.moves), at)} (move {at + 1})"))
            if a.end_line is not None and b.end_line is not None:
                why = _ended_alike(a, b, rank)
                if why is not None:
                    out.append(Finding("ranks", f"segment {i + 1}: {why}"))
    return out


def _resumed(seg: Segment) -> str:
    if seg.resumed is None:
        return "no checkpoint (no resume event)"
    name, sha, epoch, _ = seg.resumed
    return f"{name} (sha256 {str(sha)[:12]}..., epoch {shown_epoch(epoch)})"


def _went_on_without(base: list[Segment], segs: list[Segment], rank: int) -> str | None:
    """How the run went on without rank ``rank`` after its log ends (on fewer ranks), or None."""
    launches = [s.launch for s in base]
    if rank == 0 or not segs or segs[-1].launch is None or segs[-1].launch not in launches:
        return None
    later = base[launches.index(segs[-1].launch) + 1:]
    if not later or any(s.world is None or rank < s.world for s in later):
        return None
    return (f"the run went on without rank {rank}: rank 0's log continues with "
            f"{len(later)} segment(s) on {', '.join(str(s.world) for s in later)} rank(s)")


def _how_it_ended(base: list[Segment]) -> str:
    """The last segment's stop and the rank that caused it."""
    seg = base[-1] if base else None
    if seg is None or seg.end_line is None:
        return "unfinished"
    failed, (source, message) = _failed_rank(seg), seg.end_said
    if failed is not None:
        return f"rank {failed} failed ({message}, in {source}); every other rank was interrupted"
    if seg.end_reason == StopReason.COMPLETED.value:
        return "completed"
    return f"{seg.end_reason} from rank {_named_rank(source) or 0} ({source}: {message})"


@dataclass
class RankedAudit(Outcome):
    """The audit of every rank's log and of their agreement."""

    run_dir: str
    reports: dict[int, AuditReport]
    findings: list[Finding]
    moves: int = 0
    world_size: int | None = None  # the largest rank 0's run_start lines record (None: nothing readable)
    worlds: list[int | None] = field(default_factory=list)  # each segment's, as rank 0's log records them
    ending: str = ""
    sharded: list[bool] = field(default_factory=list)  # each segment's: parameters sharded (FSDP2)

    def passes(self, strict: bool) -> bool:
        return not self.findings and all(r.passes(strict) for r in self.reports.values())

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir, "ok": self.passes(strict),
            "world_size": self.world_size if self.world_size is not None else len(self.reports),
            "segment_world_sizes": self.worlds, "segment_sharded": self.sharded, "ending": self.ending,
            "ranks": {str(r): rep.to_dict(strict) for r, rep in self.reports.items()},
            "agreement": [{"check": f.check, "message": f.message} for f in self.findings],
        }

    def render(self, strict: bool = False) -> str:
        if len(self.reports) == 1 and not self.findings:  # a one-process run: its log's audit
            return self.reports[0].render(strict)
        out = [line for rank, report in self.reports.items()
               for line in (f"== rank {rank}", report.render(strict).rstrip("\n"))]
        if not self.findings:
            sizes = "" if len(set(self.worlds)) < 2 else (
                "; segments on " + ", ".join("?" if w is None else str(w) for w in self.worlds) + " ranks")
            sharded = "" if not any(self.sharded) else "; sharded (FSDP2) in segment(s) " + ", ".join(
                str(i + 1) for i, s in enumerate(self.sharded) if s)
            out.append(f"== ranks: {len(self.reports)} ranks agree "
                       f"({self.moves} phase-level moves on rank 0, same order, same stop{sizes}{sharded})")
            out.append(f"  ended: {self.ending}")
        else:
            world = "?" if self.world_size is None else self.world_size
            out.append(f"== ranks: FAILED (world size {world}; logs of rank(s) "
                       f"{', '.join(map(str, self.reports))})")
        out += [f"  {f.render()}" for f in self.findings]
        out.append(f"audit {self.run_dir}: {'OK' if self.passes(strict) else 'FAILED'}")
        return "\n".join(out) + "\n"


def audit_run_dir(run_dir: str | Path, *more: str | Path, verify_checkpoints: bool = True,
                  key: bytes | None = None, allow_missing: bool = False) -> RankedAudit:
    """Audit every rank's log in ``run_dir`` and ``more`` (the other nodes' run directories) and
    their agreement; ``allow_missing`` as :func:`audit_file`."""
    roots = [Path(run_dir), *map(Path, more)]
    for root in roots:
        if not root.is_dir():
            raise AuditReadError(f"{root} is not a run directory")
    logs = _rank_logs(*roots)
    shown = " ".join(map(str, roots))
    if not logs or logs[0][0] != 0:
        where = "none of them holds" if len(roots) > 1 else "it holds no"
        raise AuditReadError(f"{shown}: {where} events.jsonl (rank 0's log): is it a run directory?")
    findings: list[Finding] = []
    seen: dict[int, Path] = {}
    for rank, path in logs:
        if rank in seen:
            findings.append(Finding("ranks", f"rank {rank}'s log is in two places: {seen[rank]} and {path}"))
        else:
            seen[rank] = path
    auditors = {rank: read_log(path, verify_checkpoints=verify_checkpoints and rank == 0, key=key,
                               allow_missing=allow_missing) for rank, path in seen.items()}
    by_rank = {rank: auditor.segments for rank, auditor in auditors.items()}
    base = by_rank[0]
    for rank, auditor in auditors.items():
        auditor.went_on = _went_on_without(base, by_rank[rank], rank)
    reports = {rank: auditor.finish() for rank, auditor in auditors.items()}
    # rank 0's log alone: fine for one process, not when it records more ranks
    findings += _census(_largest_world(base), [0]) if len(seen) == 1 else _compare(by_rank)
    return RankedAudit(shown, reports, findings, sum(len(seg.moves) for seg in base), _largest_world(base),
                       [s.world for s in base], _how_it_ended(base), [s.sharded for s in base])
