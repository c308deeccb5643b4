"""How a run ended, mixed into the auditor: the stop reason against the evidence its
:class:`~fsmtrain.core.stop.StopReason` row names, the stop source and message against the
``stop_request``, and the ``result`` recomputed from the epoch events."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from fsmtrain.core.consensus import may_override
from fsmtrain.core.context import epoch_number
from fsmtrain.core.lifecycle import ABORT, INITIAL, Phase
from fsmtrain.core.log_file import log_number as number
from fsmtrain.core.stop import Evidence, StopReason, budget_end
from fsmtrain.tools.audit.segment import Segment, StopInfo
from fsmtrain.tools.audit.verdict import Finding, Severity, Verdict, shown_epoch

__all__ = ["PHASES", "EndingChecks", "as_int", "budget_ended", "counted_epochs", "ending_segment", "number"]

_REASONS = frozenset(r.value for r in StopReason)
PHASES: dict[str, Phase] = {p.value: p for p in Phase}
_NAN_DETECTOR = "NaNDetectionCallback"
# The result figures recomputed from the log, in the order the audit reports them.
_RESULT_FIELDS = ("stop_reason", "stop_source", "stop_message", "epochs_completed", "last_val_loss",
                  "best_val_loss", "best_epoch", "objective", "global_step")


def _same(got: Any, want: Any) -> bool:
    """Equal as the result writes it: a float by value (NaN equal to NaN), anything else by value and type."""
    if not isinstance(want, float):
        return bool(got == want and type(got) is type(want))
    x, y = number(got), number(want)
    return x is not None and y is not None and (x == y or (math.isnan(x) and math.isnan(y)))


def result_mismatches(found: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, found, expected) for each ``result`` figure that differs from the recomputed one;
    a field the result does not carry is not compared."""
    return [(key, found[key], expected[key]) for key in _RESULT_FIELDS
            if key in found and key in expected and not _same(found[key], expected[key])]


def as_int(value: Any) -> int | None:
    """``value`` where the log holds an integer there (``bool`` is not one), else None."""
    return value if type(value) is int else None


def budget_ended(seg: Segment) -> tuple[StopReason, str, str]:
    """The stop reason, source and message of a run that ran out of its budget (no stop requested)."""
    return budget_end(seg.max_epochs, seg.max_steps, seg.end_global_step if type(seg.end_global_step) is int else 0)


def ending_segment(segs: list[Segment]) -> Segment:
    """The segment whose ``max_epochs`` ended the run: the last, unless it had nothing left to train."""
    last = segs[-1]
    if last.epochs or last.start_epoch < last.max_epochs:
        return last
    return next((s for s in reversed(segs[:-1]) if s.epochs), last)


def counted_epochs(segs: list[Segment]) -> list[tuple[int, float, int]]:
    """(epoch, val_loss, line) of each logged epoch that counts: a resume from an older checkpoint
    does epochs over, and only the later doing counts."""
    out: list[tuple[int, float, int]] = []
    for seg, kept in _kept(segs):
        if vals := seg.vals[:kept]:
            losses, lines = zip(*vals, strict=True)
            out += zip(range(seg.start_epoch, seg.start_epoch + len(vals)), losses, lines, strict=True)
    return out


def _kept(segs: list[Segment]) -> Iterator[tuple[Segment, int]]:
    """Each segment and how many of its logged epochs count (a later resume may do some over)."""
    for seg, nxt in zip(segs, [*segs[1:], None], strict=True):
        yield seg, seg.epochs if nxt is None else max(0, min(seg.epochs, nxt.start_epoch - seg.start_epoch))


def completed_epochs(segs: list[Segment], counted: list[tuple[int, float, int]] | None = None) -> int:
    """``counted``: :func:`_counted` of ``segs``, where the caller has it."""
    return len(counted_epochs(segs) if counted is None else counted) + sum(len(seg.unlogged) for seg in segs)


