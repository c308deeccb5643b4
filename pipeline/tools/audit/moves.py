"""The lines inside a run, mixed into the auditor: each move is one of the lifecycle table's from
the phase the run is in, whose guards held given what the log says; epochs (losses, batches, slots,
timings), exceptions, warnings and the pruner's reports."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import Any

from fsmtrain.core import slots as _slots_module
from fsmtrain.core.context import Slot, epoch_number
from fsmtrain.core.lifecycle import (
    ABORT,
    FINAL,
    PROGRAM,
    TRANSITIONS,
    Action,
    Facts,
    Phase,
    Transition,
    enabled_transition,
)
from fsmtrain.core.log_file import by_name
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.ending import PHASES, EndingChecks, as_int, number
from fsmtrain.tools.audit.segment import Segment
from fsmtrain.tools.audit.verdict import Explanation, shown_epoch

__all__ = ["PER_BATCH", "RECORDED", "MoveChecks", "allowed_steadily", "record_columns"]

_MOVES: Mapping[tuple[str, str, str], Transition] = {
    (t.source.value, t.dest.value, t.trigger): t for t in TRANSITIONS
}
_PER_BATCH_MOVE = next(t for t in TRANSITIONS if t.internal)  # one line per batch, at debug level
PER_BATCH = (_PER_BATCH_MOVE.source.value, _PER_BATCH_MOVE.dest.value, _PER_BATCH_MOVE.trigger)
_STEP, _VAL, _EPOCH_BEGIN, _FINAL = PER_BATCH[0], Phase.VAL.value, Phase.EPOCH_BEGIN.value, FINAL.value

_LOSSES = ("train_loss", "val_loss")
# The phase whose last step writes the ``epoch`` event.
_RECORD_PHASE = next(s.phase for s in PROGRAM if s.name == Action.RECORD_EPOCH.value).value


Check = Callable[[Any], bool]
# a check of a JSON value, what it expects, and the types whose every value passes it (a column of them at once)
_SCALARS: dict[Any, tuple[Check, str, frozenset[type]]] = {
    float: (lambda v: number(v) is not None, "a number", frozenset({int, float})),
    int: (lambda v: type(v) is int, "an integer", frozenset({int})),
    bool: (lambda v: type(v) is bool, "true or false", frozenset({bool})),
    str: (lambda v: type(v) is str, "a string", frozenset({str})),
}


def _check_for(tp: Any) -> tuple[Check, str, frozenset[type]] | None:
    """A check of a JSON value of declared type ``tp``, as :data:`_SCALARS` (None: not checkable)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _check_for(hints[f.name]) for f in dataclasses.fields(tp)}

        def check(v: Any) -> bool:
            return (type(v) is dict and v.keys() == fields.keys()
                    and all(c is None or c[0](v[k]) for k, c in fields.items()))
        said = ", ".join(f"{k} ({c[1] if c else getattr(hints[k], '__name__', hints[k])})" for k, c in fields.items())
        return check, f"an object with {said}", frozenset()
    return None


# For each slot :mod:`fsmtrain.core.slots` declares as ``NAME: Slot[T] = Slot("name")``: its check against ``T``.
_SLOTS = {slot.name: check for attr, hint in typing.get_type_hints(_slots_module).items()
          if isinstance(slot := getattr(_slots_module, attr, None), Slot) and typing.get_origin(hint) is Slot
          and (check := _check_for(typing.get_args(hint)[0])) is not None}


def _facts(seg: Segment, step: Any) -> tuple[bool, bool, bool, bool, bool]:
    """The table's facts but ``has_batch`` (not in the log), as the log says them at ``step``."""
    stop, counted = seg.stop, type(step) is int
    remain = seg.next_epoch < seg.max_epochs and (seg.max_steps is None or not counted or step < seg.max_steps)
    due = seg.val_every is not None and counted and step % seg.val_every == 0 and step != seg.validated_at
    return stop is not None, stop is not None and stop.immediate, remain, seg.faulted, due


