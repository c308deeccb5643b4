"""A long log's second half read ahead in a second process, mixed into the auditor. Once the auditor has learned
an epoch's cycle (:mod:`.cycles`), a fork of it checks the whole epochs from a line past the middle of what is
left, taking the state they need from the first of them. The auditor reads up to that line, then takes those
epochs in one step where its own state is the one the fork assumed, and reads them itself where it is not.
Every check is made by the same code, once; both readings find the same."""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import tempfile
import threading
import traceback
import warnings
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import IO, Any, cast, overload

from fsmtrain.core.chain import Chain
from fsmtrain.core.lifecycle import Phase
from fsmtrain.core.log_file import LogLine, parse_line, typed_lines
from fsmtrain.tools.audit.chain import Digests
from fsmtrain.tools.audit.cycles import _GROUP, Cycle, EpochCycles, EpochRun, line_keys
from fsmtrain.tools.audit.verdict import AuditReadError

__all__ = ["AHEAD", "Ahead", "Handover", "LinePayloads", "ReadAhead"]

_RECORD = Phase.EPOCH_END.value


@dataclass(frozen=True)
class Ahead:
    """When a second process reads ahead: from ``at`` (a share) of the bytes left once the auditor has learned an
    epoch's cycle, when those are ``min_bytes`` at least (below that a fork and the handover cost more than they
    save); ``block``: the bytes of a read."""

    at: float = 0.55  # (the second process also packs what it hands over: measured, benchmarks/RESULTS.md)
    min_bytes: int = 48 << 20
    block: int = 1 << 22


AHEAD = Ahead()