def best_epoch(segs: list[Segment], counted: list[tuple[int, float, int]] | None = None
               ) -> tuple[float, int, int] | None:
    """(val_loss, epoch, line) of the counted epoch with the lowest finite val_loss."""
    counted = counted_epochs(segs) if counted is None else counted
    losses = [x for _, x, _ in counted]
    if losses and math.isfinite(sum(losses)) and losses.count(least := min(losses)) == 1:  # (all finite, one best)
        epoch, x, line = counted[losses.index(least)]
        return x, epoch, line
    return min(((x, epoch, line) for epoch, x, line in counted if math.isfinite(x)), default=None)


def last_epoch(segs: list[Segment]) -> int | None:
    """The latest counted epoch, logged or only committed."""
    logged = (seg.start_epoch + min(kept, len(seg.vals)) - 1 for seg, kept in _kept(segs) if kept and seg.vals)
    return max([*logged, *(e for seg in segs for e in seg.unlogged)], default=None)


class EndingChecks:
    """Needs the auditor's ``findings`` and ``segments``."""

    findings: list[Finding]
    segments: list[Segment]

    def bad(self, check: str, message: str, line: int | None) -> None:
        self.findings.append(Finding(check, message, line))

    def warn(self, check: str, message: str, line: int | None, verdict: Verdict | None = None) -> None:
        self.findings.append(Finding(check, message, line, Severity.WARNING, verdict))

    def _train_end(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        seg.end_line = n
        payload = rec["payload"]
        reason = payload.get("reason")
        seg.end_reason = reason if isinstance(reason, str) else None
        seg.end_said = (payload.get("source"), payload.get("message"))
        seg.end_global_step = rec["global_step"]
        if reason not in _REASONS:
            self.bad("stop_reason", f"train_end reason {reason!r} is not one of {sorted(_REASONS)}", n)
            return
        stop = seg.stop
        expected = stop.reason if stop is not None else budget_ended(seg)[0].value
        if reason != expected:
            why = (f"the stop request in force (line {stop.line}) is {stop.reason!r}" if stop is not None
                   else "no stop was requested, so the run completed")
            self.bad("stop_reason", f"train_end gives reason {reason!r}, but {why}", n)
        ended = StopReason(reason)
        why_not = self._missing_evidence(ended, rec, seg)
        if why_not:
            self.bad("stop_reason", f"reason {reason}, but {why_not}", n)
        if ended.evidence is not Evidence.NONFINITE_LOSS and seg.nonfinite:
            epoch, (line, key) = min(seg.nonfinite.items())
            won_before = stop is not None and stop.epoch is not None and stop.epoch < epoch
            if _NAN_DETECTOR in seg.callbacks and not won_before and not ended.fault:
                self.bad("stop_reason", f"reason {reason}, but {key} of epoch {epoch_number(epoch)} (line {line}) is "
                         f"not finite and {_NAN_DETECTOR} was running", n)
            else:
                self.warn("losses", f"{key} of epoch {epoch_number(epoch)} (line {line}) is not finite", line)

    @staticmethod
    def _missing_evidence(reason: StopReason, rec: Mapping[str, Any], seg: Segment) -> str | None:
        """What the log lacks to explain ``reason`` (its :class:`~fsmtrain.core.stop.Evidence`), or None."""
        stop, evidence = seg.stop, reason.evidence
        last_epoch = seg.next_epoch - 1
        if evidence is Evidence.LAST_EPOCH and seg.next_epoch < seg.max_epochs:
            return f"only epochs up to {epoch_number(last_epoch)} ran of max_epochs={seg.max_epochs}"
        if evidence is Evidence.LAST_STEP and (seg.max_steps is None or rec["global_step"] != seg.max_steps):
            return f"it ended at global_step {rec['global_step']}, and max_steps is {seg.max_steps}"
        if evidence is Evidence.NONFINITE_LOSS:
            stop_epoch = stop.epoch if stop is not None else last_epoch
            mid_epoch = stop is not None and stop.immediate and stop_epoch not in range(seg.start_epoch, seg.next_epoch)
            from_other_rank = stop is not None and stop.rank is not None
            if stop_epoch not in seg.nonfinite and not mid_epoch and not from_other_rank:
                return f"the losses of epoch {shown_epoch(stop_epoch)} are finite"
        if evidence is Evidence.PRUNE_DECISION and seg.last_trial_report is not None:
            should, line = seg.last_trial_report
            if not should:
                return f"the last trial_report (line {line}) says should_prune=false"
        if evidence in (Evidence.EXCEPTION, Evidence.INTERRUPT):
            exc = seg.exception
            if exc is None or rec["trigger"] != ABORT:
                return "no exception event precedes this abort"
            interrupted = bool(exc.get("interrupt")) or exc.get("type") == "KeyboardInterrupt"
            if interrupted != (evidence is Evidence.INTERRUPT):
                return f"the exception at line {seg.exception_line} is {exc.get('type')}"
        return None

    def _on_stop_request(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        reason = p.get("reason")
        if reason not in _REASONS:
            self.bad("stop_request", f"stop reason {reason!r} is not one of {sorted(_REASONS)}", n)
            return
        if not p.get("accepted"):
            return
        overrides = p.get("overrides")
        rank = p.get("rank")  # agreed with the other ranks: the winner by precedence, then (epoch, phase, rank)
        agreed = type(rank) is int
        epoch, phase = (p.get("requested_epoch"), p.get("requested_phase")) if agreed else (rec["epoch"], rec["phase"])
        if seg.stop is not None and not seg.faulted:
            if agreed:
                self._agreed_override(n, StopReason(reason), (epoch, phase, rank), overrides, seg.stop, seg.rank)
            elif overrides != seg.stop.reason or not StopReason(reason).outranks(StopReason(seg.stop.reason)):
                self.bad("stop_request", f"a second accepted stop request (the first won at line {seg.stop.line}) "
                         f"that does not outrank it", n)
        elif overrides is not None:
            self.bad("stop_request", f"claims to override a {overrides!r} request that was never accepted", n)
        source = str(p.get("source", ""))
        seg.stop = StopInfo(str(reason), source, str(p.get("message", "")), bool(p.get("immediate")),
                            epoch if type(epoch) is int else None, n, rank if agreed else None,
                            phase if isinstance(phase, str) else None)
        if StopReason(reason).requested and seg.callbacks and source not in seg.callbacks and seg.stop.rank is None:
            self.warn("stop_request", f"stop {reason} requested by {source!r}, which is not a callback of this run "
                      f"(run_start line {seg.first_line} lists {', '.join(seg.callbacks)})", n)

    def _agreed_override(self, n: int, reason: StopReason, where: tuple[Any, Any, int], overrides: Any,
                         held: StopInfo, own_rank: int) -> None:
        """An agreed request that replaced the one in force is legal by
        :func:`fsmtrain.core.consensus.may_override`, and names what it replaced."""
        epoch, phase, rank = where
        if type(epoch) is not int or phase not in PHASES:
            self.bad("stop_request", f"an agreed stop request needs its requested_epoch and requested_phase, found "
                     f"{epoch!r} and {phase!r}", n)
            return
        if overrides != held.reason:
            self.bad("stop_request", f"an agreed stop request from rank {rank} replaces the {held.reason!r} request "
                     f"in force (line {held.line}) but says it overrides {overrides!r}", n)
            return
        held_at = (StopReason(held.reason), held.epoch if held.epoch is not None else -1,
                   PHASES.get(held.phase or "", INITIAL), held.rank if held.rank is not None else own_rank)
        if not may_override((reason, epoch, PHASES[phase], rank), held_at):
            self.bad("stop_request", f"an agreed {reason.value} request from rank {rank} replaces the "
                     f"{held.reason!r} request in force (line {held.line}), which the ranks' verdict ranks first", n)

    def _on_result(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        if seg.end_line is None:
            self.bad("result", "a result before train_end", n)
            return
        seg.result_line = n
        self._stop_said(seg, (p.get("stop_source"), p.get("stop_message"), n))
        segs = self.segments[: self.segments.index(seg) + 1]
        own = self._expected_result(seg, [seg])
        whole = own if len(segs) == 1 else self._expected_result(seg, segs)  # segs ends with seg
        wrong = result_mismatches(p, whole)
        unlogged = set().union(*(s.unlogged for s in segs))
        # An epoch committed but never logged (a kill in between): what the result takes from it is unchecked.
        unseen: list[tuple[str, int, tuple[str, ...]]] = []
        best, last = p.get("best_epoch"), last_epoch(segs)
        if type(best) is int and best in unlogged:
            unseen.append(("best", best, ("best_val_loss", "best_epoch", "objective")))
        if last is not None and last in unlogged:
            unseen.append(("last", last, ("last_val_loss",)))
        for which, epoch, keys in unseen:
            wrong = [w for w in wrong if w[0] not in keys]
            self.warn("result", f"the {which} epoch, epoch {epoch_number(epoch)}, is not in the log (its process was "
                      f"killed before logging it): {' and '.join(k for k in keys if k != 'best_epoch')} cannot be "
                      "checked", n)
        if wrong and whole != own and not result_mismatches(p, own):
            self.warn("result", f"the result describes only this process's epochs (from line {seg.first_line}), "
                      "not the whole resumed run", n)
        elif wrong:
            said = ", ".join(f"{k} {_show(got)} (expected {_show(want)})" for k, got, want in wrong)
            self.bad("result", f"the result disagrees with the epoch events: {said}", n)

    def _expected_result(self, seg: Segment, segs: list[Segment]) -> dict[str, Any]:
        counted = counted_epochs(segs)
        best = best_epoch(segs, counted)
        best_val = best[0] if best is not None else math.inf
        out: dict[str, Any] = {
            "epochs_completed": completed_epochs(segs, counted),
            "last_val_loss": counted[-1][1] if counted else math.nan,
            "best_val_loss": best_val,
            "best_epoch": best[1] if best is not None else None,
            "objective": StopReason(seg.end_reason).objective(best_val) if seg.end_reason in _REASONS else best_val,
        }
        if seg.end_reason is not None:
            out["stop_reason"] = seg.end_reason
        if type(seg.end_global_step) is int:
            out["global_step"] = seg.end_global_step
        return out

    def _stop_said(self, seg: Segment, result: tuple[Any, Any, int] | None) -> None:
        """The stop source and message as the request, train_end and the result say them (the request
        is named when the other two agree against it)."""
        assert seg.end_line is not None
        stop = seg.stop
        said = result[:2] if result is not None else (None, None)
        if stop is None:
            for what, told, expected, res in zip(("source", "message"), seg.end_said, budget_ended(seg)[1:], said,
                                                 strict=True):
                if told != expected:
                    self.bad("stop", f"train_end says the stop {what} was {told!r}; with no stop requested it is "
                             f"{expected!r}", seg.end_line)
                if res is not None and result is not None:
                    self.bad("stop", f"the result gives stop_{what} {res!r}, but no stop was requested", result[2])
            return
        for what, asked, told, res in zip(("source", "message"), (stop.source, stop.message), seg.end_said,
                                          said if result is not None else seg.end_said, strict=True):
            if asked == told == res:
                continue
            if told == res and result is not None:
                self.bad("stop", f"the stop_request says {what} {asked!r}, but train_end (line {seg.end_line}) and "
                         f"the result (line {result[2]}) say {told!r}", stop.line)
                continue
            if told != asked:
                self.bad("stop", f"train_end says the stop {what} was {told!r}; the stop_request that carried it "
                         f"(line {stop.line}) says {asked!r}", seg.end_line)
            if result is not None and res != asked:
                self.bad("stop", f"the result gives stop_{what} {res!r}; the stop_request that carried it "
                         f"(line {stop.line}) says {asked!r}", result[2])


def _show(value: Any) -> str:
    x = number(value) if not isinstance(value, bool) else None
    if x is not None and isinstance(value, float | str):
        return repr(x) if math.isfinite(x) else str(value)
    return repr(value)
