"""What ``fsmtrain audit`` hands over: findings, the chain verdict and the run's story, as text or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.events import jsonable
from fsmtrain.core.stop import Route, StopReason

__all__ = ["BUDGET_REASONS", "FAULTS", "AuditReadError", "AuditReport", "ChainVerdict", "Explanation", "Finding",
           "Outcome", "SegmentInfo", "Severity", "Verdict", "shown_epoch"]

EXIT_OK, EXIT_VIOLATIONS, EXIT_UNREADABLE = 0, 1, 2
_MAX_TEXT_FINDINGS = 50
FAULTS = frozenset(r.value for r in StopReason if r.fault)
BUDGET_REASONS = frozenset(r.value for r in StopReason if r.route is Route.EPOCHS)  # no stop was requested


class Severity(str, Enum):
    VIOLATION = "violation"
    WARNING = "warning"


class Verdict(str, Enum):
    """What a finding concludes where one check can conclude several things."""

    DAMAGED = "damaged"  # a checkpoint whose bytes are no write the log committed (not a whole one, or changed)
    OLDER_WRITE = "older_write"  # a checkpoint holding a write the log committed before the one it records last
    OTHER_WRITE = "other_write"  # a checkpoint holding a later write the log committed for another file
    UNCOMMITTED_WRITE = "uncommitted_write"  # written by a process that ended before it logged the commit
    LOG_REWRITTEN = "log_rewritten"  # a checkpoint pinning a point the log no longer has as it was
    KILLED = "killed"  # a process ended without its result, between two lines of its log
    TORN_LINE_REPAIRED = "torn_line_repaired"  # ... in the middle of a line, which a resume cut off


@dataclass(frozen=True)
class Finding:
    """One problem, with the 1-based line of the log it is about (None: the file as a whole)."""

    check: str
    message: str
    line: int | None = None
    severity: Severity = Severity.VIOLATION
    verdict: Verdict | None = None

    def render(self) -> str:
        where = f"line {self.line}" if self.line is not None else "file"
        return f"{where} [{self.check}] {self.message}"


class AuditReadError(OSError):
    """The log cannot be read at all (exit code 2)."""


@dataclass
class SegmentInfo:
    """One process's part of the log (a resume appends another)."""

    first_line: int
    last_line: int
    start_epoch: int
    epochs: int
    resumed_from: str | None
    end_reason: str | None
    scheme: str | None
    key_id: str | None
    chain_verified: bool | None  # None: keyed and no (matching) key, so not verifiable


@dataclass
class ChainVerdict:
    """``ok`` is None when no part of the chain could be verified (a keyed log and no key)."""

    ok: bool | None = None
    schemes: list[str] = field(default_factory=list)
    key_used: bool = False
    key_matches: bool | None = None
    first_break: int | None = None
    broken_links: int = 0
    sealed: bool | None = None  # whether the lines seal themselves (False: the older format); None: not verified
    unverified_lines: int = 0


@dataclass
class Explanation:
    """What the run did, for people: phases, epochs, why it stopped, where time went."""

    run_id: str | None = None
    rank: int | None = None  # one rank of a multi-process run (its run_start names them); None: one process
    world_size: int | None = None
    segments: int = 0
    max_epochs: int | None = None
    epochs_completed: int = 0
    last_epoch: int | None = None
    moves: dict[str, int] = field(default_factory=dict)
    stop_reason: str | None = None
    stop_source: str | None = None
    stop_message: str | None = None
    stop_request_line: int | None = None
    stop_epoch: int | None = None
    train_end_line: int | None = None
    best_epoch: int | None = None
    best_val_loss: float | None = None
    best_line: int | None = None
    total_epoch_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    callback_seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    warning_counts: dict[str, int] = field(default_factory=dict)
    checkpoints_verified: int = 0
    checkpoints_pinned: int = 0
    checkpoints_removed: int = 0
    checkpoints_missing: int = 0
    checkpoints_skipped: int = 0  # states a slow disk left out (checkpoint_skipped)
    checkpoints_damaged: int = 0  # damaged states a resume moved to checkpoints/damaged/
    restarts: int = 0  # segments that started the run over (nothing was committed to resume from)


class Outcome:
    """What passes or fails an audit: ``ok`` (no violation), ``ok_strict`` (no warning either)."""

    def passes(self, strict: bool) -> bool:
        raise NotImplementedError

    @property
    def ok(self) -> bool:
        return self.passes(False)

    @property
    def ok_strict(self) -> bool:
        return self.passes(True)

    def exit_code(self, strict: bool = False) -> int:
        return EXIT_OK if self.passes(strict) else EXIT_VIOLATIONS


@dataclass
class AuditReport(Outcome):
    path: str
    lines: int
    findings: list[Finding]
    explanation: Explanation
    chain: ChainVerdict = field(default_factory=ChainVerdict)
    segments: list[SegmentInfo] = field(default_factory=list)

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.VIOLATION]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    def passes(self, strict: bool) -> bool:
        return not self.violations and not (strict and self.warnings)

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.passes(strict),
            "strict": strict,
            "lines": self.lines,
            "chain": asdict(self.chain),
            "segments": [asdict(s) for s in self.segments],
            "violations": [_finding_dict(f) for f in self.violations],
            "warnings": [_finding_dict(f) for f in self.warnings],
            "story": explain_lines(self.explanation),
            "explanation": jsonable(asdict(self.explanation)),  # non-finite floats as the log writes them
        }

    def render(self, strict: bool = False) -> str:
        ex = self.explanation
        status = "OK" if self.passes(strict) else (
            f"FAILED ({len(self.violations)} violation(s)" + (f", {len(self.warnings)} warning(s) under --strict)"
                                                               if strict and self.warnings else ")"))
        out = [f"audit {self.path}: {status}, {self.lines} lines, run {ex.run_id or '?'}",
               f"chain: {_chain_line(self.chain)}"]
        for title, items in (("violations", self.violations), ("warnings", self.warnings)):
            if items:
                out.append(f"{title}:")
                out += [f"  {f.render()}" for f in items[:_MAX_TEXT_FINDINGS]]
                if len(items) > _MAX_TEXT_FINDINGS:
                    out.append(f"  ... and {len(items) - _MAX_TEXT_FINDINGS} more (see --json)")
        out.append("explanation:")
        out += [f"  {line}" for line in explain_lines(ex)]
        return "\n".join(out) + "\n"


