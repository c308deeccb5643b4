"""Audit a run's ``events.jsonl`` against the lifecycle, and explain the run.

``fsmtrain audit EVENTS.jsonl [--json] [--strict]`` streams the log line by line (a million lines
take seconds) and checks:

- every line is a JSON object with the fields of :data:`pipeline.core.events.EVENT_KEYS`;
- ``seq`` runs contiguous from 0: a gap is a lost line, a repeat a duplicated or altered one;
- every transition is a move of :data:`pipeline.core.lifecycle.TRANSITIONS` from the phase the previous
  one reached, and its guards held given what the log says (stop requests, epochs, faults); every
  other event happens in the phase the machine is in;
- the run starts in ``created`` and ends in ``train_end`` (else: an unfinished run, with its last
  phase and epoch); epochs count up from the run's ``start_epoch`` without gaps;
- the stop reason agrees with the events: the request in force, a non-finite loss for NAN, the
  matching request for EARLY_STOP / PRUNED, the last epoch for COMPLETED, an exception for ERROR /
  INTERRUPTED, and the ``result`` summary;
- each checkpoint the log names, when its file is present and this was the file's latest write, has
  the logged sha256 (a periodic one deleted later is fine when a ``checkpoint_removed`` says so);
- a resume (a later ``run_start`` with ``resumed_from``) starts at an epoch the log reached.

Exit codes: 0 the log holds, 1 violations (also warnings with ``--strict``), 2 the file cannot be
read. Phases and moves come only from :mod:`pipeline.core.lifecycle`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from pipeline.core.events import EVENT_KEYS
from pipeline.core.lifecycle import ABORT, FINAL, INITIAL, TRANSITIONS, Facts, Phase, StopReason, Transition

__all__ = [
    "AuditReadError",
    "AuditReport",
    "Explanation",
    "Finding",
    "Severity",
    "audit_file",
    "register_cli",
]

EXIT_OK, EXIT_VIOLATIONS, EXIT_UNREADABLE = 0, 1, 2
_REQUIRED = frozenset(EVENT_KEYS)
_MOVES: Mapping[tuple[str, str, str], Transition] = {
    (t.source.value, t.dest.value, t.trigger): t for t in TRANSITIONS
}
_PHASES = frozenset(p.value for p in Phase)
_REASONS = frozenset(r.value for r in StopReason)
_LOSSES = ("train_loss", "val_loss")
_NAN_DETECTOR = "NaNDetectionCallback"
_FAULTS = (StopReason.INTERRUPTED.value, StopReason.ERROR.value)
_MAX_TEXT_FINDINGS = 50


class Severity(str, Enum):
    VIOLATION = "violation"
    WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One problem, with the 1-based line of the log it is about (None: the file as a whole)."""

    check: str
    message: str
    line: int | None = None
    severity: Severity = Severity.VIOLATION

    def render(self) -> str:
        where = f"line {self.line}" if self.line is not None else "file"
        return f"{where} [{self.check}] {self.message}"


class AuditReadError(OSError):
    """The log cannot be read at all (exit code 2)."""


@dataclass
class StopInfo:
    reason: str
    source: str
    message: str
    immediate: bool
    epoch: int | None
    line: int


@dataclass
class _Segment:
    """One process's run in the file; a resume appends another."""

    first_line: int
    run_id: str
    max_epochs: int
    start_epoch: int
    resumed_from: str | None
    callbacks: list[str]
    phase: str = INITIAL.value
    next_epoch: int = 0
    epochs: int = 0
    stop: StopInfo | None = None
    faulted: bool = False
    exception: dict[str, Any] | None = None
    exception_line: int | None = None
    end_line: int | None = None
    end_reason: str | None = None
    result_seen: bool = False
    last_line: int = 0
    last_epoch_field: Any = None
    global_step: int = 0
    epochs_seen: set[int] = field(default_factory=set)
    nonfinite: dict[int, tuple[int, str]] = field(default_factory=dict)  # epoch -> (line, loss key)
    best: tuple[float, int, int] | None = None  # (val, epoch, line)
    last_trial_report: tuple[bool, int] | None = None


@dataclass
class Explanation:
    """What the run did, for people: phases, epochs, why it stopped, where time went."""

    run_id: str | None = None
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
    checkpoints_removed: int = 0
    checkpoints_missing: int = 0