class LinePayloads(Sequence[Mapping[str, Any]]):
    """The payloads of the lines of ``path`` that begin at ``offsets``, read when first asked for: epochs read
    ahead hand over their records by column, and a reader that needs them one at a time reads them."""

    def __init__(self, path: Path, offsets: list[int]) -> None:
        self.path, self.offsets = path, offsets
        self._values: list[Mapping[str, Any]] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> Mapping[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Mapping[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
        if self._values is None:
            with open(self.path, "rb") as fh:
                self._values = [_payload(fh, at) for at in self.offsets]
        return self._values[i]

    def __getstate__(self) -> tuple[Path, list[int]]:
        return self.path, _packed(self.offsets)

    def __setstate__(self, state: tuple[Path, list[int]]) -> None:
        self.path, self.offsets = state
        self._values = None


def _payload(fh: IO[bytes], at: int) -> Mapping[str, Any]:
    fh.seek(at)
    payload = parse_line(fh.readline())["payload"]
    return payload if isinstance(payload, dict) else {}


@dataclass
class Handover:
    """What the second process found: whole epochs from the line after ``prev_raw`` (their first line's numbers:
    ``first_seq``, ``first_ts``), ``lines`` lines ending at byte ``end``, as runs whose records have the same
    names; the digests carried by the last two epochs' lines (``tail``), the last two lines, and the digests
    carried by those that follow a save phase's line (``ends``, raw) and the lines they are the digests of."""

    runs: list[EpochRun]
    prev_raw: bytes
    first_seq: int
    first_ts: float
    lines: int
    end: int
    tail: list[str]
    last: list[bytes]
    ends: bytes
    end_lines: list[int]


class _Helper:
    """The second process: its pid, the file it writes its handover to (whole, before this process reads it: a
    pipe would hand it over 64 kB at a time while this one waits), the byte it reads from."""

    def __init__(self, pid: int, out: IO[bytes], cut: int, cycle: Cycle, chain: Chain | None) -> None:
        self.pid, self.out, self.cut, self.cycle, self.chain = pid, out, cut, cycle, chain

    def join(self, line: int) -> Handover | None:
        _, status = os.waitpid(self.pid, 0)
        with self.out:
            if status == 0 and self.out.seek(0, os.SEEK_END):
                self.out.seek(0)
                handover: Handover | None = pickle.load(self.out)  # (from this process's own fork)
                return handover
        warnings.warn(f"the second process reading the log ended without its part ({_ended(status)}): the log was "
                      f"read in one process from line {line} on", RuntimeWarning, stacklevel=2)
        return None

    def close(self) -> None:
        """Stop the process, whatever it was doing (the auditor was interrupted, or failed)."""
        self.out.close()
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


class ReadAhead(EpochCycles):
    """Needs the auditor's ``path``, ``feed_block`` and all that :class:`EpochCycles` needs."""

    path: Path
    feed_block: Callable[[int, list[bytes]], None]
    ahead_lines = 0  # the lines the second process checked

    def read_file(self, ahead: Ahead | None) -> int:
        """Every line of the log fed to the auditor (a second process reading ahead where ``ahead`` lets it);
        how many there were. :class:`AuditReadError` if the log cannot be read."""
        n, helper = 0, None
        try:
            with open(self.path, "rb") as fh:
                size, pos, block_size = os.fstat(fh.fileno()).st_size, 0, (ahead or AHEAD).block
                tried = ahead is None or not fh.seekable()  # (a pipe is read once, by this process)
                while block := fh.readlines(block_size):
                    end = pos if tried and helper is None else fh.tell()  # (needed while one may start or runs)
                    if helper is not None and end > helper.cut:
                        starts = [0, *accumulate(map(len, block))]
                        k = bisect_left(starts, helper.cut - pos)
                        if k:
                            self.feed_block(n + 1, block[:k])
                            n, block = n + k, block[k:]
                        ended, helper = helper, None
                        if starts[k] != ended.cut - pos:  # the log changed under the second process
                            ended.close()
                            done = None
                        else:
                            done = ended.join(n + 1)
                        if done is not None and self._take_ahead(done, n + 1, ended.cycle, ended.chain):
                            n, pos = n + done.lines, done.end
                            fh.seek(pos)
                            continue
                    if block:
                        self.feed_block(n + 1, block)
                    n, pos = n + len(block), end
                    if not tried and ahead is not None and self._cycle is not None and self._cycle.seg is self.seg:
                        tried, helper = True, self._start_ahead(ahead, pos, size)
        except OSError as exc:
            raise AuditReadError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        finally:
            if helper is not None:
                helper.close()
        return n

    def _start_ahead(self, ahead: Ahead, pos: int, size: int) -> _Helper | None:
        """A fork that reads ahead from the first epoch past ``ahead.at`` of the bytes after ``pos``; None where the
        log is too short, or a fork is not safe (other threads run here)."""
        cycle = self._cycle
        if cycle is None or size - pos < ahead.min_bytes:
            return None
        if not hasattr(os, "fork") or threading.active_count() > 1:
            why = "no fork here" if not hasattr(os, "fork") else "other threads run here: a fork is not safe"
            warnings.warn(f"{self.path} ({size / 1e6:.0f} MB) is read in one process ({why}); the command line "
                          "reads a long log in two", RuntimeWarning, stacklevel=4)
            return None
        with open(self.path, "rb") as fh:
            fh.seek(max(pos, pos + int((size - pos) * ahead.at) - 1))
            at = fh.tell() + len(fh.readline())  # the first line that begins at or past that point
            lines = fh.readlines(1 << 16)
        first = cycle.moves[0]
        i = next((i for i, key in enumerate(line_keys(typed_lines(lines))) if i and key == first), None)
        if i is None:
            return None  # no epoch begins there
        cut = at + sum(map(len, lines[:i]))
        out = None
        try:
            out = tempfile.TemporaryFile()  # noqa: SIM115  (the helper closes it; deleted as it is made)
            pid = os.fork()
        except OSError as exc:
            if out is not None:
                out.close()
            warnings.warn(f"no second process could read the log ({exc.strerror or exc}): it is read in one process",
                          RuntimeWarning, stacklevel=3)
            return None
        if pid == 0:  # the second process: it hands over what it found, and ends without touching this one's state
            code = 1
            try:
                found = self._read_ahead(cycle, lines[i - 1], cut, ahead.block)
                pickle.dump(found, out, pickle.HIGHEST_PROTOCOL)
                out.flush()
                code = 0
            except Exception:
                traceback.print_exc()
            finally:
                os._exit(code)
        return _Helper(pid, out, cut, cycle, self.chain.active)

    def _read_ahead(self, cycle: Cycle, prev_raw: bytes, start: int, block_size: int) -> Handover | None:
        """In the second process: the whole epochs from byte ``start`` (``prev_raw``: the line before it) that
        repeat ``cycle``, checked a group at a time as :meth:`_epochs_after` checks them, up to the first that
        does not pass every check; their lines numbered from 1."""
        seg, size = self.seg, cycle.size
        self.chain.restart_at(prev_raw, cycle.saving[-1])
        found: _Found | None = None
        n, carry = 1, list[bytes]()  # carry: the lines of an epoch cut by a read's end
        with open(self.path, "rb") as fh:
            fh.seek(start)
            pos = start  # the byte carry[0] (else the next read) begins at
            for block in iter(lambda: fh.readlines(block_size), []):
                lines = carry + block
                typed = typed_lines(lines)
                keys = line_keys(typed)
                if found is None:
                    first = typed[0]
                    if first is None or seg is None:
                        return None
                    found = _Found(self.path, prev_raw, first)
                    # the state these epochs need, from their first line: the auditor checks that it is its own
                    self.prev_seq, self.last_ts, self._group = first.seq - 1, first.ts, 1
                    seg.next_epoch, seg.global_step, seg.phase = first.epoch, first.global_step, _RECORD
                starts = list(accumulate(map(len, lines), initial=pos))
                i = 0
                while count := cycle.repeats(keys, i, self._group):
                    j, mark = i + count * size, self._mark()
                    got = self._checked_epochs(n + i, lines[i:j], typed[i:j], count, cycle)
                    if got is None and count > 1:
                        self._group = 1  # from the group's start again, an epoch at a time
                        continue
                    parts = [] if got is None else self._take_epochs(got, cycle, tally=False)
                    if got is None or self._mark() != mark:
                        return found.handover(starts[i])
                    found.add(got, parts, starts[i + size - 1:j:size], size)
                    i, self._group = j, min(2 * self._group, _GROUP)
                if i + size <= len(lines):  # an epoch that does not repeat the cycle
                    return found.handover(starts[i])
                carry, n, pos = lines[i:], n + i, starts[i]
        return None if found is None else found.handover(pos)

    def _take_ahead(self, done: Handover, n: int, cycle: Cycle, chain: Chain | None) -> bool:
        """The second process's epochs, from line ``n``, taken where the run is as they assumed: False, with
        nothing changed, where it is not (the auditor then reads them)."""
        seg, first = self.seg, done.runs[0]
        if (seg is None or not self._steady(cycle) or self.prev_seq != done.first_seq - 1
                or self.last_ts > done.first_ts or seg.global_step > first.steps[0][0] or seg.next_epoch != first.first
                or not self.chain.can_take(done.prev_raw, chain, cycle.saving[-1])):
            return False
        shift = n - 1  # (its lines were numbered from 1)
        self.chain.take_cycles(n, done.lines, done.tail, done.last, cycle.saving, done.runs[-1].last_seq,
                               [(done.ends, done.end_lines, shift)])
        for run in done.runs:
            run.n += shift
            run.steps = list(map(_unpacked, run.steps))
            run.columns = {field: {name: _unpacked(col) for name, col in cols.items()}
                           for field, cols in run.columns.items()}
            self._take_epochs(run, cycle)
        self._last_epoch, self.ahead_lines = None, done.lines
        return True


class _Found:
    """What the second process found so far: runs of whole epochs whose records have the same names (held by
    column), and what the chain takes from them all."""

    def __init__(self, path: Path, prev_raw: bytes, first: LogLine) -> None:
        self.path, self.prev_raw, self.first = path, prev_raw, first
        self.runs: list[tuple[EpochRun, list[int]]] = []  # each with its epoch lines' offsets
        self.tail: list[str] = []
        self.last: list[bytes] = []
        self.ends: list[tuple[Digests, Sequence[int], int]] = []
        self.lines = 0

    def add(self, run: EpochRun, parts: list[EpochRun], offsets: list[int], size: int) -> None:
        """The epochs of ``run`` (its epoch lines at ``offsets``, ``size`` lines each; ``parts``:
        :meth:`EpochRun.parts`), checked and taken after those found so far."""
        self.tail, self.last = (self.tail + run.tail)[-2 * size:], (self.last + run.last)[-2:]
        self.ends += run.ends
        self.lines += run.count * size
        for part in parts:
            at = offsets[part.first - run.first:part.first - run.first + part.count]
            if not (self.runs and _joined(*self.runs[-1], part, at)):
                self.runs.append((part, at))

    def handover(self, end: int) -> Handover | None:
        """What the auditor takes: the runs found, the lines up to byte ``end``; None where none was."""
        if not self.runs:
            return None
        for run, offsets in self.runs:  # a run's records, where its columns hold them all, are read when asked for
            if run.whole():
                run.payloads = LinePayloads(self.path, offsets)
                run.columns = {field: {name: _packed(col) for name, col in cols.items()}
                               for field, cols in run.columns.items()}
            run.steps = [_packed(steps) for steps in run.steps]
            run.tail, run.last, run.ends = [], [], []  # (the chain's are handed over for all the runs at once)
        hexed = "".join(itertools.chain.from_iterable(cast("list[str]", ds) for ds, _, _ in self.ends))
        digests = bytes.fromhex(hexed)  # (as bytes: crossed at once)
        lines = _packed([line for _, ls, _ in self.ends for line in ls])
        return Handover([run for run, _ in self.runs], self.prev_raw, self.first.seq, self.first.ts, self.lines, end,
                        self.tail, self.last, digests, lines)


def _joined(run: EpochRun, offsets: list[int], more: EpochRun, more_offsets: list[int]) -> bool:
    """``run`` (its epoch lines at ``offsets``) extended by the epochs after it (``more``), where the columns of
    both hold all their records say, under the same names; False, with nothing changed, else."""
    if not (run.whole() and more.whole()) or any(
            list(cols) != list(more.columns[field]) for field, cols in run.columns.items()):
        return False
    for field, cols in run.columns.items():
        for name, col in cols.items():
            col += more.columns[field][name]
    for steps, later in zip(run.steps, more.steps, strict=True):
        steps += later
    run.count += more.count
    run.last_seq, run.last_ts = more.last_seq, more.last_ts
    offsets += more_offsets
    return True


def _packed(values: list[Any]) -> list[Any]:
    """``values`` as an array where they are all floats, or all ints of 64 bits: sent a hundred times faster."""
    kinds = set(map(type, values))
    if kinds == {float}:
        return array("d", values)  # type: ignore[return-value]  # (a list again where it is taken: _unpacked)
    if kinds == {int} and min(values) >= -(1 << 63) and max(values) < 1 << 63:
        return array("q", values)  # type: ignore[return-value]
    return values


def _unpacked(values: list[Any]) -> list[Any]:
    return values.tolist() if isinstance(values, array) else values
