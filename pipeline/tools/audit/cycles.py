"""Steady epochs checked together, mixed into the auditor. Once an epoch's lines (its moves, a debug log's
per-batch lines among them, then its ``epoch`` line) have passed every check one line at a time with nothing to
say, the epochs after it whose lines repeat those words are checked a group at a time: ``seq``, ``ts``,
``epoch``, ``global_step`` and the chain's digests as columns, the moves by the table once for the group (the
facts their guards read cannot change inside it), and each ``epoch`` line's numbers as one line would record
them. When any column does not hold, the group's lines go through the checks a line at a time, which name what
is wrong; both readings find the same."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain, repeat
from operator import attrgetter
from typing import Any

from fsmtrain.core.lifecycle import FINAL, HOOKS, TRANSITIONS, Phase
from fsmtrain.core.log_file import EMPTY_PAYLOAD, LogLine, parse_line
from fsmtrain.tools.audit.chain import Digests
from fsmtrain.tools.audit.moves import PER_BATCH, RECORDED, MoveChecks, allowed_steadily, record_columns
from fsmtrain.tools.audit.segment import Segment

__all__ = ["SAVING", "WORDS", "Cycler", "EpochCycles", "Reader"]

SAVING = next(h.phase for h in HOOKS if h.name == "on_save_checkpoint").value  # a checkpoint is staged here
# The words of each move of the table (phase, from, to, trigger): the same tuple each time.
WORDS = {words: words for words in ((t.dest.value, t.source.value, t.dest.value, t.trigger) for t in TRANSITIONS)}
Reader = Callable[[int, dict[str, Any]], None]  # given each line that is a JSON object, with its number
# given whole epochs from their first line's number: each move's words, the global step of each of its lines (one
# per epoch), the epochs, each one's payload and the payloads by column (``record_columns``; a reader is not given
# these lines)
Cycler = Callable[[int, Sequence[tuple[str, ...]], list[list[int]], range, Sequence[Mapping[str, Any]],
                   dict[str, dict[str, list[Any]]]], None]
COLUMNS = tuple(map(attrgetter, ("seq", "ts", "epoch", "global_step", "prev")))
_KEY = attrgetter("event", "level", "phase", "from_", "to", "trigger", "run_id", "payload")
_RECORD, _BEGIN, _STEP, _VAL, _FINAL = (p.value for p in (Phase.EPOCH_END, Phase.EPOCH_BEGIN, Phase.TRAIN_STEP,
                                                           Phase.VAL, FINAL))
_BATCH_WORDS = (PER_BATCH[1], *PER_BATCH)  # a per-batch line's: a debug log's line for each batch but the last
_GROUP = 64  # epochs checked together at most


def line_keys(typed: list[LogLine | None]) -> list[tuple[Any, ...] | None]:
    """Each typed line's words, as the auditor compares them (its event ... run_id and payload; None: untyped)."""
    return list(map(_KEY, typed)) if None not in typed else [None if rec is None else _KEY(rec) for rec in typed]


@dataclass
class EpochRun:
    """Whole epochs that passed every check together: what the auditor takes from them."""

    n: int  # the first line's number
    first: int  # the first epoch
    count: int
    steps: list[list[int]]  # each move's global step, an epoch at a time
    payloads: Sequence[Mapping[str, Any]]  # the epoch lines'
    columns: dict[str, dict[str, list[Any]]]  # the same by column (``record_columns``)
    last_seq: int
    last_ts: float
    tail: list[str]  # the digests carried by the last two epochs' lines (the last one's, when there is one)
    last: list[bytes]  # the last two lines
    ends: list[tuple[Digests, Sequence[int], int]]  # the digests carried by the lines that follow a save phase's

    def whole(self) -> bool:
        """Whether the columns hold all the records say: every field with the same names in each, no mapping."""
        return len(self.columns) == len(RECORDED) and not any(
            dict in set(map(type, col)) for cols in self.columns.values() for col in cols.values())

    def parts(self, size: int) -> list[EpochRun]:
        """These epochs (of ``size`` lines each) cut where their records' names change (a record that holds one slot
        more, or one less), each part with its columns: taken a column at a time, not a record at a time."""
        if self.count < 2 or self.whole():
            return [self]
        names = [tuple(tuple(v) if type(v := p.get(field)) is dict else type(v) for field in RECORDED)
                 for p in self.payloads]
        cuts = [k for k in range(1, self.count) if names[k] != names[k - 1]]
        if not cuts:
            return [self]
        parts = []
        for a, b in zip([0, *cuts], [*cuts, self.count], strict=True):
            payloads = self.payloads[a:b]
            parts.append(replace(self, n=self.n + a * size, first=self.first + a, count=b - a,
                                 steps=[steps[a:b] for steps in self.steps], payloads=payloads,
                                 columns=record_columns(payloads)))
        return parts


