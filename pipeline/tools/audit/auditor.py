"""Audit a run's ``events.jsonl`` against the lifecycle, and explain the run. The log is streamed once:
fields, ``seq``, ``ts`` and ``global_step`` are checked here, the rest by the sibling modules' mixins."""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections import Counter
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

from fsmtrain.core.events import EVENT_KEYS, LEVELS
from fsmtrain.core.lifecycle import FINAL, HOOKS, TRANSITIONS
from fsmtrain.core.log_file import parse_line, read_blocks
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.checkpoints import CheckpointLines, SegmentChecks
from fsmtrain.tools.audit.ending import Segment, best_epoch, budget_ended, completed_epochs, ending_segment
from fsmtrain.tools.audit.files import verify_checkpoints
from fsmtrain.tools.audit.moves import PER_BATCH, MoveChecks
from fsmtrain.tools.audit.verdict import (
    BUDGET_REASONS,
    AuditReadError,
    AuditReport,
    Explanation,
    Finding,
    SegmentInfo,
    Verdict,
    shown_epoch,
)

__all__ = ["LogAuditor", "Reader", "audit_file", "read_log"]

_CHAIN_KEYS = ("prev", "seal")  # a missing prev or seal is the chain's finding
_REQUIRED = frozenset(k for k in EVENT_KEYS if k not in _CHAIN_KEYS)
Reader = Callable[[int, dict[str, Any]], None]  # given each line that is a JSON object, with its number
# given each move read from its bytes: its line's number, (phase, from, to, trigger), global_step, epoch and
# how many times it was made (by as many lines, each a step after the one before: a run of per-batch lines)
Mover = Callable[[int, tuple[str, ...], int, int, int], None]
Matcher = Callable[[bytes], "re.Match[bytes] | None"]
_INT = rb"(0|[1-9]\d*)"  # a JSON integer
# A move line as the writer writes it (a transition with no payload): decoded from its bytes, not
# parsed, and a per-batch one (the bulk of a debug log) that holds every check taken as it is.
_MOVE_LINE = re.compile(
    rb'\{"seq":%s,"ts":((?:0|[1-9]\d*)\.\d+),"run_id":"([ !#-\[\]-~]*)","event":"transition","level":"(\w+)",'
    rb'"phase":"(\w+)","from":"(\w+)","to":"(\w+)","trigger":"(\w+)","epoch":%s,"global_step":%s,"payload":\{\},'
    rb'"prev":"(\w{64})","seal":"(\w{64})"\}\n' % (_INT, _INT, _INT)).fullmatch
_BATCH = tuple(s.encode() for s in (PER_BATCH[1], *PER_BATCH))  # a per-batch line's phase, from, to and trigger
# A per-batch line of the run whose id is spliced in, as the writer writes it at debug level (a run of them is
# checked in one go): its seq, ts, epoch, global_step and prev captured.
_BATCH_LINE = (rb'\{"seq":%s,"ts":((?:0|[1-9]\d*)\.\d+),"run_id":"%%s","event":"transition","level":"debug",'
               rb'"phase":"%s","from":"%s","to":"%s","trigger":"%s","epoch":%s,"global_step":%s,"payload":\{\},'
               rb'"prev":"(\w{64})","seal":"\w{64}"\}\n' % (_INT, *_BATCH, _INT, _INT))
_VERBATIM_ID = re.compile(r"[ !#-\[\]-~]*").fullmatch  # a run id its log holds as it is (no escapes)
_DEBUG, _STEP = LEVELS["debug"], PER_BATCH[0]
_COLUMNS = tuple(itemgetter(i) for i in range(1, 6))
_FINAL = FINAL.value.encode()
_SAVING = next(h.phase for h in HOOKS if h.name == "on_save_checkpoint").value  # a checkpoint is staged here
# The words of each move of the table (phase, from, to, trigger) as bytes, and decoded: the same tuple each time.
_WORDS = {tuple(w.encode() for w in words): words for words in
          ((t.dest.value, t.source.value, t.dest.value, t.trigger) for t in TRANSITIONS)}