@dataclass
class AuditReport:
    path: str
    lines: int
    findings: list[Finding]
    explanation: Explanation

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.VIOLATION]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    def ok(self, strict: bool = False) -> bool:
        return not self.violations and not (strict and self.warnings)

    def exit_code(self, strict: bool = False) -> int:
        return EXIT_OK if self.ok(strict) else EXIT_VIOLATIONS

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok(strict),
            "strict": strict,
            "lines": self.lines,
            "violations": [_finding_dict(f) for f in self.violations],
            "warnings": [_finding_dict(f) for f in self.warnings],
            "explanation": _finite(asdict(self.explanation)),
        }

    def render(self, strict: bool = False) -> str:
        ex = self.explanation
        status = "OK" if self.ok(strict) else (
            f"FAILED ({len(self.violations)} violation(s)" + (f", {len(self.warnings)} warning(s) under --strict)"
                                                               if strict and self.warnings else ")"))
        out = [f"audit {self.path}: {status}, {self.lines} lines, run {ex.run_id or '?'}"]
        for title, items in (("violations", self.violations), ("warnings", self.warnings)):
            if items:
                out.append(f"{title}:")
                out += [f"  {f.render()}" for f in items[:_MAX_TEXT_FINDINGS]]
                if len(items) > _MAX_TEXT_FINDINGS:
                    out.append(f"  ... and {len(items) - _MAX_TEXT_FINDINGS} more (see --json)")
        out.append("explanation:")
        out += [f"  {line}" for line in _explain_lines(ex)]
        return "\n".join(out) + "\n"


def _finding_dict(f: Finding) -> dict[str, Any]:
    return {"line": f.line, "check": f.check, "message": f.message}


