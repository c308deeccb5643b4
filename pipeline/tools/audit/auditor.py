"""Audit a run's ``events.jsonl`` against the lifecycle, and explain the run. The log is streamed once:
fields, ``seq``, ``ts`` and ``global_step`` are checked here, the rest by the sibling modules' mixins."""

from __future__ import annotations

import datetime as _dt
import math
from collections import Counter
from collections.abc import Callable
from itertools import repeat
from operator import eq
from pathlib import Path
from typing import Any

from fsmtrain.core.events import EVENT_KEYS, LEVELS
from fsmtrain.core.lifecycle import FINAL
from fsmtrain.core.log_file import EMPTY_PAYLOAD, LogLine, collector_paused, parse_line, typed_lines
from fsmtrain.tools.audit.ahead import AHEAD, Ahead, ReadAhead
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.checkpoints import CheckpointLines, SegmentChecks
from fsmtrain.tools.audit.cycles import COLUMNS, SAVING, WORDS, Cycler, Reader, line_keys
from fsmtrain.tools.audit.ending import best_epoch, budget_ended, completed_epochs, counted_epochs, ending_segment
from fsmtrain.tools.audit.files import verify_checkpoints
from fsmtrain.tools.audit.moves import PER_BATCH
from fsmtrain.tools.audit.segment import Segment
from fsmtrain.tools.audit.verdict import (
    BUDGET_REASONS,
    AuditReport,
    Explanation,
    Finding,
    SegmentInfo,
    Verdict,
    shown_epoch,
)

__all__ = ["Cycler", "LogAuditor", "Reader", "audit_file", "read_log"]

_CHAIN_KEYS = ("prev", "seal")  # a missing prev or seal is the chain's finding
_REQUIRED = frozenset(k for k in EVENT_KEYS if k not in _CHAIN_KEYS)
# given each move read from its typed line: its line's number, (phase, from, to, trigger), global_step, epoch and
# how many times it was made (by as many lines, each a step after the one before: a run of per-batch lines)
Mover = Callable[[int, tuple[str, ...], int, int, int], None]
_BATCH = ("transition", "debug", PER_BATCH[1], *PER_BATCH)  # a per-batch line's event, level, phase, from, to, trigger
_DEBUG, _STEP = LEVELS["debug"], PER_BATCH[0]
_FINAL = FINAL.value


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