@dataclass(frozen=True)
class Cycle:
    """The lines of one epoch that passed every check: what the epochs after it must repeat."""

    seg: Segment
    moves: list[tuple[Any, ...]]  # each move line's words as the auditor keys them (event ... run_id, payload)
    epoch_key: tuple[Any, ...]  # the epoch line's, less its payload
    words: tuple[tuple[str, ...], ...]  # each move's (phase, from, to, trigger)
    saving: tuple[bool, ...]  # each line's phase stages a checkpoint
    val_at: int  # the move into validation: the epoch's steps were taken before it
    batch_lines: int  # the per-batch lines (a debug log's), each a step, right before the move into validation
    turns: tuple[tuple[str, str, str], ...]  # the moves that change the phase (the per-batch lines' do not), as a
    # segment keeps them: trigger, from, to

    @property
    def size(self) -> int:
        return len(self.moves) + 1

    def repeats(self, keys: list[Any], i: int, most: int) -> int:
        """How many whole epochs (``most`` at most) repeat this one's words from line ``keys[i]`` on."""
        size, end, count = self.size, len(keys), 0
        while (count < most and i + size <= end and keys[i:i + size - 1] == self.moves
               and (k := keys[i + size - 1]) is not None and k[:-1] == self.epoch_key):
            i, count = i + size, count + 1
        return count