def _finite(value: Any) -> Any:
    """Strict-JSON copy: non-finite floats as strings, like the event log writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _explain_lines(ex: Explanation) -> list[str]:
    lines: list[str] = []
    epochs = f"{ex.epochs_completed} epoch(s) completed"
    if ex.max_epochs is not None:
        epochs += f" of max_epochs={ex.max_epochs}"
    if ex.last_epoch is not None:
        epochs += f" (last epoch index {ex.last_epoch})"
    if ex.segments > 1:
        epochs += f", in {ex.segments} process segments (resumed)"
    lines.append(epochs)
    if ex.moves:
        lines.append("moves: " + ", ".join(f"{k} x{v}" for k, v in ex.moves.items()))
    if ex.stop_reason is not None:
        verb = "raised in" if ex.stop_reason in _FAULTS else "requested by"
        stop = f"stop: {ex.stop_reason}"
        if ex.stop_reason == StopReason.COMPLETED.value:
            stop += " (no stop requested)"
        elif ex.stop_source:
            stop += f" {verb} {ex.stop_source}"
        if ex.stop_epoch is not None:
            stop += f" in epoch index {ex.stop_epoch}"
        if ex.stop_request_line is not None:
            stop += f" (request at line {ex.stop_request_line})"
        if ex.stop_message:
            stop += f": {ex.stop_message}"
        if ex.train_end_line is not None:
            stop += f"; train_end at line {ex.train_end_line}"
        lines.append(stop)
    else:
        lines.append("stop: the run never reached train_end")
    if ex.best_epoch is not None:
        lines.append(f"best epoch index: {ex.best_epoch} (val_loss {ex.best_val_loss:.6g}, line {ex.best_line})")
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
        for w in ex.warnings[:10]:
            lines.append(f"  line {w['line']} epoch {w['epoch']} {w['source']}: {w['message']}")
    else:
        lines.append("warnings raised: none")
    if ex.checkpoints_verified or ex.checkpoints_removed or ex.checkpoints_missing:
        lines.append(f"checkpoints: {ex.checkpoints_verified} verified (sha256), {ex.checkpoints_removed} "
                     f"removed by the run, {ex.checkpoints_missing} not present")
    return lines


def _is_nonfinite(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("NaN", "Infinity", "-Infinity")
    return isinstance(value, float) and not math.isfinite(value)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Auditor:
    """Checks a log one line at a time; ``finish()`` runs the whole-file checks."""

    def __init__(self, path: Path, *, verify_checkpoints: bool = True) -> None:
        self.path = path
        self.verify_checkpoints = verify_checkpoints
        self.findings: list[Finding] = []
        self.ex = Explanation()
        self.seg: _Segment | None = None
        self.segments: list[_Segment] = []
        self.prev_seq: int | None = None
        self.prev_raw: bytes = b""
        self.lines = 0
        self.moves: Counter[tuple[str, str, str]] = Counter()
        self.phase_seconds: dict[str, float] = {}
        self.callback_seconds: dict[str, float] = {}
        # checkpoint path -> (sha256, line) of its latest write; path -> line of a later removal
        self.ckpt_writes: dict[str, tuple[str, int, int | None]] = {}
        self.ckpt_removed: dict[str, int] = {}
        self._guard_cache: dict[tuple[tuple[str, str, str], bool, bool, bool, bool], bool] = {}

    # --- findings ----------------------------------------------------------------------------
    def bad(self, check: str, message: str, line: int | None) -> None:
        self.findings.append(Finding(check, message, line))

    def warn(self, check: str, message: str, line: int | None) -> None:
        self.findings.append(Finding(check, message, line, Severity.WARNING))

    # --- per line ----------------------------------------------------------------------------
    def feed(self, n: int, raw: bytes) -> None:
        self.lines = n
        try:
            rec = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            cut = "" if raw.endswith(b"\n") else " (the line has no end: a truncated write?)"
            self.bad("json", f"not valid JSON: {exc}{cut}", n)
            return
        if not isinstance(rec, dict):
            self.bad("json", f"expected a JSON object, found {type(rec).__name__}", n)
            return
        if not rec.keys() >= _REQUIRED:
            missing = ", ".join(k for k in EVENT_KEYS if k not in rec)
            self.bad("fields", f"missing field(s) {missing}", n)
            return
        seq, event = rec["seq"], rec["event"]
        if type(seq) is not int or not isinstance(event, str) or not isinstance(rec["payload"], dict):
            self.bad("fields", "seq must be an integer, event a string and payload an object", n)
            return
        if not self._seq_ok(n, seq, event, raw):
            return
        self.prev_raw = raw
        if event == "run_start":
            self._run_start(n, rec)
            return
        seg = self.seg
        if seg is None:
            self.bad("start", f"the log must begin with run_start, found {event!r}", n)
            seg = self._open_segment(n, rec, {})
        if rec["run_id"] != seg.run_id:
            self.bad("run_id", f"run_id {rec['run_id']!r} differs from this run's {seg.run_id!r} "
                     "(a line of another process? logs are one file per run and rank)", n)
        seg.last_line = n
        seg.last_epoch_field = rec["epoch"]
        step = rec["global_step"]
        if type(step) is int:
            seg.global_step = step
        if event == "transition":
            self._transition(n, rec, seg)
            return
        if rec["phase"] != seg.phase:
            self.bad("phase", f"{event!r} event says phase {rec['phase']!r}, but the last transition "
                     f"reached {seg.phase!r}", n)
        handler = _HANDLERS.get(event)
        if handler is not None:
            handler(self, n, rec, seg)

    def _seq_ok(self, n: int, seq: int, event: str, raw: bytes) -> bool:
        prev = self.prev_seq
        if prev is None:
            if seq != 0:
                self.bad("seq", f"seq starts at {seq}, not 0: {seq} line(s) lost before this one", n)
            self.prev_seq = seq
            return True
        if seq == prev + 1:
            self.prev_seq = seq
            return True
        if seq == 0 and event == "run_start":
            self.prev_seq = seq  # a resume that restarted numbering; _run_start checks it is a resume
            return True
        if seq > prev + 1:
            lost = seq - prev - 1
            self.bad("seq", f"seq jumps from {prev} to {seq}: {lost} line(s) lost before this one", n)
            self.prev_seq = seq
            return True
        if raw == self.prev_raw:
            self.bad("seq", f"duplicate of line {n - 1} (seq {seq} again)", n)
        else:
            self.bad("seq", f"seq {seq} after {prev}: a repeated or reordered line (expected {prev + 1})", n)
        return False  # a repeated line is not replayed into the state

    def _open_segment(self, n: int, rec: Mapping[str, Any], payload: Mapping[str, Any]) -> _Segment:
        max_epochs = payload.get("max_epochs")
        start_epoch = payload.get("start_epoch", 0)
        if type(max_epochs) is not int or type(start_epoch) is not int:
            self.bad("run_start", "run_start needs integer max_epochs and start_epoch in its payload", n)
            max_epochs = max_epochs if type(max_epochs) is int else 1 << 62
            start_epoch = start_epoch if type(start_epoch) is int else 0
        callbacks = payload.get("callbacks")
        names = [c.get("name", "?") for c in callbacks if isinstance(c, dict)] if isinstance(callbacks, list) else []
        resumed = payload.get("resumed_from")
        seg = _Segment(n, str(rec.get("run_id")), max_epochs, start_epoch,
                       None if resumed is None else str(resumed), names)
        seg.next_epoch = start_epoch
        seg.last_line = n
        self.segments.append(seg)
        self.seg = seg
        if self.ex.run_id is None:
            self.ex.run_id = seg.run_id
        return seg

    def _run_start(self, n: int, rec: Mapping[str, Any]) -> None:
        payload = rec["payload"]
        if rec["phase"] not in (None, INITIAL.value):
            self.bad("start", f"run_start in phase {rec['phase']!r}; a run starts in {INITIAL.value!r}", n)
        prev = self.seg
        seg = self._open_segment(n, rec, payload)
        if prev is None:
            return
        if seg.resumed_from is None:
            self.bad("resume", "a second run_start without resumed_from: two runs written into one file", n)
            return
        if prev.end_line is None:
            self.warn("resume", f"the run before this resume never reached train_end (last line {prev.last_line}, "
                      f"phase {prev.phase!r}, epoch {prev.next_epoch}): the process was killed", n)
        if seg.start_epoch > prev.next_epoch:
            self.bad("resume", f"resume starts at epoch {seg.start_epoch}, but the log only reached epoch "
                     f"{prev.next_epoch}", n)
        ckpt = self._checkpoint_named(seg.resumed_from)
        if ckpt is not None and ckpt[2] is not None and seg.start_epoch != ckpt[2] + 1:
            self.bad("resume", f"resume from {seg.resumed_from} (epoch {ckpt[2]}, line {ckpt[1]}) must start at "
                     f"epoch {ckpt[2] + 1}, starts at {seg.start_epoch}", n)

    def _checkpoint_named(self, resumed_from: str | None) -> tuple[str, int, int | None] | None:
        if resumed_from is None:
            return None
        for path, info in self.ckpt_writes.items():
            if resumed_from == path or (Path(resumed_from).name == Path(path).name and \
                    Path(resumed_from).parent.name == Path(path).parent.name):
                return info
        return None

    def _transition(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        src, dst, trig = rec["from"], rec["to"], rec["trigger"]
        key = (src, dst, trig)
        move = _MOVES.get(key)
        if move is None:
            self.bad("transition", f"{src} -> {dst} ({trig}) is not a move of the lifecycle table", n)
            if isinstance(dst, str) and dst in _PHASES:
                seg.phase = dst
            return
        self.moves[key] += 1
        if src != seg.phase:
            self.bad("transition", f"{src} -> {dst} ({trig}) leaves {src!r}, but the run is in {seg.phase!r}", n)
        elif not self._guards_hold(key, move, seg):
            self.bad("guard", self._guard_message(move, seg), n)
        epoch = rec["epoch"]
        if epoch != seg.next_epoch:
            self.bad("epoch", f"transition at epoch {epoch}, but the run is at epoch {seg.next_epoch}", n)
        if rec["phase"] != dst:
            self.bad("phase", f"transition to {dst!r} says phase {rec['phase']!r}", n)
        seg.phase = dst
        if dst == FINAL.value and src != dst:
            self._train_end(n, rec, seg)

    def _facts(self, seg: _Segment, has_batch: bool) -> Facts:
        stop = seg.stop
        return Facts(stop is not None, stop is not None and stop.immediate, seg.next_epoch < seg.max_epochs,
                     has_batch, seg.faulted)

    def _guards_hold(self, key: tuple[str, str, str], move: Transition, seg: _Segment) -> bool:
        stop = seg.stop
        ck = (key, stop is not None, stop is not None and stop.immediate, seg.next_epoch < seg.max_epochs,
              seg.faulted)
        hit = self._guard_cache.get(ck)
        if hit is None:
            # ``has_batch`` is not in the log: the move is fine if it holds for either value.
            hit = self._guard_cache[ck] = any(move.enabled(self._facts(seg, hb)) for hb in (False, True))
        return hit

    def _guard_message(self, move: Transition, seg: _Segment) -> str:
        stop = seg.stop
        state = (f"stop requested: {stop.reason} (line {stop.line}{', immediate' if stop.immediate else ''})"
                 if stop else "no stop requested")
        return (f"{move.source.value} -> {move.dest.value} ({move.trigger}) needs [{move.guard_label()}], "
                f"which did not hold: {state}, epoch {seg.next_epoch} of max_epochs={seg.max_epochs}"
                f"{', faulted' if seg.faulted else ''}")

    def _train_end(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        seg.end_line = n
        payload = rec["payload"]
        reason = payload.get("reason")
        seg.end_reason = reason if isinstance(reason, str) else None
        if reason not in _REASONS:
            self.bad("stop_reason", f"train_end reason {reason!r} is not one of {sorted(_REASONS)}", n)
            return
        stop = seg.stop
        expected = stop.reason if stop is not None else StopReason.COMPLETED.value
        if reason != expected:
            why = (f"the stop request in force (line {stop.line}) is {stop.reason!r}" if stop is not None
                   else "no stop was requested, so the run completed")
            self.bad("stop_reason", f"train_end gives reason {reason!r}, but {why}", n)
        last_epoch = seg.next_epoch - 1
        if reason == StopReason.COMPLETED.value and seg.next_epoch < seg.max_epochs:
            self.bad("stop_reason", f"reason completed, but only epochs up to {last_epoch} ran of "
                     f"max_epochs={seg.max_epochs}", n)
        elif reason == StopReason.NAN.value:
            stop_epoch = stop.epoch if stop is not None else last_epoch
            mid_epoch = stop is not None and stop.immediate and stop_epoch not in seg.epochs_seen
            if stop_epoch not in seg.nonfinite and not mid_epoch:
                self.bad("stop_reason", f"reason nan, but the losses of epoch {stop_epoch} are finite", n)
        elif reason == StopReason.PRUNED.value and seg.last_trial_report is not None:
            should, line = seg.last_trial_report
            if not should:
                self.bad("stop_reason", f"reason pruned, but the last trial_report (line {line}) says "
                         "should_prune=false", n)
        elif reason in (StopReason.INTERRUPTED.value, StopReason.ERROR.value):
            exc = seg.exception
            if exc is None or rec["trigger"] != ABORT:
                self.bad("stop_reason", f"reason {reason}, but no exception event precedes this abort", n)
            else:
                interrupted = bool(exc.get("interrupt")) or exc.get("type") == "KeyboardInterrupt"
                if interrupted != (reason == StopReason.INTERRUPTED.value):
                    self.bad("stop_reason", f"reason {reason}, but the exception at line {seg.exception_line} "
                             f"is {exc.get('type')}", n)
        if reason != StopReason.NAN.value and seg.nonfinite:
            epoch, (line, key) = min(seg.nonfinite.items())
            won_before = stop is not None and stop.epoch is not None and stop.epoch < epoch
            if _NAN_DETECTOR in seg.callbacks and not won_before and reason not in (
                    StopReason.INTERRUPTED.value, StopReason.ERROR.value):
                self.bad("stop_reason", f"reason {reason}, but {key} of epoch {epoch} (line {line}) is not "
                         f"finite and {_NAN_DETECTOR} was running", n)
            else:
                self.warn("losses", f"{key} of epoch {epoch} (line {line}) is not finite", line)

    # --- other events ------------------------------------------------------------------------
    def _epoch(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        epoch = rec["epoch"]
        if seg.phase != Phase.EPOCH_END.value:
            return  # already reported as a phase mismatch
        if epoch != seg.next_epoch:
            if type(epoch) is int and epoch > seg.next_epoch:
                missing = ", ".join(str(e) for e in range(seg.next_epoch, min(epoch, seg.next_epoch + 5)))
                self.bad("epochs", f"epoch {epoch} follows epoch {seg.next_epoch - 1}: epoch(s) {missing} missing", n)
            else:
                self.bad("epochs", f"epoch {epoch} again or out of order (expected {seg.next_epoch})", n)
        p = rec["payload"]
        metrics = p.get("metrics") or {}
        cur = seg.next_epoch
        seg.epochs_seen.add(cur)
        if isinstance(metrics, dict):
            for key in _LOSSES:
                if _is_nonfinite(metrics.get(key)) and cur not in seg.nonfinite:
                    seg.nonfinite[cur] = (n, key)
            val = metrics.get("val_loss")
            if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val) and (
                    seg.best is None or val < seg.best[0]):
                seg.best = (float(val), cur, n)
        for source, target in ((p.get("phase_seconds"), self.phase_seconds),
                               (p.get("callback_seconds"), self.callback_seconds)):
            if isinstance(source, dict):
                for k, v in source.items():
                    if isinstance(v, (int, float)):
                        target[k] = target.get(k, 0.0) + v
        seconds = p.get("seconds")
        if isinstance(seconds, (int, float)):
            self.ex.total_epoch_seconds += seconds
        seg.next_epoch = cur + 1
        seg.epochs += 1

    def _stop_request(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        p = rec["payload"]
        if p.get("reason") not in _REASONS:
            self.bad("stop_request", f"stop reason {p.get('reason')!r} is not one of {sorted(_REASONS)}", n)
            return
        if not p.get("accepted"):
            return
        overrides = p.get("overrides")
        if seg.stop is not None and not seg.faulted:
            if overrides != seg.stop.reason or not StopReason(p["reason"]).outranks(StopReason(seg.stop.reason)):
                self.bad("stop_request", f"a second accepted stop request (the first won at line {seg.stop.line}) "
                         f"that does not outrank it", n)
        elif overrides is not None:
            self.bad("stop_request", f"claims to override a {overrides!r} request that was never accepted", n)
        epoch = rec["epoch"]
        seg.stop = StopInfo(str(p["reason"]), str(p.get("source", "")), str(p.get("message", "")),
                            bool(p.get("immediate")), epoch if type(epoch) is int else None, n)

    def _exception(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        if seg.end_line is not None:
            return  # a teardown failure after train_end, logged for people
        seg.faulted = True
        if seg.exception is None:
            seg.exception = dict(rec["payload"])
            seg.exception_line = n

    def _warning(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        p = rec["payload"]
        source = str(p.get("source", "?"))
        self.ex.warning_counts[source] = self.ex.warning_counts.get(source, 0) + 1
        if len(self.ex.warnings) < 100:
            self.ex.warnings.append({"line": n, "epoch": rec["epoch"], "source": source,
                                     "message": str(p.get("message", ""))})

    def _checkpoint(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        p = rec["payload"]
        path, sha = p.get("path"), p.get("sha256")
        if not isinstance(path, str) or not isinstance(sha, str):
            self.bad("checkpoint", "a checkpoint event needs string path and sha256", n)
            return
        epoch = p.get("epoch")
        self.ckpt_writes[path] = (sha, n, epoch if type(epoch) is int else None)
        self.ckpt_removed.pop(path, None)

    def _checkpoint_removed(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        path = rec["payload"].get("path")
        if isinstance(path, str):
            self.ckpt_removed[path] = n

    def _trial_report(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        seg.last_trial_report = (bool(rec["payload"].get("should_prune")), n)

    def _result(self, n: int, rec: Mapping[str, Any], seg: _Segment) -> None:
        p = rec["payload"]
        if seg.end_line is None:
            self.bad("result", "a result before train_end", n)
            return
        seg.result_seen = True
        if p.get("stop_reason") != seg.end_reason:
            self.bad("result", f"result says stop_reason {p.get('stop_reason')!r}, train_end (line {seg.end_line}) "
                     f"says {seg.end_reason!r}", n)
        if seg.resumed_from is None and seg.start_epoch == 0:
            if p.get("epochs_completed") != seg.epochs:
                self.bad("result", f"result says {p.get('epochs_completed')} epochs completed, the log has "
                         f"{seg.epochs} epoch events", n)
            best = seg.best[1] if seg.best is not None else None
            if "best_epoch" in p and p.get("best_epoch") != best:
                self.bad("result", f"result says best epoch {p.get('best_epoch')}, the logged val losses give {best}",
                         n)

    # --- whole file --------------------------------------------------------------------------
    def finish(self) -> AuditReport:
        if self.lines == 0 or not self.segments:
            self.bad("start", "the log has no events", None if self.lines == 0 else 1)
        for i, seg in enumerate(self.segments):
            last = i == len(self.segments) - 1
            if seg.end_line is None and last:
                self.bad("end", f"unfinished run: the log ends in phase {seg.phase!r} at epoch "
                         f"{seg.last_epoch_field} (line {seg.last_line}), {seg.epochs} epoch(s) completed, "
                         f"without reaching {FINAL.value!r}", seg.last_line)
            elif seg.end_line is not None and not seg.result_seen:
                self.bad("end", f"no result event after train_end (line {seg.end_line})", seg.last_line)
        if self.verify_checkpoints:
            self._verify_checkpoints()
        self._fill_explanation()
        return AuditReport(str(self.path), self.lines, self.findings, self.ex)

    def _verify_checkpoints(self) -> None:
        base = self.path.parent
        for rel, (sha, line, _) in self.ckpt_writes.items():
            if rel in self.ckpt_removed:
                self.ex.checkpoints_removed += 1
                continue
            file = Path(rel) if Path(rel).is_absolute() else base / rel
            if not file.is_file():
                self.ex.checkpoints_missing += 1
                self.warn("checkpoint", f"checkpoint {rel} is not present; its sha256 was not verified", line)
                continue
            actual = _sha256(file)
            if actual != sha:
                self.bad("checkpoint", f"checkpoint {rel} changed after the run: sha256 {actual[:12]}... but the "
                         f"log recorded {sha[:12]}...", line)
            else:
                self.ex.checkpoints_verified += 1

    def _fill_explanation(self) -> None:
        ex = self.ex
        ex.segments = len(self.segments)
        ex.moves = {f"{s}->{d} ({t})": c for (s, d, t), c in self.moves.items()}
        ex.phase_seconds = dict(self.phase_seconds)
        ex.callback_seconds = dict(self.callback_seconds)
        if not self.segments:
            return
        seg = self.segments[-1]
        ex.max_epochs = seg.max_epochs
        ex.epochs_completed = sum(s.epochs for s in self.segments)
        ex.last_epoch = seg.next_epoch - 1 if seg.next_epoch > 0 else None
        ex.stop_reason = seg.end_reason
        ex.train_end_line = seg.end_line
        if seg.stop is not None:
            ex.stop_source, ex.stop_message = seg.stop.source, seg.stop.message
            ex.stop_request_line, ex.stop_epoch = seg.stop.line, seg.stop.epoch
        elif seg.end_reason == StopReason.COMPLETED.value:
            ex.stop_source, ex.stop_message = "max_epochs", f"reached max_epochs={seg.max_epochs}"
            ex.stop_epoch = seg.next_epoch - 1
        bests = [s.best for s in self.segments if s.best is not None]
        if bests:
            ex.best_val_loss, ex.best_epoch, ex.best_line = min(bests)


_HANDLERS = {
    "epoch": _Auditor._epoch,
    "stop_request": _Auditor._stop_request,
    "exception": _Auditor._exception,
    "warning": _Auditor._warning,
    "checkpoint": _Auditor._checkpoint,
    "checkpoint_removed": _Auditor._checkpoint_removed,
    "trial_report": _Auditor._trial_report,
    "result": _Auditor._result,
}


def audit_file(path: str | Path, *, verify_checkpoints: bool = True) -> AuditReport:
    """Audit ``path`` (an ``events.jsonl``). Raises :class:`AuditReadError` if it cannot be read."""
    p = Path(path)
    auditor = _Auditor(p, verify_checkpoints=verify_checkpoints)
    try:
        fh = open(p, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise AuditReadError(f"cannot read {p}: {exc.strerror or exc}") from exc
    with fh:
        try:
            feed = auditor.feed
            for n, raw in enumerate(fh, 1):
                feed(n, raw)
        except OSError as exc:
            raise AuditReadError(f"cannot read {p}: {exc.strerror or exc}") from exc
    return auditor.finish()


# --- CLI ----------------------------------------------------------------------------------------
def _cmd_audit(args: argparse.Namespace) -> int:
    try:
        report = audit_file(args.events, verify_checkpoints=not args.no_checkpoints)
    except AuditReadError as exc:
        if args.json:
            print(json.dumps({"path": str(args.events), "ok": False, "error": str(exc)}))
        else:
            print(f"fsmtrain audit: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print(json.dumps(report.to_dict(args.strict), indent=2))
    else:
        sys.stdout.write(report.render(args.strict))
    return report.exit_code(args.strict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("events", metavar="EVENTS_JSONL", help="a run's events.jsonl")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="warnings (e.g. checkpoint files not present, non-finite losses) fail the audit too")
    parser.add_argument("--no-checkpoints", action="store_true", help="do not hash the checkpoint files")
    parser.set_defaults(func=_cmd_audit)


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain audit`` to the ``fsmtrain`` parser."""
    parser = subparsers.add_parser(
        "audit", help="check a run's events.jsonl against the lifecycle and explain the run",
        description="Check a run log against the lifecycle table and explain the run. "
                    "Exit 0: holds; 1: violations; 2: the file cannot be read.",
    )
    add_arguments(parser)