def _when(ts: float) -> str:
    try:
        return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return repr(ts)


def _span(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.3f} s"


class LogAuditor(SegmentChecks, MoveChecks):
    """Checks a log one line at a time (:meth:`feed_parsed`); :meth:`finish` runs the whole-file checks."""

    def __init__(self, path: Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
                 allow_missing: bool = False, reader: Reader | None = None, mover: Mover | None = None) -> None:
        self.path = path
        self.reader, self.mover = reader, mover
        self.allow_missing = allow_missing
        # Set by the run directory's audit: a last segment cut by a kill is then no unfinished run.
        self.went_on: str | None = None
        self.verify_checkpoints = verify_checkpoints
        self.findings: list[Finding] = []
        self.ex = Explanation()
        self.chain = ChainCheck(key)
        self.seg: Segment | None = None
        self.segments: list[Segment] = []
        self.prev_seq: int | None = None
        self.lines = 0
        self.first_ts: float | None = None
        self.last_ts = -math.inf
        self.last_ts_line = 0
        self.batch_moves = 0
        self.moves: Counter[tuple[str, str, str]] = Counter()
        self.ckpts = CheckpointLines()
        self._matchers: dict[str, Matcher] = {}

    def _batch_matcher(self) -> Matcher | None:
        """The current segment's per-batch line (:data:`_BATCH_LINE`); None where no such line can pass."""
        seg = self.seg
        if seg is None or seg.min_level > _DEBUG or not _VERBATIM_ID(seg.run_id):
            return None
        found = self._matchers.get(seg.run_id)
        if found is None:
            found = self._matchers[seg.run_id] = re.compile(_BATCH_LINE % re.escape(seg.run_id.encode())).fullmatch
        return found

    def feed_block(self, n: int, block: list[bytes]) -> None:
        """Lines ``n``, ``n + 1``... (``block``): a run of per-batch lines in one go where every line of it passes
        every check (:meth:`_batch_run`), any other line one at a time (:meth:`feed_line`)."""
        i, size = 0, len(block)
        while i < size:
            seg, matcher = self.seg, self._batch_matcher()
            if matcher is None:
                while i < size and self.seg is seg:
                    self.feed_line(n + i, block[i])
                    i += 1
                continue
            found, base = [*map(matcher, block[i:]), None], i
            while i < size and self.seg is seg:  # a run_start opens another segment: its run id may differ
                if found[i - base] is None:
                    self.feed_line(n + i, block[i])
                    i += 1
                    continue
                end = found.index(None, i - base) + base  # at most size: found ends with None
                if not self._batch_run(n + i, block[i:end], found[i - base:end - base]):
                    for j in range(i, end):
                        self.feed_line(n + j, block[j])
                i = end

    def feed_line(self, n: int, raw: bytes) -> None:
        """Line ``n``: a move line taken from its bytes where it can be, else parsed (:meth:`feed_parsed`)."""
        m = _MOVE_LINE(raw)
        if m is None or not self._move_line(n, raw, m.groups()):
            self.feed_parsed(n, raw, None)

    def _batch_run(self, n: int, lines: list[bytes], found: list[Any]) -> bool:
        """Lines ``n``, ``n + 1``... (``lines``, each a :data:`_BATCH_LINE`) checked as :meth:`_move_line` would
        one at a time, when each passes every check; False, with nothing changed, for any other run."""
        seg, prev_seq = self.seg, self.prev_seq
        if (seg is None or seg.result_line is not None or seg.phase != _STEP or prev_seq is None
                or (seg.stop is not None and seg.stop.immediate)):
            return False
        seq_b, ts_b, epoch_b, step_b, prev_b = (list(map(column, found)) for column in _COLUMNS)
        size, first = len(lines), int(step_b[0])
        seqs, steps, ts = list(map(int, seq_b)), list(map(int, step_b)), list(map(float, ts_b))
        if (seqs != list(range(prev_seq + 1, prev_seq + 1 + size)) or first < seg.global_step
                or steps != list(range(seg.step_prev + 1, seg.step_prev + 1 + size))
                or int(epoch_b[0]) != seg.next_epoch or epoch_b.count(epoch_b[0]) != size
                or ts[0] < self.last_ts or ts != sorted(ts)):
            return False
        every = seg.val_every
        if every is not None and (max(seg.validated_at, 0) // every + 1) * every <= steps[-1]:
            return False  # a validation is missed: said line by line
        if not self.chain.link_run(n, lines, list(map(bytes.decode, prev_b)), seqs[-1]):
            return False
        last = n + size - 1
        if self.mover is not None:
            self.mover(n, _WORDS[_BATCH], first, seg.next_epoch, size)
        self.prev_seq, self.last_ts, self.last_ts_line = seqs[-1], ts[-1], last
        seg.last_line, seg.last_epoch_field, seg.global_step = last, seg.next_epoch, steps[-1]
        seg.step_prev = steps[-1]
        seg.batch_lines += size
        self.batch_moves += size
        return True

    def _move_line(self, n: int, raw: bytes, fields: tuple[bytes, ...]) -> bool:
        """A move line (``fields``: :data:`_MOVE_LINE`'s) that passes every line check of :meth:`feed_parsed`,
        taken from its bytes; False, with nothing changed, for any other (it is then parsed)."""
        seq_b, ts_b, run_id, level, _, _, dst, _, epoch_b, step_b, prev, _ = fields
        seg, seq, ts, step = self.seg, int(seq_b), float(ts_b), int(step_b)
        if (seg is None or seg.result_line is not None or seq != self.prev_seq + 1  # type: ignore[operator]
                or ts < self.last_ts or step < seg.global_step or dst == _FINAL or run_id.decode() != seg.run_id
                or (seg.min_level and LEVELS.get(level.decode(), 99) < seg.min_level)):
            return False
        raw_words, epoch = fields[4:8], int(epoch_b)
        words = _WORDS.get(raw_words) or tuple(w.decode() for w in raw_words)
        if self.mover is not None:
            self.mover(n, words, step, epoch, 1)
        self.prev_seq = seq
        self.chain.link(n, raw, prev.decode(), seq, words[0] == _SAVING)
        self.last_ts, self.last_ts_line = ts, n
        seg.last_line, seg.last_epoch_field, seg.global_step = n, epoch, step
        if not (raw_words == _BATCH and self._batch(n, step, epoch, seg)):
            self._transition(n, seg, words[1], words[2], words[3], epoch, step, words[0])
        return True

    def feed_parsed(self, n: int, raw: bytes, rec: Any) -> None:
        """Line ``n`` checked; ``rec``: its value when decoded already, else None (it is parsed here)."""
        if rec is None:
            try:
                rec = parse_line(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                self.chain.link_unparsed(raw)
                cut = "" if raw.endswith(b"\n") else " (the line has no end: a truncated write?)"
                self.bad("json", f"not valid JSON: {exc}{cut}", n)
                return
        if type(rec) is not dict:
            self.chain.link_unparsed(raw)
            self.bad("json", f"expected a JSON object, found {type(rec).__name__}", n)
            return
        if self.reader is not None:
            self.reader(n, rec)
        if not rec.keys() >= _REQUIRED:
            self._link(n, raw, rec)
            missing = ", ".join(k for k in EVENT_KEYS if k not in rec and k not in _CHAIN_KEYS)
            self.bad("fields", f"missing field(s) {missing}", n)
            return
        seq, event = rec["seq"], rec["event"]
        if type(seq) is not int or type(event) is not str or type(rec["payload"]) is not dict:
            self._link(n, raw, rec)
            self.bad("fields", "seq must be an integer, event a string and payload an object", n)
            return
        in_order = self._seq_ok(n, seq, event, raw)
        if event == "run_start" and in_order:
            self.chain.segment(n, raw, rec)
        self._link(n, raw, rec)
        ts = rec["ts"]
        if (type(ts) is float or type(ts) is int) and ts >= self.last_ts:
            self.last_ts, self.last_ts_line = ts, n
        else:
            self._ts_back(n, ts)
        if not in_order:
            return  # a repeated line is not replayed into the state
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
        if seg.result_line is not None:
            self.bad("end", f"a {event!r} line after the result (line {seg.result_line}): the result is a run's "
                     "last line, and only a resume's run_start may follow it", n)
        seg.last_line = n
        seg.last_epoch_field = rec["epoch"]
        step = rec["global_step"]
        if type(step) is int:
            if step < seg.global_step:
                self.bad("global_step", f"global_step {step} after {seg.global_step}: steps never go back", n)
            seg.global_step = step
        if seg.min_level and LEVELS.get(rec["level"], 99) < seg.min_level:
            self.bad("level", f"a {rec['level']} line, but the run's config (line {seg.first_line}) writes this log "
                     f"at a higher level", n)
        if event == "transition":
            if self._transition(n, seg, rec["from"], rec["to"], rec["trigger"], rec["epoch"], step, rec["phase"]):
                self._train_end(n, rec, seg)
            return
        if rec["phase"] != seg.phase:
            self.bad("phase", f"{event!r} event says phase {rec['phase']!r}, but the last transition "
                     f"reached {seg.phase!r}", n)
        handler = getattr(self, f"_on_{event}", None)  # each event's checks: a method named for it
        if handler is not None:
            handler(n, rec, seg)

    def _link(self, n: int, raw: bytes, rec: dict[str, Any]) -> None:
        self.chain.link(n, raw, rec.get("prev"), rec.get("seq"), rec.get("phase") == _SAVING, rec)

    def _ts_back(self, n: int, ts: Any) -> None:
        if type(ts) is not float and type(ts) is not int:
            self.bad("ts", f"ts must be a number (seconds since the epoch), found {ts!r}", n)
            return
        if self.first_ts is not None and ts < self.first_ts:
            self.bad("ts", f"ts {_when(ts)} is {_span(self.first_ts - ts)} before the run started "
                     f"({_when(self.first_ts)}, line 1)", n)
        else:
            self.bad("ts", f"ts {_when(ts)} is {_span(self.last_ts - ts)} earlier than line {self.last_ts_line}'s "
                     f"({_when(self.last_ts)}): timestamps never go back in a log", n)

    def _seq_ok(self, n: int, seq: int, event: str, raw: bytes) -> bool:
        prev = self.prev_seq
        restarted = seq == 0 and event == "run_start"  # a resume that restarted numbering: _run_start checks it
        if prev is None or seq >= prev + 1 or restarted:
            if prev is None and seq != 0:
                self.bad("seq", f"seq starts at {seq}, not 0: {seq} line(s) lost before this one", n)
            elif prev is not None and seq > prev + 1 and not restarted:
                self.bad("seq", f"seq jumps from {prev} to {seq}: {seq - prev - 1} line(s) lost before this one", n)
            self.prev_seq = seq
            return True
        if raw == self.chain.prev_raw:  # the chain has not taken this line yet: that is line n - 1
            self.bad("seq", f"duplicate of line {n - 1} (seq {seq} again)", n)
        else:
            self.bad("seq", f"seq {seq} after {prev}: a repeated or reordered line (expected {prev + 1})", n)
        return False

    def finish(self) -> AuditReport:
        if self.lines == 0 or not self.segments:
            self.bad("start", "the log has no events", None if self.lines == 0 else 1)
        for i, seg in enumerate(self.segments):
            last = i == len(self.segments) - 1
            self.report_previous_end(seg, None)  # a resume that never logged its resume event
            if seg.end_line is None and last and self.went_on is not None:
                self.warn("end", f"the log ends in phase {seg.phase!r} in epoch {shown_epoch(seg.last_epoch_field)} "
                          f"(line {seg.last_line}) without reaching {FINAL.value!r}: the process was killed, and "
                          f"{self.went_on}", seg.last_line)
            elif seg.end_line is None and last:
                self.bad("end", f"unfinished run: the log ends in phase {seg.phase!r} in epoch "
                         f"{shown_epoch(seg.last_epoch_field)} (line {seg.last_line}), {seg.epochs} epoch(s) "
                         f"completed, without reaching {FINAL.value!r}", seg.last_line)
            elif seg.end_line is not None and seg.result_line is None and not last:
                # a kill -9 in the teardown cannot be caught; the run that resumed wrote the result
                self.warn("end", f"no result event after train_end (line {seg.end_line}): the process was killed "
                          f"in its teardown, and the run went on at line {seg.last_line + 1}", seg.last_line,
                          Verdict.KILLED)
            elif seg.end_line is not None and seg.result_line is None:
                self.bad("end", f"no result event after train_end (line {seg.end_line})", self.lines)
                self._stop_said(seg, None)
            if not 0 <= seg.epoch_starts - seg.epochs <= 1:
                self.bad("epochs", f"{seg.epoch_starts} epoch(s) began but {seg.epochs} epoch event(s) were logged "
                         f"between line {seg.first_line} and line {seg.last_line}", seg.last_line)
        self.findings += self.chain.finish()
        self._coverage()
        if self.verify_checkpoints:
            self.findings += verify_checkpoints(self.path, self.ckpts, self.chain, self.segments, self.lines, self.ex,
                                                allow_missing=self.allow_missing)
        # By line; on one line the chain's finding first: it says whether the line is what was written.
        self.findings.sort(key=lambda f: (0 if f.line is None else f.line, f.check not in ("chain", "key")))
        self._fill_explanation()
        return AuditReport(str(self.path), self.lines, self.findings, self.ex, self.chain.verdict,
                           self._segment_infos())

    def _segment_infos(self) -> list[SegmentInfo]:
        chains = {c.first_line: (c.scheme, c.key_id, c.verified) for c in self.chain.segments}
        return [SegmentInfo(s.first_line, s.last_line, s.start_epoch, s.epochs, s.resumed_from, s.end_reason,
                            *chains.get(s.first_line, (None, None, False))) for s in self.segments]

    def _fill_explanation(self) -> None:
        ex = self.ex
        ex.segments = len(self.segments)
        if self.batch_moves:
            self.moves[PER_BATCH] += self.batch_moves
        ex.moves = {f"{s}->{d} ({t})": c for (s, d, t), c in self.moves.items()}
        if not self.segments:
            return
        seg = self.segments[-1]
        ex.max_epochs = ending_segment(self.segments).max_epochs
        ex.epochs_completed = completed_epochs(self.segments)
        ex.last_epoch = seg.next_epoch - 1 if seg.next_epoch > 0 else None
        ex.stop_reason = seg.end_reason
        ex.train_end_line = seg.end_line
        if seg.stop is not None:
            ex.stop_source, ex.stop_message = seg.stop.source, seg.stop.message
            ex.stop_request_line, ex.stop_epoch = seg.stop.line, seg.stop.epoch
        elif seg.end_reason in BUDGET_REASONS:
            ex.stop_source, ex.stop_message = budget_ended(ending_segment(self.segments))[1:]
            ex.stop_epoch = seg.next_epoch - 1
        best = best_epoch(self.segments)
        if best is not None:
            ex.best_val_loss, ex.best_epoch, ex.best_line = best


def audit_file(path: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
               allow_missing: bool = False) -> AuditReport:
    """Audit ``path`` (an ``events.jsonl``); ``key`` verifies a keyed chain; ``allow_missing``: a
    committed checkpoint file that is gone is a warning. :class:`AuditReadError` if it is unreadable."""
    return read_log(path, verify_checkpoints=verify_checkpoints, key=key, allow_missing=allow_missing).finish()


def read_log(path: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
             allow_missing: bool = False, reader: Reader | None = None, mover: Mover | None = None) -> LogAuditor:
    """A :class:`LogAuditor` fed every line of ``path``, not yet finished; ``reader`` is given each
    parsed line too, ``mover`` each move line read from its bytes (the report reads the log in the audit's pass)."""
    p = Path(path)
    auditor = LogAuditor(p, verify_checkpoints=verify_checkpoints, key=key, allow_missing=allow_missing,
                         reader=reader, mover=mover)
    n = 0
    for block in read_blocks(p, AuditReadError):
        auditor.feed_block(n + 1, block)
        n += len(block)
    auditor.lines = n
    return auditor