@functools.cache
def _allowed(key: tuple[str, str, str], stop: bool, immediate: bool, remain: bool, faulted: bool, due: bool) -> bool:
    """Whether the table allows the move ``key`` given the facts, with or without a next batch."""
    move = _MOVES[key]
    for facts in (Facts(stop, immediate, remain, has_batch, faulted, due) for has_batch in (False, True)):
        if move.enabled(facts) if move.trigger == ABORT else enabled_transition(move.source, facts) is move:
            return True  # abort is not an ordinary move: it needs its own guard only
    return False


def allowed_steadily(key: tuple[str, str, str]) -> bool:
    """Whether ``key`` is a move of the table that its guards allow in an epoch of a run that goes on: no stop,
    no fault, epochs and steps left, no validation due inside the epoch."""
    return key in _MOVES and _allowed(key, False, False, True, False, False)


RECORDED = ("metrics", "slots", "phase_seconds", "callback_seconds", "seconds")
_SUMMED = ("phase_seconds", "callback_seconds", "seconds")


def record_columns(payloads: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """What ``epoch`` lines' payloads record, by field and then name (a number's own name: ``seconds``); a field
    is left out where the payloads do not all hold the same names there (and some hold a mapping there)."""
    columns = {field: cols for field in RECORDED[:-1] if (cols := by_name([p.get(field) for p in payloads]))
               is not None}
    columns["seconds"] = {"seconds": [p.get("seconds") for p in payloads]}
    return columns


def _finite(col: list[Any] | None) -> bool:
    """No loss in ``col`` (None: none logged) is other than a finite float."""
    return col is None or (set(map(type, col)) == {float} and math.isfinite(sum(col)))


def _plain(col: list[Any]) -> bool:
    """Every value of ``col`` is an int or a float (not a bool): summed as they are."""
    return set(map(type, col)) <= {int, float}


class MoveChecks(EndingChecks):
    """Needs the auditor's ``chain``, ``ex``, ``moves`` and ``batch_moves``."""

    chain: ChainCheck
    ex: Explanation
    moves: Counter[tuple[str, str, str]]
    batch_moves: int

    def _transition(self, n: int, seg: Segment, src: Any, dst: Any, trig: Any, epoch: Any, step: Any,
                    phase: Any) -> bool:
        """Checks a move; True when it reached the end (its ``train_end`` is checked then)."""
        key = (src, dst, trig)
        if key == PER_BATCH and phase == _STEP and self._batch(n, step, epoch, seg):
            return False
        if src != dst:
            seg.moves.append((str(trig), str(src), str(dst), epoch if type(epoch) is int else 0))
        move = _MOVES.get(key)
        if move is None:
            self.bad("transition", f"{src} -> {dst} ({trig}) is not a move of the lifecycle table", n)
            if isinstance(dst, str) and dst in PHASES:
                seg.phase = dst
            return False
        self.moves[key] += 1
        if src != seg.phase:
            self.bad("transition", f"{src} -> {dst} ({trig}) leaves {src!r}, but the run is in {seg.phase!r}", n)
        elif not _allowed(key, *_facts(seg, step)):
            self.bad("guard", self._guard_message(move, seg), n)
        if seg.val_every is not None and type(step) is int:
            self._validations(n, src, dst, trig, step, seg)
        if epoch != seg.next_epoch:
            self.bad("epoch", f"transition in epoch {shown_epoch(epoch)}, but the run is in epoch "
                     f"{epoch_number(seg.next_epoch)}", n)
        if phase != dst:
            self.bad("phase", f"transition to {dst!r} says phase {phase!r}", n)
        seg.phase = dst
        if type(step) is int:
            if dst == _EPOCH_BEGIN:
                if not (seg.resumed_batch and epoch == seg.start_epoch):  # a resume inside keeps its own
                    seg.validated_at = step  # the last epoch's end validated there
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
        return bool(dst == _FINAL and src != dst)

    def _batch(self, n: int, step: Any, epoch: Any, seg: Segment) -> bool:
        """The common line of a debug log, one per batch: its guard holds unless an immediate stop."""
        if seg.phase != _STEP or epoch != seg.next_epoch or (seg.stop is not None and seg.stop.immediate):
            return False
        if seg.val_every is not None:
            self._missed(n, step, seg, inclusive=True)
        self.batch_moves += 1
        seg.batch_lines += 1
        if step != seg.step_prev + 1:
            self.bad("global_step", f"a batch at global_step {step}, expected {seg.step_prev + 1} (one step after "
                     "the line before): a batch line inserted or removed", n)
        if type(step) is int:
            seg.step_prev = step
        return True

    def _validations(self, n: int, src: str, dst: str, trig: str, step: int, seg: Segment) -> None:
        """With val_every_n_steps: a validation at every due step, each with its line."""
        if src == _VAL and seg.val_open and trig != ABORT and dst != _FINAL:
            self.bad("validation", f"validation {seg.validations + 1} (epoch {epoch_number(seg.next_epoch)}, step "
                     f"{step}) has no validation line", n)
        seg.val_open = dst == _VAL and src != dst
        if dst in (_VAL, _FINAL) and src != dst:
            self._missed(n, step, seg, inclusive=False)

    def _missed(self, n: int, step: int, seg: Segment, *, inclusive: bool) -> None:
        """A step val_every_n_steps made due (before ``step``, or at it) that has no validation."""
        every = seg.val_every
        if every is None or type(step) is not int:
            return
        due = (max(seg.validated_at, 0) // every + 1) * every
        if due < step or (inclusive and due == step):
            self.bad("validation", f"no validation at global_step {due} (val_every_n_steps={every}; the last was at "
                     f"step {seg.validated_at}): a mid-epoch validation missing", n)
            seg.validated_at = due  # said once

    def _on_validation(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        count, step = rec["payload"].get("validation"), rec["global_step"]
        if seg.val_every is None or not seg.val_open or type(count) is not int or count != seg.validations + 1:
            self.bad("validation", f"validation line {count!r} at global_step {step}, expected "
                     + (f"validation {seg.validations + 1} once, inside a validation" if seg.val_every is not None
                        else "none: run_start sets no val_every_n_steps"), n)
        seg.val_open = False
        seg.validations = count if type(count) is int else seg.validations + 1
        if type(step) is int:
            seg.validated_at = step

    def _guard_message(self, move: Transition, seg: Segment) -> str:
        stop = seg.stop
        state = (f"stop requested: {stop.reason} (line {stop.line}{', immediate' if stop.immediate else ''})"
                 if stop else "no stop requested")
        return (f"{move.source.value} -> {move.dest.value} ({move.trigger}) needs [{move.guard_label()}], "
                f"which did not hold: {state}, epoch {epoch_number(seg.next_epoch)} of max_epochs={seg.max_epochs}"
                f"{', faulted' if seg.faulted else ''}")

    def _on_epoch(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        epoch = rec["epoch"]
        if seg.phase != _RECORD_PHASE:
            return  # already reported as a phase mismatch
        if epoch != seg.next_epoch:
            if type(epoch) is int and epoch > seg.next_epoch:
                shown = range(epoch_number(seg.next_epoch), epoch_number(min(epoch, seg.next_epoch + 5)))
                missing = ", ".join(map(str, shown))
                self.bad("epochs", f"epoch {epoch_number(epoch)} follows epoch {epoch_number(seg.next_epoch - 1)}: "
                         f"epoch(s) {missing} missing", n)
            else:
                self.bad("epochs", f"epoch {shown_epoch(epoch)} again or out of order (expected "
                         f"{epoch_number(seg.next_epoch)})", n)
        self._batches(n, rec, seg)
        self._epoch_record(n, rec["payload"], seg)

    def _epoch_record(self, n: int, p: Mapping[str, Any], seg: Segment) -> None:
        """What an ``epoch`` line (line ``n``, payload ``p``) of the run's next epoch records: its losses, slots and
        timings; then the run is past that epoch."""
        metrics = p.get("metrics")
        if not isinstance(metrics, dict):
            metrics = {}
        cur = seg.next_epoch
        for key in _LOSSES:
            x = number(metrics.get(key))
            if x is not None and not math.isfinite(x) and cur not in seg.nonfinite:
                seg.nonfinite[cur] = (n, key)
        x = number(metrics.get("val_loss"))
        seg.vals.append((math.nan if x is None else x, n))
        slots = p.get("slots")
        if isinstance(slots, dict):
            for name, value in slots.items():
                check = _SLOTS.get(name)
                if check is not None and not check[0](value):
                    self.bad("slot", f"slot {name!r} is {value!r}; it is declared as {check[1]}", n)
        for source, target in ((p.get("phase_seconds"), self.ex.phase_seconds),
                               (p.get("callback_seconds"), self.ex.callback_seconds)):
            if isinstance(source, dict):
                for k, v in source.items():
                    if isinstance(v, (int, float)):
                        target[k] = target.get(k, 0.0) + v
        seconds = p.get("seconds")
        if isinstance(seconds, (int, float)):
            self.ex.total_epoch_seconds += seconds
        seg.next_epoch = cur + 1
        seg.epochs += 1

    def _epoch_records(self, lines: list[int], payloads: Sequence[Mapping[str, Any]],
                       columns: dict[str, dict[str, list[Any]]], seg: Segment) -> None:
        """:meth:`_epoch_record` of the run's next epochs (their lines ``lines``, payloads ``payloads``, by column
        ``columns``: :func:`record_columns`): a column at a time where every epoch has the same names with plain
        values and there is nothing to say, else a line at a time (which says it)."""
        if (len(columns) < len(RECORDED) or not all(map(_finite, map(columns["metrics"].get, _LOSSES)))
                or not all(set(map(type, col)) <= _SLOTS[k][2] or all(map(_SLOTS[k][0], col))
                           for k, col in columns["slots"].items() if k in _SLOTS)
                or not all(_plain(col) for field in _SUMMED for col in columns[field].values())):
            for n, p in zip(lines, payloads, strict=True):
                self._epoch_record(n, p, seg)
            return
        val = columns["metrics"].get("val_loss")
        seg.vals.extend(zip(repeat(math.nan) if val is None else val, lines, strict=False))
        ex = self.ex
        for name, target in (("phase_seconds", ex.phase_seconds), ("callback_seconds", ex.callback_seconds)):
            for k, col in columns[name].items():  # each summed in the lines' order, as one line at a time does
                target[k] = functools.reduce(operator.add, col, target.get(k, 0.0))
        ex.total_epoch_seconds = functools.reduce(operator.add, columns["seconds"]["seconds"], ex.total_epoch_seconds)
        seg.next_epoch += len(lines)
        seg.epochs += len(lines)

    def _batches(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        """The epoch's ``batches`` against the global steps it took (and its per-batch lines)."""
        batches, begin, val = rec["payload"].get("batches"), seg.step_begin, seg.step_val
        if type(batches) is not int or begin is None or val is None:
            return
        if val - begin != batches - (seg.resumed_batch if rec["epoch"] == seg.start_epoch else 0):  # resumed inside
            self.bad("batches", f"the epoch says {batches} batches, but global_step went from {begin} to {val} in it",
                     n)
        elif seg.batch_lines and seg.batch_lines != batches - 1:
            self.bad("batches", f"the epoch says {batches} batches, but {seg.batch_lines} per-batch lines were logged "
                     f"(expected {batches - 1})", n)
        elif rec["global_step"] != val:
            self.bad("global_step", f"the epoch event says global_step {rec['global_step']}, validation began at {val}",
                     n)

    def _on_exception(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        seg.failed_rank = as_int(rec["payload"].get("failed_rank"))
        if seg.end_line is not None:
            return  # a teardown failure after train_end, logged for people
        seg.faulted = True
        if seg.exception is None:
            seg.exception = dict(rec["payload"])
            seg.exception_line = n

    def _on_warning(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        p = rec["payload"]
        source = str(p.get("source", "?"))
        self.ex.warning_counts[source] = self.ex.warning_counts.get(source, 0) + 1
        if len(self.ex.warnings) < 100:
            self.ex.warnings.append({"line": n, "epoch": rec["epoch"], "source": source,
                                     "message": str(p.get("message", ""))})

    def _on_trial_report(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        seg.last_trial_report = (bool(rec["payload"].get("should_prune")), n)
