"""Audit a run's ``events.jsonl`` against the lifecycle, and explain the run.

``fsmtrain audit EVENTS.jsonl [--json] [--strict] [--key-file F]`` streams the log line by line (a
million lines take seconds) and checks:

- the hash chain: every line carries the digest of the line before it (the first, of the run id and
  config); with a key (``--key-file``, or ``FSMTRAIN_LOG_KEY``) HMAC-SHA256. The first line that
  breaks it is named; a wrong key is told apart from tampering (see :mod:`pipeline.tools.audit.chain`);
- every line is a JSON object with the fields of :data:`pipeline.core.events.EVENT_KEYS`;
- ``seq`` runs contiguous from 0: a gap is a lost line, a repeat a duplicated or altered one;
  ``ts`` never goes back; ``global_step`` never goes back within a process;
- every transition is a move of :data:`pipeline.core.lifecycle.TRANSITIONS` from the phase the previous
  one reached, and its guards held given what the log says (stop requests, epochs, faults); every
  other event happens in the phase the machine is in; no line is below the run's configured level;
- the run starts in ``created`` and ends in ``train_end`` (else: an unfinished run, with its last
  phase and epoch); epochs count up from the run's ``start_epoch`` without gaps, as many as began;
  each epoch's ``batches`` agrees with the global steps (and the per-batch lines at debug level);
  ``max_epochs`` agrees with the recorded config; slot values have the types their slots declare;
- the stop reason agrees with the events: the request in force, a non-finite loss for NAN, the
  matching request for EARLY_STOP / PRUNED, the last epoch for COMPLETED, an exception for ERROR /
  INTERRUPTED; the stop source and message in ``train_end`` and ``result`` are those of the
  ``stop_request``; the ``result`` figures are recomputed from the epoch events;
- each checkpoint the log names has the logged sha256, and pins a head of this chain (in its event
  and in the file): see :mod:`pipeline.tools.audit.files`;
- a resume (a later ``run_start`` with ``resumed_from``) starts at an epoch the log reached.

Exit codes: 0 the log holds, 1 violations (also warnings with ``--strict``), 2 the file (or the key
file) cannot be read. Phases and moves come only from :mod:`pipeline.core.lifecycle`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from json.scanner import make_scanner
from pathlib import Path
from typing import Any, cast

from pipeline.core.events import EVENT_KEYS, LEVELS
from pipeline.core.lifecycle import BATCH, FINAL, INITIAL, TRANSITIONS, Facts, Phase, Transition
from pipeline.tools.audit.chain import ChainCheck
from pipeline.tools.audit.content import number, slot_checks
from pipeline.tools.audit.coverage import CheckpointAccount, Damaged
from pipeline.tools.audit.ending import EndingChecks, Segment, best_epoch, completed_epochs
from pipeline.tools.audit.files import CheckpointWrite, verify_checkpoints
from pipeline.tools.audit.verdict import (
    AuditReadError,
    AuditReport,
    ChainVerdict,
    Explanation,
    Finding,
    SegmentInfo,
    Severity,
)

__all__ = [
    "AuditReadError",
    "AuditReport",
    "ChainVerdict",
    "Explanation",
    "Finding",
    "Severity",
    "audit_file",
]

_REQUIRED = frozenset(k for k in EVENT_KEYS if k != "prev")  # a missing prev is the chain's finding
_MOVES: Mapping[tuple[str, str, str], Transition] = {
    (t.source.value, t.dest.value, t.trigger): t for t in TRANSITIONS
}
_PHASES = frozenset(p.value for p in Phase)
_LOSSES = ("train_loss", "val_loss")
_STEP, _VAL, _EPOCH_BEGIN = Phase.TRAIN_STEP.value, Phase.VAL.value, Phase.EPOCH_BEGIN.value
_PER_BATCH = (_STEP, _STEP, BATCH)  # the internal move, one line per batch at debug level
_SLOTS = slot_checks()
_scan: Callable[[str, int], tuple[Any, int]] = make_scanner(cast(Any, json.JSONDecoder()))  # C scanner


def _loads(raw: bytes) -> Any:
    """``json.loads`` for one log line, without its per-call overhead (decode, then scan)."""
    text = raw.decode("utf-8")
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)  # leading whitespace or worse: let json say what is wrong
    if end != len(text) and not text[end:].isspace():
        return json.loads(text)
    return obj


def _is_nonfinite(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("NaN", "Infinity", "-Infinity")
    return isinstance(value, float) and not math.isfinite(value)


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


class _Auditor(EndingChecks):
    """Checks a log one line at a time; ``finish()`` runs the whole-file checks."""

    def __init__(self, path: Path, *, verify_checkpoints: bool = True, key: bytes | None = None) -> None:
        self.path = path
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
        self.phase_seconds: dict[str, float] = {}
        self.callback_seconds: dict[str, float] = {}
        self.ckpt_writes: dict[str, CheckpointWrite] = {}  # path -> its latest write
        self.ckpt_removed: dict[str, int] = {}  # path -> line of a later removal
        self.ckpt_damaged: dict[str, Damaged] = {}  # path -> the resume that moved it to damaged/
        self.account = CheckpointAccount(self.ex)
        self._guard_cache: dict[tuple[tuple[str, str, str], bool, bool, bool, bool], bool] = {}

    # --- per line ----------------------------------------------------------------------------
    def feed(self, n: int, raw: bytes) -> None:
        try:
            rec = _loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self.chain.link_unparsed(raw)
            cut = "" if raw.endswith(b"\n") else " (the line has no end: a truncated write?)"
            self.bad("json", f"not valid JSON: {exc}{cut}", n)
            return
        if type(rec) is not dict:
            self.chain.link_unparsed(raw)
            self.bad("json", f"expected a JSON object, found {type(rec).__name__}", n)
            return
        if not rec.keys() >= _REQUIRED:
            self.chain.link(n, raw, rec)
            missing = ", ".join(k for k in EVENT_KEYS if k not in rec and k != "prev")
            self.bad("fields", f"missing field(s) {missing}", n)
            return
        seq, event = rec["seq"], rec["event"]
        if type(seq) is not int or type(event) is not str or type(rec["payload"]) is not dict:
            self.chain.link(n, raw, rec)
            self.bad("fields", "seq must be an integer, event a string and payload an object", n)
            return
        in_order = self._seq_ok(n, seq, event, raw)
        if event == "run_start" and in_order:
            self.chain.segment(n, rec["payload"])
        self.chain.link(n, raw, rec)
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
            self._transition(n, rec, seg)
            return
        if rec["phase"] != seg.phase:
            self.bad("phase", f"{event!r} event says phase {rec['phase']!r}, but the last transition "
                     f"reached {seg.phase!r}", n)
        handler = _HANDLERS.get(event)
        if handler is not None:
            handler(self, n, rec, seg)

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
        if raw == self.chain.prev_raw:  # the chain has not taken this line yet: that is line n - 1
            self.bad("seq", f"duplicate of line {n - 1} (seq {seq} again)", n)
        else:
            self.bad("seq", f"seq {seq} after {prev}: a repeated or reordered line (expected {prev + 1})", n)
        return False

    def _open_segment(self, n: int, rec: Mapping[str, Any], payload: Mapping[str, Any]) -> Segment:
        max_epochs = payload.get("max_epochs")
        start_epoch = payload.get("start_epoch", 0)
        if type(max_epochs) is not int or type(start_epoch) is not int:
            self.bad("run_start", "run_start needs integer max_epochs and start_epoch in its payload", n)
            max_epochs = max_epochs if type(max_epochs) is int else 1 << 62
            start_epoch = start_epoch if type(start_epoch) is int else 0
        callbacks = payload.get("callbacks")
        names = [c.get("name", "?") for c in callbacks if isinstance(c, dict)] if isinstance(callbacks, list) else []
        resumed = payload.get("resumed_from")
        seg = Segment(n, str(rec.get("run_id")), max_epochs, start_epoch,
                      None if resumed is None else str(resumed), names)
        config = payload.get("config")
        if isinstance(config, dict):
            level = config.get("log_level")
            seg.min_level = LEVELS.get(level, 0) if isinstance(level, str) else 0
            epochs = config.get("epochs")
            if type(epochs) is int and epochs != max_epochs:
                self.bad("run_start", f"max_epochs={max_epochs}, but the recorded config says epochs={epochs}", n)
        seg.next_epoch = start_epoch
        seg.last_line = n
        step = rec.get("global_step")
        seg.global_step = step if type(step) is int else 0
        self.segments.append(seg)
        self.seg = seg
        if self.ex.run_id is None:
            self.ex.run_id = seg.run_id
            rank, world = payload.get("rank"), payload.get("world_size")
            if type(rank) is int and type(world) is int:  # one rank of a multi-process run
                self.ex.rank, self.ex.world_size = rank, world
        return seg

    def _run_start(self, n: int, rec: Mapping[str, Any]) -> None:
        payload = rec["payload"]
        if self.first_ts is None and isinstance(rec["ts"], (int, float)):
            self.first_ts = float(rec["ts"])
        if rec["phase"] not in (None, INITIAL.value):
            self.bad("start", f"run_start in phase {rec['phase']!r}; a run starts in {INITIAL.value!r}", n)
        prev = self.seg
        seg = self._open_segment(n, rec, payload)
        if prev is None:
            return
        restart = seg.resumed_from is None
        if restart:
            self.account.second_start(n, seg)  # a restart, if its restart event follows; else two runs
        if prev.end_line is None:
            self.warn("resume", f"the run before this {'restart' if restart else 'resume'} never reached train_end "
                      f"(last line {prev.last_line}, phase {prev.phase!r}, epoch {prev.next_epoch}): the process was "
                      "killed", n)
        if restart:
            return
        ckpt = self._checkpoint_named(seg.resumed_from)
        if (ckpt is not None and ckpt.epoch == prev.next_epoch and seg.start_epoch == ckpt.epoch + 1
                and prev.end_line is None and ckpt.line > prev.first_line):
            # Killed between committing the epoch's checkpoint and logging its epoch event: the
            # epoch is done (the checkpoint holds it), but the log never got its figures.
            seg.unlogged.add(ckpt.epoch)
            self.warn("resume", f"epoch {ckpt.epoch} was committed by its checkpoint (line {ckpt.line}), but the "
                      "process was killed before it logged the epoch: its figures are not in the log", n)
        elif seg.start_epoch > prev.next_epoch:
            self.bad("resume", f"resume starts at epoch {seg.start_epoch}, but the log only reached epoch "
                     f"{prev.next_epoch}", n)
        if ckpt is not None and ckpt.epoch is not None and seg.start_epoch != ckpt.epoch + 1:
            self.bad("resume", f"resume from {seg.resumed_from} (epoch {ckpt.epoch}, line {ckpt.line}) must start at "
                     f"epoch {ckpt.epoch + 1}, starts at {seg.start_epoch}", n)

    def _checkpoint_named(self, resumed_from: str | None) -> CheckpointWrite | None:
        if resumed_from is None:
            return None
        for path, info in self.ckpt_writes.items():
            if resumed_from == path or (Path(resumed_from).name == Path(path).name and
                                        Path(resumed_from).parent.name == Path(path).parent.name):
                return info
        return None

    def _transition(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        src, dst, trig = rec["from"], rec["to"], rec["trigger"]
        key = (src, dst, trig)
        step = rec["global_step"]
        if (key == _PER_BATCH and seg.phase == _STEP and rec["epoch"] == seg.next_epoch and rec["phase"] == _STEP
                and (seg.stop is None or not seg.stop.immediate)):
            # The common line of a debug log: one per batch. Its guard holds unless an immediate stop.
            self.batch_moves += 1
            seg.batch_lines += 1
            if step != seg.step_prev + 1:
                self.bad("global_step", f"a batch at global_step {step}, expected {seg.step_prev + 1} (one step after "
                         "the line before): a batch line inserted or removed", n)
            if type(step) is int:
                seg.step_prev = step
            return
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
        if type(step) is int:
            if dst == _EPOCH_BEGIN:
                seg.epoch_starts += 1
                seg.step_begin = seg.step_prev = step
                seg.step_val = None
                seg.batch_lines = 0
                self.chain.new_epoch()
            elif dst == _VAL:
                if seg.batch_lines and step != seg.step_prev + 1:
                    self.bad("global_step", f"validation begins at global_step {step}, expected {seg.step_prev + 1} "
                             "(one step after the last batch line)", n)
                seg.step_val = step
        if dst == FINAL.value and src != dst:
            self._train_end(n, rec, seg)

    def _facts(self, seg: Segment, has_batch: bool) -> Facts:
        stop = seg.stop
        return Facts(stop is not None, stop is not None and stop.immediate, seg.next_epoch < seg.max_epochs,
                     has_batch, seg.faulted)

    def _guards_hold(self, key: tuple[str, str, str], move: Transition, seg: Segment) -> bool:
        stop = seg.stop
        ck = (key, stop is not None, stop is not None and stop.immediate, seg.next_epoch < seg.max_epochs,
              seg.faulted)
        hit = self._guard_cache.get(ck)
        if hit is None:
            # ``has_batch`` is not in the log: the move is fine if it holds for either value.
            hit = self._guard_cache[ck] = any(move.enabled(self._facts(seg, hb)) for hb in (False, True))
        return hit

    def _guard_message(self, move: Transition, seg: Segment) -> str:
        stop = seg.stop
        state = (f"stop requested: {stop.reason} (line {stop.line}{', immediate' if stop.immediate else ''})"
                 if stop else "no stop requested")
        return (f"{move.source.value} -> {move.dest.value} ({move.trigger}) needs [{move.guard_label()}], "
                f"which did not hold: {state}, epoch {seg.next_epoch} of max_epochs={seg.max_epochs}"
                f"{', faulted' if seg.faulted else ''}")

    # --- other events ------------------------------------------------------------------------
    def _epoch(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
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
            x = number(val) if type(val) is not bool else None
            seg.vals.append((math.nan if x is None else x, n))
        else:
            seg.vals.append((math.nan, n))
        self._batches(n, rec, seg)
        slots = p.get("slots")
        if isinstance(slots, dict):
            for name, value in slots.items():
                check = _SLOTS.get(name)
                if check is not None and not check[0](value):
                    self.bad("slot", f"slot {name!r} is {value!r}; it is declared as {check[1]}", n)
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

    def _batches(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """The epoch's ``batches`` against the global steps it took (and its per-batch lines)."""
        batches, begin, val = rec["payload"].get("batches"), seg.step_begin, seg.step_val
        if type(batches) is not int or begin is None or val is None:
            return
        if val - begin != batches:
            self.bad("batches", f"the epoch says {batches} batches, but global_step went from {begin} to {val} in it",
                     n)
        elif seg.batch_lines and seg.batch_lines != batches - 1:
            self.bad("batches", f"the epoch says {batches} batches, but {seg.batch_lines} per-batch lines were logged "
                     f"(expected {batches - 1})", n)
        elif rec["global_step"] != val:
            self.bad("global_step", f"the epoch event says global_step {rec['global_step']}, validation began at {val}",
                     n)

    def _exception(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        if seg.end_line is not None:
            return  # a teardown failure after train_end, logged for people
        seg.faulted = True
        if seg.exception is None:
            seg.exception = dict(rec["payload"])
            seg.exception_line = n

    def _warning(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        source = str(p.get("source", "?"))
        self.ex.warning_counts[source] = self.ex.warning_counts.get(source, 0) + 1
        if len(self.ex.warnings) < 100:
            self.ex.warnings.append({"line": n, "epoch": rec["epoch"], "source": source,
                                     "message": str(p.get("message", ""))})

    def _checkpoint(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        path, sha = p.get("path"), p.get("sha256")
        if not isinstance(path, str) or not isinstance(sha, str):
            self.bad("checkpoint", "a checkpoint event needs string path and sha256", n)
            return
        head = p.get("chain_head")
        if head is not None and not isinstance(head, str):
            self.bad("checkpoint", f"chain_head must be a digest string, found {head!r}", n)
            head = None
        if head is not None and self.chain.verifying:
            pinned = self.chain.pinned_line(head)
            if pinned is None:
                self.bad("checkpoint", f"checkpoint {path} pins chain head {head[:12]}..., which is the digest of no "
                         "line logged since the previous epoch began (nor of an epoch's end since the last commit): "
                         "the lines before it were altered after the checkpoint was committed", n)
            else:
                self.chain.pinned(pinned)
        epoch = p.get("epoch")
        self.ckpt_writes[path] = CheckpointWrite(sha, n, epoch if type(epoch) is int else None, head)
        self.ckpt_removed.pop(path, None)
        self.ckpt_damaged.pop(path, None)
        self.account.committed(n, epoch if type(epoch) is int else None, path, seg)

    def _checkpoint_removed(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        path = rec["payload"].get("path")
        if isinstance(path, str):
            self.ckpt_removed[path] = n

    def _checkpoint_skipped(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        self.account.skipped(n, rec, seg)

    def _checkpoint_damaged(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        self.account.damaged(n, rec, self.ckpt_writes, self.ckpt_damaged)

    def _checkpoint_settings(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        self.account.settings(rec, seg)

    def _restart(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        standing = [p for p in self.ckpt_writes if p not in self.ckpt_removed and p not in self.ckpt_damaged]
        self.account.restart(n, rec, seg, standing)

    def _trial_report(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        seg.last_trial_report = (bool(rec["payload"].get("should_prune")), n)

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
                where = self.lines if last else seg.last_line  # where the result should have been
                self.bad("end", f"no result event after train_end (line {seg.end_line})", where)
                self._stop_said(seg, None)
            open_epochs = seg.epoch_starts - seg.epochs
            if open_epochs < 0 or open_epochs > 1:
                self.bad("epochs", f"{seg.epoch_starts} epoch(s) began but {seg.epochs} epoch event(s) were logged "
                         f"between line {seg.first_line} and line {seg.last_line}", seg.last_line)
        self.findings += self.chain.finish()
        self.findings += self.account.finish(self.segments)
        if self.verify_checkpoints:
            self.findings += verify_checkpoints(self.path, self.ckpt_writes, self.ckpt_removed, self.chain,
                                                self.segments, self.lines, self.ex, self.ckpt_damaged)
        # By line; on one line the chain's finding first: it says whether the line is what was written.
        self.findings.sort(key=lambda f: (0 if f.line is None else f.line, f.check not in ("chain", "key")))
        self._fill_explanation()
        return AuditReport(str(self.path), self.lines, self.findings, self.ex, self.chain.verdict,
                           self._segment_infos())

    def _segment_infos(self) -> list[SegmentInfo]:
        chains = {c.first_line: c for c in self.chain.segments}
        out = []
        for seg in self.segments:
            c = chains.get(seg.first_line)
            out.append(SegmentInfo(seg.first_line, seg.last_line, seg.start_epoch, seg.epochs, seg.resumed_from,
                                   seg.end_reason, c.scheme if c else None, c.key_id if c else None,
                                   c.verified if c else False))
        return out

    def _fill_explanation(self) -> None:
        ex = self.ex
        ex.segments = len(self.segments)
        if self.batch_moves:
            self.moves[_PER_BATCH] += self.batch_moves
        ex.moves = {f"{s}->{d} ({t})": c for (s, d, t), c in self.moves.items()}
        ex.phase_seconds = dict(self.phase_seconds)
        ex.callback_seconds = dict(self.callback_seconds)
        if not self.segments:
            return
        seg = self.segments[-1]
        ex.max_epochs = seg.max_epochs
        ex.epochs_completed = completed_epochs(self.segments)
        ex.last_epoch = seg.next_epoch - 1 if seg.next_epoch > 0 else None
        ex.stop_reason = seg.end_reason
        ex.train_end_line = seg.end_line
        if seg.stop is not None:
            ex.stop_source, ex.stop_message = seg.stop.source, seg.stop.message
            ex.stop_request_line, ex.stop_epoch = seg.stop.line, seg.stop.epoch
        elif seg.end_reason == "completed":
            ex.stop_source, ex.stop_message = "max_epochs", f"reached max_epochs={seg.max_epochs}"
            ex.stop_epoch = seg.next_epoch - 1
        best = best_epoch(self.segments)
        if best is not None:
            ex.best_val_loss, ex.best_epoch, ex.best_line = best


_HANDLERS = {
    "epoch": _Auditor._epoch,
    "stop_request": _Auditor._stop_request,
    "exception": _Auditor._exception,
    "warning": _Auditor._warning,
    "checkpoint": _Auditor._checkpoint,
    "checkpoint_removed": _Auditor._checkpoint_removed,
    "checkpoint_skipped": _Auditor._checkpoint_skipped,
    "checkpoint_damaged": _Auditor._checkpoint_damaged,
    "checkpoint_settings": _Auditor._checkpoint_settings,
    "restart": _Auditor._restart,
    "trial_report": _Auditor._trial_report,
    "result": _Auditor._result,
}


def audit_file(path: str | Path, *, verify_checkpoints: bool = True, key: bytes | None = None) -> AuditReport:
    """Audit ``path`` (an ``events.jsonl``); ``key`` verifies a keyed (HMAC) chain. Raises
    :class:`AuditReadError` if it cannot be read."""
    p = Path(path)
    auditor = _Auditor(p, verify_checkpoints=verify_checkpoints, key=key)
    try:
        fh = open(p, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise AuditReadError(f"cannot read {p}: {exc.strerror or exc}") from exc
    with fh:
        try:
            feed = auditor.feed
            n = 0
            for n, raw in enumerate(fh, 1):
                feed(n, raw)
            auditor.lines = n
        except OSError as exc:
            raise AuditReadError(f"cannot read {p}: {exc.strerror or exc}") from exc
    return auditor.finish()