def _chain_line(c: ChainVerdict) -> str:
    scheme = "/".join(c.schemes) or "none"
    if c.ok is None:
        why = "the key does not match" if c.key_matches is False else "written with a key; none given"
        return f"NOT VERIFIED ({scheme}: {why}): it cannot prove authorship, nor consistency"
    if not c.ok:
        if not c.broken_links:  # every link holds: a line no link covers (the last) fails its seal
            return f"BROKEN ({scheme}; line {c.first_break} fails its own seal)"
        return f"BROKEN ({scheme}; first break at line {c.first_break}, {c.broken_links} broken link(s))"
    proves = "consistency and authorship (keyed)" if c.key_used and c.key_matches else "consistency only (no key)"
    partial = f", {c.unverified_lines} line(s) not verifiable" if c.unverified_lines else ""
    older = "; last line not sealed (older log format)" if c.sealed is False else ""
    return f"intact ({scheme}): proves {proves}{partial}{older}"


def _finding_dict(f: Finding) -> dict[str, Any]:
    verdict = {} if f.verdict is None else {"verdict": f.verdict.value}
    return {"line": f.line, "check": f.check, "message": f.message, **verdict}


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def explain_lines(ex: Explanation) -> list[str]:
    """The run's story, one sentence a line."""
    lines = ["".join([f"{ex.epochs_completed} epoch(s) completed",
                      "" if ex.max_epochs is None else f" of max_epochs={ex.max_epochs}",
                      "" if ex.last_epoch is None else f" (the last is epoch {epoch_number(ex.last_epoch)})",
                      f", in {ex.segments} process segments (resumed)" if ex.segments > 1 else ""])]
    if ex.world_size is not None and ex.world_size > 1:
        lines.append(f"rank {ex.rank} of {ex.world_size}: this log only; the audit of the run directory checks "
                     "every rank's log and that the ranks agreed")
    if ex.moves:
        lines.append("moves: " + ", ".join(f"{k} x{v}" for k, v in ex.moves.items()))
    if ex.stop_reason is None:
        lines.append("stop: the run never reached train_end")
    else:
        verb = "raised in" if ex.stop_reason in FAULTS else "requested by"
        by = f" {verb} {ex.stop_source}" if ex.stop_source else ""
        lines.append("".join([
            f"stop: {ex.stop_reason}", " (no stop requested)" if ex.stop_reason in BUDGET_REASONS else by,
            "" if ex.stop_epoch is None else f" in epoch {epoch_number(ex.stop_epoch)}",
            "" if ex.stop_request_line is None else f" (request at line {ex.stop_request_line})",
            f": {ex.stop_message}" if ex.stop_message else "",
            "" if ex.train_end_line is None else f"; train_end at line {ex.train_end_line}"]))
    if ex.best_epoch is not None:
        lines.append(f"best epoch: {epoch_number(ex.best_epoch)} (val_loss {ex.best_val_loss:.6g}, line "
                     f"{ex.best_line})")
    total = ex.total_epoch_seconds
    if ex.phase_seconds:
        lines.append(f"time in epochs: {total:.3f} s; per phase: " + ", ".join(
            f"{k} {v:.3f} s ({_pct(v, total)})" for k, v in ex.phase_seconds.items()))
    if ex.callback_seconds:
        ranked = sorted(ex.callback_seconds.items(), key=lambda kv: -kv[1])
        lines.append("time per callback (share of epoch time): " + ", ".join(
            f"{k} {v:.4f} s ({_pct(v, total)})" for k, v in ranked))
    if ex.warning_counts:
        lines.append("warnings raised: " + ", ".join(f"{k} x{v}" for k, v in ex.warning_counts.items()))
        lines += [f"  line {w['line']} epoch {shown_epoch(w['epoch'])} {w['source']}: {w['message']}"
                  for w in ex.warnings[:10]]
    else:
        lines.append("warnings raised: none")
    if ex.checkpoints_verified or ex.checkpoints_removed or ex.checkpoints_missing:
        lines.append(f"checkpoints: {ex.checkpoints_verified} verified (sha256, {ex.checkpoints_pinned} pinning "
                     f"the chain), {ex.checkpoints_removed} removed by the run, {ex.checkpoints_missing} not present")
    if ex.checkpoints_skipped or ex.checkpoints_damaged or ex.restarts:
        lines.append(f"checkpoints left out: {ex.checkpoints_skipped} state(s) skipped by the writer (a slow disk "
                     f"or a busy CPU; each named in the log), {ex.checkpoints_damaged} damaged state(s) moved to "
                     f"damaged/ by a resume, {ex.restarts} restart(s) from epoch 1 (nothing committed to resume from)")
    return lines


def shown_epoch(index: object) -> str:
    """The log keeps the 0-based index; people read epoch numbers from 1."""
    return str(epoch_number(index)) if isinstance(index, int) else "?"
