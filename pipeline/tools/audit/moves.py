"""The moves of a log against the lifecycle table: each is a move of the table from the phase the
run is in, whose guards held given what the log says (stop requests, epochs, faults). Mixed into
the auditor."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import Any

from fsmtrain.core.context import epoch_number
from fsmtrain.core.lifecycle import ABORT, FINAL, TRANSITIONS, Facts, Phase, Transition, enabled_transition
from fsmtrain.tools.audit.chain import ChainCheck
from fsmtrain.tools.audit.ending import EndingChecks, Segment
from fsmtrain.tools.audit.verdict import shown_epoch

__all__ = ["PER_BATCH", "MoveChecks"]

_MOVES: Mapping[tuple[str, str, str], Transition] = {
    (t.source.value, t.dest.value, t.trigger): t for t in TRANSITIONS
}
_PHASES = frozenset(p.value for p in Phase)
_PER_BATCH_MOVE = next(t for t in TRANSITIONS if t.internal)  # one line per batch, at debug level
PER_BATCH = (_PER_BATCH_MOVE.source.value, _PER_BATCH_MOVE.dest.value, _PER_BATCH_MOVE.trigger)
_STEP, _VAL, _EPOCH_BEGIN = PER_BATCH[0], Phase.VAL.value, Phase.EPOCH_BEGIN.value


@functools.cache
def _allowed(move: Transition, facts: Facts) -> bool:
    if move.trigger == ABORT:  # abort is not an ordinary move: it needs its own guard only
        return move.enabled(facts)
    return enabled_transition(move.source, facts) is move


class MoveChecks(EndingChecks):
    """Needs the auditor's ``chain``, ``moves`` and ``batch_moves``."""

    chain: ChainCheck
    moves: Counter[tuple[str, str, str]]
    batch_moves: int

    def _transition(self, n: int, rec: Mapping[str, Any], seg: Segment) -> None:
        src, dst, trig = rec["from"], rec["to"], rec["trigger"]
        key = (src, dst, trig)
        step = rec["global_step"]
        if (key == PER_BATCH and seg.phase == _STEP and rec["epoch"] == seg.next_epoch and rec["phase"] == _STEP
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
        if src != dst:
            epoch = rec["epoch"]
            seg.moves.append((str(trig), str(src), str(dst), epoch if type(epoch) is int else 0))
        move = _MOVES.get(key)
        if move is None:
            self.bad("transition", f"{src} -> {dst} ({trig}) is not a move of the lifecycle table", n)
            if isinstance(dst, str) and dst in _PHASES:
                seg.phase = dst
            return
        self.moves[key] += 1
        if src != seg.phase:
            self.bad("transition", f"{src} -> {dst} ({trig}) leaves {src!r}, but the run is in {seg.phase!r}", n)
        elif not any(_allowed(move, self._facts(seg, has_batch)) for has_batch in (False, True)):
            # ``has_batch`` is not in the log: the move is fine if the table allows it for either value
            self.bad("guard", self._guard_message(move, seg), n)
        epoch = rec["epoch"]
        if epoch != seg.next_epoch:
            self.bad("epoch", f"transition in epoch {shown_epoch(epoch)}, but the run is in epoch "
                     f"{epoch_number(seg.next_epoch)}", n)
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

    def _guard_message(self, move: Transition, seg: Segment) -> str:
        stop = seg.stop
        state = (f"stop requested: {stop.reason} (line {stop.line}{', immediate' if stop.immediate else ''})"
                 if stop else "no stop requested")
        return (f"{move.source.value} -> {move.dest.value} ({move.trigger}) needs [{move.guard_label()}], "
                f"which did not hold: {state}, epoch {epoch_number(seg.next_epoch)} of max_epochs={seg.max_epochs}"
                f"{', faulted' if seg.faulted else ''}")