class LogAuditor(SegmentChecks, ReadAhead):
    """Checks a log one line at a time (:meth:`feed_parsed`); :meth:`finish` runs the whole-file checks."""

    def __init__(self, path: Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
                 allow_missing: bool = False, reader: Reader | None = None, mover: Mover | None = None,
                 cycler: Cycler | None = None) -> None:
        self.path = path
        self.reader, self.mover, self.cycler = reader, mover, cycler
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

    def feed_block(self, n: int, block: list[bytes]) -> None:
        """Lines ``n``, ``n + 1``... (``block``), decoded in bulk (:func:`typed_lines`): a run of per-batch lines in
        one go where every line of it passes every check (:meth:`_batch_run`), whole epochs that repeat one that
        did (:meth:`_epochs_after`), any other line one at a time."""
        self._block_no += 1
        typed = typed_lines(block)
        keys = line_keys(typed)
        i, size = 0, len(block)
        while i < size:
            seg = self.seg
            base, is_batch = i, None  # None: no per-batch line here, or none can pass
            if seg is not None and seg.min_level <= _DEBUG and (batch := (*_BATCH, seg.run_id, EMPTY_PAYLOAD)) in keys:
                is_batch = [*map(eq, keys[i:], repeat(batch)), False]
            while i < size and self.seg is seg:  # a run_start opens another segment: its run id may differ
                if is_batch is None or not is_batch[i - base]:
                    rec = typed[i]
                    self._feed(n + i, block[i], rec)
                    i += 1
                    if rec is not None and rec.event == "epoch" and self.seg is seg:  # whole epochs may follow
                        i += self._epochs_after(n, i, block, typed, keys)
                    continue
                end = is_batch.index(False, i - base) + base  # at most size: is_batch ends with False
                if not self._batch_run(n + i, block[i:end], typed[i:end]):
                    for j in range(i, end):
                        self._feed(n + j, block[j], typed[j])
                i = end

    def _feed(self, n: int, raw: bytes, rec: LogLine | None) -> None:
        if rec is None:
            self.feed_parsed(n, raw, None)
        else:
            self.feed_typed(n, raw, rec)

    def feed_typed(self, n: int, raw: bytes, rec: LogLine) -> None:
        """Line ``n`` (``rec``: as :func:`typed_lines` read it): a move taken from its fields where it can be,
        any other line parsed (:meth:`feed_parsed`)."""
        if rec.event != "transition" or rec.payload != EMPTY_PAYLOAD or not self._move_line(n, raw, rec):
            self.feed_parsed(n, raw, None)

    def _batch_run(self, n: int, lines: list[bytes], recs: list[LogLine | None]) -> bool:
        """Lines ``n``, ``n + 1``... (``lines``, each a per-batch move of this run, ``recs`` as typed) checked as
        :meth:`_move_line` would one at a time, when each passes every check; False, with nothing changed, else."""
        seg, prev_seq = self.seg, self.prev_seq
        if (seg is None or seg.result_line is not None or seg.phase != _STEP or prev_seq is None
                or (seg.stop is not None and seg.stop.immediate)):
            return False
        seqs, ts, epochs, steps, prevs = (list(map(column, recs)) for column in COLUMNS)
        size, first = len(lines), steps[0]
        if (seqs != list(range(prev_seq + 1, prev_seq + 1 + size)) or first < seg.global_step
                or steps != list(range(seg.step_prev + 1, seg.step_prev + 1 + size))
                or epochs[0] != seg.next_epoch or epochs.count(epochs[0]) != size
                or ts[0] < self.last_ts or ts != sorted(ts)):
            return False
        every = seg.val_every
        if every is not None and (max(seg.validated_at, 0) // every + 1) * every <= steps[-1]:
            return False  # a validation is missed: said line by line
        if not self.chain.link_run(n, lines, prevs, seqs[-1]):
            return False
        last = n + size - 1
        if self.mover is not None:
            self.mover(n, WORDS[_BATCH[2:]], first, seg.next_epoch, size)
        self.prev_seq, self.last_ts, self.last_ts_line = seqs[-1], ts[-1], last
        seg.last_line, seg.last_epoch_field, seg.global_step = last, seg.next_epoch, steps[-1]
        seg.step_prev = steps[-1]
        seg.batch_lines += size
        self.batch_moves += size
        return True

    def _move_line(self, n: int, raw: bytes, rec: LogLine) -> bool:
        """A move line (``rec``, with an empty payload) that passes every line check of :meth:`feed_parsed`, taken
        from its fields; False, with nothing changed, for any other (it is then parsed)."""
        seg, seq, ts, step, dst = self.seg, rec.seq, rec.ts, rec.global_step, rec.to
        if (seg is None or seg.result_line is not None or seq != self.prev_seq + 1  # type: ignore[operator]
                or ts < self.last_ts or step < seg.global_step or dst == _FINAL or rec.run_id != seg.run_id
                or (seg.min_level and LEVELS.get(rec.level, 99) < seg.min_level)):
            return False
        src, trig, epoch = rec.from_, rec.trigger, rec.epoch
        if src is None or dst is None or trig is None:
            return False  # not a move as the writer writes one: parsed, as such a line is
        raw_words = (rec.phase, src, dst, trig)
        words = WORDS.get(raw_words, raw_words)
        if self.mover is not None:
            self.mover(n, words, step, epoch, 1)
        self.prev_seq = seq
        self.chain.link(n, raw, rec.prev, seq, words[0] == SAVING)
        self.last_ts, self.last_ts_line = ts, n
        seg.last_line, seg.last_epoch_field, seg.global_step = n, epoch, step
        if not (raw_words == _BATCH[2:] and self._batch(n, step, epoch, seg)):
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
        self.chain.link(n, raw, rec.get("prev"), rec.get("seq"), rec.get("phase") == SAVING, rec)

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
        with collector_paused():
            return self._finish()

    def _finish(self) -> AuditReport:
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
        counted = counted_epochs(self.segments)
        ex.epochs_completed = completed_epochs(self.segments, counted)
        ex.last_epoch = seg.next_epoch - 1 if seg.next_epoch > 0 else None
        ex.stop_reason = seg.end_reason
        ex.train_end_line = seg.end_line
        if seg.stop is not None:
            ex.stop_source, ex.stop_message = seg.stop.source, seg.stop.message
            ex.stop_request_line, ex.stop_epoch = seg.stop.line, seg.stop.epoch
        elif seg.end_reason in BUDGET_REASONS:
            ex.stop_source, ex.stop_message = budget_ended(ending_segment(self.segments))[1:]
            ex.stop_epoch = seg.next_epoch - 1
        best = best_epoch(self.segments, counted)
        if best is not None:
            ex.best_val_loss, ex.best_epoch, ex.best_line = best


def audit_file(path: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
               allow_missing: bool = False, ahead: Ahead | None = AHEAD) -> AuditReport:
    """Audit ``path`` (an ``events.jsonl``); ``key`` verifies a keyed chain; ``allow_missing``: a
    committed checkpoint file that is gone is a warning; ``ahead`` as :func:`read_log`.
    :class:`AuditReadError` if it is unreadable."""
    with collector_paused():  # (until what was read is let go: a long log's is millions of objects, and no cycles)
        return read_log(path, verify_checkpoints=verify_checkpoints, key=key, allow_missing=allow_missing,
                        ahead=ahead).finish()


def read_log(path: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None,
             allow_missing: bool = False, reader: Reader | None = None, mover: Mover | None = None,
             cycler: Cycler | None = None, ahead: Ahead | None = AHEAD) -> LogAuditor:
    """A :class:`LogAuditor` fed every line of ``path``, not yet finished; ``reader`` is given each parsed
    line too, ``mover`` each move read from its typed fields, ``cycler`` whole epochs checked together (their
    moves and epoch records, which then reach neither): the report reads the log in the audit's pass.
    ``ahead``: when a second process reads a long log's second half (None: never)."""
    auditor = LogAuditor(Path(path), verify_checkpoints=verify_checkpoints, key=key, allow_missing=allow_missing,
                         reader=reader, mover=mover, cycler=cycler)
    with collector_paused():
        auditor.lines = auditor.read_file(ahead)
    return auditor