class EpochCycles(MoveChecks):
    """Needs the auditor's ``seg``, ``prev_seq``, ``last_ts``, ``last_ts_line``, ``findings``, ``reader`` and
    ``cycler``."""

    seg: Segment | None
    prev_seq: int | None
    last_ts: float
    last_ts_line: int
    reader: Reader | None
    cycler: Cycler | None
    _cycle: Cycle | None = None
    _last_epoch: tuple[int, int, tuple[int, int, int]] | None = None  # block, index and findings at an epoch line
    _block_no = 0
    _group = 1  # epochs the next group may hold: doubles after each group that holds, back to 1 after a fault

    def _epochs_after(self, n: int, i: int, block: list[bytes], typed: list[LogLine | None],
                      keys: list[Any]) -> int:
        """After the epoch line ``block[i - 1]`` was checked alone (the block's lines are ``n``...): how many lines
        from ``block[i]`` on were checked as whole epochs."""
        last, self._last_epoch = self._last_epoch, (self._block_no, i - 1, self._mark())
        if last is not None and last[0] == self._block_no and last[2] == self._mark():  # nothing found in that epoch
            learned = self._learn(typed[last[1] + 1:i], keys[last[1] + 1:i])
            self._cycle = learned or self._cycle
        cycle = self._cycle
        if cycle is None or cycle.seg is not self.seg or (self.reader is not None and self.cycler is None):
            return 0  # (a reader is given every line that is not in whole epochs taken together: those, a cycler)
        size, done = cycle.size, i
        while True:
            count = cycle.repeats(keys, done, self._group)
            j = done + count * size
            if count and self._epoch_group(n + done, block[done:j], typed[done:j], count, cycle):
                done, self._group = j, min(2 * self._group, _GROUP)
                self._last_epoch = (self._block_no, j - 1, self._mark())
                continue
            if count > 1:  # a fault in the group: from its start again, an epoch at a time first
                self._group = 1
                continue
            self._group = 1
            return done - i  # the next epoch (none that repeats, or the faulty one) is read a line at a time

    def _mark(self) -> tuple[int, int, int]:
        """What has been found so far, in a form that changes whenever anything more is."""
        return len(self.findings), len(self.chain.findings), self.chain.verdict.broken_links

    def _learn(self, recs: list[LogLine | None], keys: list[Any]) -> Cycle | None:
        """The epoch whose lines are ``recs``, that passed every check, as a cycle the next ones may repeat."""
        seg = self.seg
        if (seg is None or len(recs) < 2 or seg.phase != _RECORD or seg.stop is not None or seg.faulted
                or seg.val_every is not None or seg.result_line is not None):
            return None
        *moves, last = recs
        if last is None or last.event != "epoch" or last.phase != _RECORD:
            return None
        words, phase = [], _RECORD
        for rec in moves:
            if (rec is None or rec.event != "transition" or rec.payload != EMPTY_PAYLOAD or rec.from_ != phase
                    or rec.phase != rec.to or rec.trigger is None):
                return None
            said = (rec.phase, rec.from_, rec.to, rec.trigger)
            steady = said == _BATCH_WORDS or (rec.to not in (None, phase, _FINAL)
                                              and allowed_steadily((phase, rec.to, rec.trigger)))
            if not steady:
                return None
            words.append(WORDS.get(said, said))
            phase = rec.to
        dsts = [w[2] for w in words]
        if phase != _RECORD or dsts[0] != _BEGIN or dsts.count(_BEGIN) != 1 or dsts.count(_VAL) != 1:
            return None
        val_at = dsts.index(_VAL)
        batch_lines = words.count(_BATCH_WORDS)
        if (words[val_at][1] != _STEP or _STEP not in dsts[:val_at - batch_lines]
                or words[val_at - batch_lines:val_at] != [_BATCH_WORDS] * batch_lines):
            return None  # the epoch's steps are taken in train_step, entered after it began (a line a step at its end)
        saving = tuple(rec.phase == SAVING for rec in recs if rec is not None)
        turns = tuple((trig, src, dst) for _, src, dst, trig in words if src != dst)
        return Cycle(seg, keys[:-1], keys[-1][:-1], tuple(words), saving, val_at, batch_lines, turns)

    def _epoch_group(self, n: int, lines: list[bytes], recs: list[LogLine | None], count: int, cycle: Cycle) -> bool:
        """Lines ``n``... (``lines``: ``count`` epochs whose words repeat ``cycle``'s) checked together; False, with
        nothing changed, unless every line passes every check."""
        run = self._checked_epochs(n, lines, recs, count, cycle)
        if run is None:
            return False
        self._take_epochs(run, cycle)
        return True

    def _checked_epochs(self, n: int, lines: list[bytes], recs: list[LogLine | None], count: int,
                        cycle: Cycle) -> EpochRun | None:
        """:meth:`_epoch_group`'s checks, the chain's links taken: what the epochs give the auditor, or None."""
        seg, size, prev_seq = self.seg, cycle.size, self.prev_seq
        if not self._steady(cycle) or seg is None or prev_seq is None:
            return None
        seqs, ts, epochs, steps, prevs = (list(map(column, recs)) for column in COLUMNS)
        first, total, val_at, k = seg.next_epoch, len(lines), cycle.val_at, cycle.batch_lines
        begins, vals = steps[::size], steps[val_at::size]
        # every guard of the group's moves holds as it held in ``cycle``: the run does not reach its budget in it;
        # a per-batch line is a step after the one before, and validation a step after the last
        if (first + count > seg.max_epochs or (seg.max_steps is not None and steps[-1] >= seg.max_steps)
                or seqs != list(range(prev_seq + 1, prev_seq + 1 + total)) or ts[0] < self.last_ts
                or ts != sorted(ts) or steps[0] < seg.global_step or steps != sorted(steps)
                or epochs != list(chain.from_iterable(repeat(e, size) for e in range(first, first + count)))
                or (k and vals != [b + k + 1 for b in begins])
                or steps != list(chain.from_iterable((b,) * (val_at - k) + tuple(range(b + 1, b + 1 + k))
                                                     + (v,) * (size - val_at)
                                                     for b, v in zip(begins, vals, strict=True)))):
            return None
        payloads = []
        for c, rec in enumerate(recs[size - 1::size]):  # the epoch lines
            payload = parse_line(bytes(rec.payload))  # type: ignore[union-attr]
            batches = payload.get("batches") if type(payload) is dict else None
            if type(batches) is not int or batches != vals[c] - begins[c]:
                return None
            payloads.append(payload)
        ends = self.chain.link_cycles(n, lines, prevs, cycle.saving, seqs[-1])
        if ends is None:
            return None
        return EpochRun(n, first, count, [steps[p::size] for p in range(size - 1)], payloads,
                        record_columns(payloads), seqs[-1], ts[-1], prevs[-2 * size:], lines[-2:], ends)

    def _steady(self, cycle: Cycle) -> bool:
        """Whether the run is where ``cycle``'s epochs may follow: its segment, past an epoch's record, nothing
        stopping it."""
        seg = self.seg
        return (seg is cycle.seg and self.prev_seq is not None and seg.phase == _RECORD and seg.stop is None
                and not seg.faulted and seg.result_line is None)

    def _take_epochs(self, run: EpochRun, cycle: Cycle, *, tally: bool = True) -> list[EpochRun]:
        """Whole epochs that repeat ``cycle`` and passed every check (their links taken): the run is past them.
        ``tally``: their moves are counted and given to a cycler (a second process leaves that to the auditor).
        The epochs' parts whose records have the same names (:meth:`EpochRun.parts`)."""
        seg, size, count, first = self.seg, cycle.size, run.count, run.first
        assert seg is not None
        parts = run.parts(size)
        if tally:
            if self.cycler is not None:
                for part in parts:
                    self.cycler(part.n, cycle.words, part.steps, range(part.first, part.first + part.count),
                                part.payloads, part.columns)
            for trig, src, dst in cycle.turns:
                self.moves[(src, dst, trig)] += count
            self.batch_moves += cycle.batch_lines * count  # (counted apart, as one line at a time counts them)
            seg.moves.add_epochs(cycle.turns, first, count)
        total = count * size
        for part in parts:
            self._epoch_records(list(range(part.n + size - 1, part.n + part.count * size, size)), part.payloads,
                                part.columns, seg)
        last, begin, val = run.n + total - 1, run.steps[0][-1], run.steps[cycle.val_at][-1]
        self.prev_seq, self.last_ts, self.last_ts_line = run.last_seq, run.last_ts, last
        seg.epoch_starts += count
        seg.validated_at = seg.step_begin = begin
        seg.step_prev, seg.batch_lines, seg.step_val = begin + cycle.batch_lines, cycle.batch_lines, val
        seg.last_line, seg.last_epoch_field, seg.global_step = last, first + count - 1, val
        return parts
