"""The audit's half of the hash chain (:mod:`fsmtrain.core.chain`): links, seals where no link covers a
line, the first break named with what happened there, a wrong key told from tampering, pinned lines."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsmtrain.core.chain import KEY_ENV, SCHEME_KEYED, SCHEME_PLAIN, Chain
from fsmtrain.tools.audit.verdict import ChainVerdict, Finding, Severity

__all__ = ["ChainCheck", "Digests", "SegmentChain"]

@dataclass
class SegmentChain:
    first_line: int
    scheme: str | None
    key_id: str | None
    verified: bool | None = True  # None: keyed, and no matching key


@dataclass(frozen=True)
class _Break:
    line: int  # the line whose ``prev`` does not match
    seq_before: Any
    seq: Any
    rebuilt_without_key: bool
    skips_a_line: bool  # it carries the digest of the line two before: the line between was inserted
    duplicate: bool  # the same bytes as the line before
    expected: str  # the digest of the line before: if the next line carries it, this line was inserted
    prev_sealed: bool | None  # whether the line before holds its seal (None: it has none, an older format)
    sealed: bool | None  # whether this line holds its seal

    def named(self, next_ok: bool, next_carried: Any, next_sealed: bool | None) -> tuple[int, str]:
        """The line to name for this break and what happened there, given the line after it (``next_*``)."""
        n = self.line
        if self.duplicate:
            return n, f"line {n} is a second copy of line {n - 1}"
        if next_carried == self.expected:
            return n, (f"line {n} was inserted: line {n + 1} carries the digest of line {n - 1}, the line that came "
                       "before it when it was written")
        if self.skips_a_line:
            return n - 1, (f"line {n - 1} was inserted: line {n} carries the digest of line {n - 2}, the line that "
                           "came before it when it was written")
        if self.rebuilt_without_key:
            return n - 1, (f"line {n - 1} was altered and the chain from line {n} on was rebuilt without the key "
                           f"(line {n} carries the plain sha256 of line {n - 1}, not its HMAC)")
        if self.prev_sealed is False:
            return n - 1, (f"line {n - 1} was altered after it was written: its seal does not match its bytes, and "
                           f"line {n} carries a different digest for it")
        if self.sealed is False and self.prev_sealed and (next_sealed or next_carried is None):
            # Line n alone fails its seal, between lines that hold theirs: only it was changed.
            after = "" if next_carried is None else f", and line {n + 1} carries a different digest for it"
            return n, f"line {n} was altered after it was written: its seal does not match its bytes{after}"
        if not next_ok:
            return n, (f"line {n} does not chain to line {n - 1}, nor do the lines after it: lines were inserted or "
                       f"removed here and the rest renumbered, or the log was rewritten from line {n} on")
        if type(self.seq) is int and type(self.seq_before) is int and self.seq == self.seq_before + 1:
            return n - 1, f"line {n - 1} was altered after it was written: line {n} carries a different digest for it"
        return n, (f"line {n} does not chain to line {n - 1}: lines between them were removed (or line {n - 1} was "
                   "altered)")


def _expected(chain: Chain, rec: Mapping[str, Any], prev_raw: bytes | None) -> str:
    """The ``prev`` ``rec`` must carry: the digest of the line before, or for a first line the genesis."""
    if prev_raw is not None:
        return chain.digest(prev_raw)
    payload = rec.get("payload")
    return chain.genesis(str(rec.get("run_id")), payload.get("config") if isinstance(payload, dict) else None)


Digests = Sequence[str] | bytes  # hex digests, or the raw bytes of as many digests of one size


class _EndPins:
    """The lines that follow a save phase's line, by the digest of the line before them (:meth:`mapping`). A long
    run without checkpoints has two an epoch and never looks one up, so they are kept as they came (digests and
    lines, in order) and made a dict when one is looked up: the same dict, at a fraction of the cost."""

    def __init__(self, start: dict[str, int] | None = None) -> None:
        self._dict = {} if start is None else start
        self._runs: list[tuple[Digests, Sequence[int], int]] = []

    def __setitem__(self, digest: str, line: int) -> None:
        self._runs.append(((digest,), (line,), 0))

    def add(self, digests: Digests, lines: Sequence[int], shift: int = 0) -> None:
        """Pins of ``lines`` (each plus ``shift``), in order."""
        self._runs.append((digests, lines, shift))

    def mapping(self) -> dict[str, int]:
        for digests, lines, shift in self._runs:
            if isinstance(digests, bytes):
                hexed = digests.hex()
                size = len(hexed) // max(len(lines), 1)
                digests = [hexed[i:i + size] for i in range(0, len(hexed), size)]
            self._dict.update(zip(digests, map(shift.__add__, lines) if shift else lines, strict=True))
        self._runs.clear()
        return self._dict


class ChainCheck:
    """Fed every line (:meth:`link`), each ``run_start`` first (:meth:`segment`); :meth:`finish` judges."""

    def __init__(self, key: bytes | None) -> None:
        self.plain = Chain()
        self.keyed = Chain(key) if key is not None else None
        self.active: Chain | None = self.keyed or self.plain
        self._digest: Callable[[bytes], str] | None = self.active.digest
        self.verdict = ChainVerdict(key_used=key is not None)
        self.findings: list[Finding] = []
        self.prev_raw: bytes | None = None
        self._before_prev: bytes | None = None
        # Seals, checked where no link covers a line. A sealed log seals every line; one with none is the older format.
        self.sealed_seen = False  # a line carried a seal: the log seals its lines
        self.first_seal: Finding | None = None
        self._seal_known: dict[int, bool | None] = {}  # a few lines, around a break and at the end
        self._last_verified = 0  # the last line linked under a chain, and that chain until a line follows
        self._tail: Chain | None = None
        self.prev_seq: Any = None
        self.unchained = False
        self._pending: _Break | None = None
        self._first: Finding | None = None
        self._told_key = False
        self.verified_links = 0
        # digest -> line: this epoch's, the epoch before's, and each save-phase line since the last pin
        self.pins: dict[str, int] = {}
        self._pins_before: dict[str, int] = {}
        self._end_pins = _EndPins()
        self._prev_end = False
        self.segments: list[SegmentChain] = []

    def segment(self, n: int, raw: bytes, rec: Mapping[str, Any]) -> None:
        """A ``run_start`` at line ``n``: its writer's scheme applies from this line's own link on."""
        self.pins, self._pins_before, self._end_pins = {}, {}, _EndPins()
        if self.unchained:
            return
        desc = rec["payload"].get("chain")
        scheme, key_id = (desc.get("scheme"), Chain.key_id_of(desc)) if isinstance(desc, dict) else (None, None)
        seg = SegmentChain(n, scheme if isinstance(scheme, str) else None, key_id)
        self.segments.append(seg)
        if isinstance(scheme, str) and scheme not in self.verdict.schemes:
            self.verdict.schemes.append(scheme)
        keyed = self.keyed
        # A link that holds under the key given proves the key is this log's, whatever the payload says.
        if keyed is not None and ((scheme == SCHEME_KEYED and key_id in (None, keyed.key_id))
                                  or rec.get("prev") == _expected(keyed, rec, self.prev_raw)):
            self._use(keyed)
            if self.verdict.key_matches is None:
                self.verdict.key_matches = True
        elif scheme == SCHEME_PLAIN:
            self._use(self.plain)
            if keyed is not None:
                self._bad("key", "a key was given, but this run_start says its lines are chained without one "
                          f"({SCHEME_PLAIN}): they were written without the key, or rewritten by someone without it",
                          n)
        elif scheme == SCHEME_KEYED:
            self._use(None)
            seg.verified = None
            if keyed is not None:
                self.verdict.key_matches = False
                self._bad("key", f"the key does not match the one this log was written with (key id "
                          f"{keyed.key_id} given, {key_id} recorded); its chain cannot be verified", n)
            elif not self._told_key:
                self._told_key = True
                self._bad("key", f"the lines from here on are chained with a key ({SCHEME_KEYED}, key id "
                          f"{key_id}); a key is needed to verify them: pass --key-file or set {KEY_ENV}. "
                          "Without it the log cannot prove authorship, nor that it is what was written", n)
        else:
            self._use(keyed or self.plain)
            self._bad("chain", f"run_start records no known chain scheme (payload chain={desc!r}; expected "
                      f"scheme {SCHEME_PLAIN!r} or {SCHEME_KEYED!r})", n)
        if self.active is not None:  # a sealed run_start: every line its process writes is sealed
            self._seal(n, raw, self.active)

    def _seal(self, n: int, raw: bytes, chain: Chain) -> bool | None:
        """Whether line ``n`` holds its seal: True, False (a wrong or missing seal in a sealed log), None
        (no seal: the older format)."""
        if n in self._seal_known:
            return self._seal_known[n]
        sealed = chain.check_seal(raw)[0]
        if sealed:
            self.sealed_seen = True
        elif sealed is False or self.sealed_seen:
            if self.first_seal is None:
                self.first_seal = Finding("chain", self._unsealed(n, raw, chain, sealed), n)
            sealed = False
        self._seal_known[n] = sealed
        return sealed

    def _unsealed(self, n: int, raw: bytes, chain: Chain, sealed: bool | None) -> str:
        if sealed is False:
            if chain is not self.plain and self.plain.check_seal(raw)[0]:
                return (f"line {n} was altered and resealed without the key (its seal is the plain sha256 of its "
                        "bytes, not their HMAC)")
            return f"line {n} was altered after it was written: the seal it carries is not the digest of its bytes"
        if b'"seal":' in raw:
            return (f"line {n} was altered after it was written: its seal is not its last field (a field was "
                    "added after it)")
        return (f"line {n} carries no seal, but this log seals its lines: its seal was removed (the line was "
                "altered after it was written), or an older fsmtrain wrote it")

    def _use(self, chain: Chain | None) -> None:
        self.active = chain
        self._digest = None if chain is None or self.unchained else chain.digest

    def new_epoch(self) -> None:
        """An epoch began: pins older than the previous epoch are no longer looked up."""
        self._pins_before, self.pins = self.pins, {}

    def link(self, n: int, raw: bytes, carried: Any, seq: Any, saving: bool,
             rec: Mapping[str, Any] | None = None) -> None:
        """Check that line ``n`` carries the digest of the line before it (``carried``: its ``prev``; ``saving``:
        its phase stages a checkpoint); ``rec``: the line's value, where it was parsed."""
        prev_raw, before = self.prev_raw, self._before_prev
        self._before_prev, self.prev_raw = prev_raw, raw
        seq_before, self.prev_seq = self.prev_seq, seq
        prev_end, self._prev_end = self._prev_end, saving
        digest = self._digest
        if digest is None:
            if self._tail is not None:
                self._uncovered(prev_raw)
            self.verdict.unverified_lines += not self.unchained
            return
        self._tail, self._last_verified = self.active, n
        if prev_raw is not None:
            expected = digest(prev_raw)
            (self._end_pins if prev_end else self.pins)[expected] = n - 1
            self.verified_links += 1
            if carried == expected and self._pending is None:
                return
        self._link_slow(n, raw, {"prev": carried, "seq": seq} if rec is None else rec, prev_raw, before, seq_before)

    def link_run(self, n: int, lines: list[bytes], carried: list[str], last_seq: int) -> bool:
        """:meth:`link` of lines ``n``, ``n + 1``... (``lines``, none of a save phase, carrying ``carried``)
        at once, when every link holds; False, with nothing changed, when one does not (or the chain is not
        verified here): they are then linked one at a time, which names what went wrong."""
        chain, prev_raw = self.active, self.prev_raw
        if chain is None or self._digest is None or prev_raw is None or self._pending is not None:
            return False
        expected = chain.digests([prev_raw, *lines[:-1]])
        if expected != carried:
            return False
        (self._end_pins if self._prev_end else self.pins)[expected[0]] = n - 1
        self.pins.update(zip(expected[1:], range(n, n + len(lines) - 1), strict=True))
        self._before_prev = lines[-2] if len(lines) > 1 else prev_raw
        self.prev_raw, self.prev_seq, self._prev_end = lines[-1], last_seq, False
        self._tail, self._last_verified = self.active, n + len(lines) - 1
        self.verified_links += len(lines)
        return True

    def link_cycles(self, n: int, lines: list[bytes], carried: list[str], saving: tuple[bool, ...],
                    last_seq: int) -> list[tuple[Digests, Sequence[int], int]] | None:
        """:meth:`link` of lines ``n``, ``n + 1``... (``lines``: whole epochs of ``len(saving)`` lines each, each
        beginning with the move that turns the epoch, carrying ``carried``; ``saving[p]``: line ``p`` of an epoch
        is of a save phase) at once, when every link holds: the digests then pinned as following a save phase's
        line, and their lines (as :meth:`take_cycles` takes them). None, with nothing changed, when one does not
        hold, as :meth:`link_run`."""
        chain, prev_raw, size, total = self.active, self.prev_raw, len(saving), len(lines)
        before_saving = (saving[-1], *saving[:-1])  # line p follows line p - 1 of its epoch, line 0 the last line
        if (chain is None or self._digest is None or prev_raw is None or self._pending is not None
                or self._prev_end != before_saving[0]):
            return None
        expected = chain.digests([prev_raw, *lines[:-1]])
        if expected != carried:
            return None
        lines_before = range(n - 1, n - 1 + total)
        ends: list[tuple[Digests, Sequence[int], int]] = [(expected[p::size], lines_before[p::size], 0)
                                                          for p, end in enumerate(before_saving) if end]
        self.take_cycles(n, total, expected[-2 * size:], lines[-2:], saving, last_seq, ends)
        return ends

    def can_take(self, prev_raw: bytes, chain: Chain | None, prev_end: bool) -> bool:
        """Whether epochs linked elsewhere (:meth:`take_cycles`), whose first line follows ``prev_raw`` (of a save
        phase: ``prev_end``) under ``chain``, can follow the lines linked here."""
        return (chain is not None and chain is self.active and self._digest is not None and self._pending is None
                and self._prev_end == prev_end and self.prev_raw == prev_raw)

    def take_cycles(self, n: int, total: int, tail: list[str], last: list[bytes], saving: tuple[bool, ...],
                    last_seq: int, ends: list[tuple[Digests, Sequence[int], int]]) -> None:
        """Lines ``n``... (``total``, whole epochs of ``len(saving)`` lines) linked, each link found to hold (by
        :meth:`link_cycles`, or in a second process): ``tail``, the digests carried by their last two epochs' lines
        (by the last one's, when there is one), ``last`` their last two lines, ``ends`` the digests carried by
        those that follow a save phase's line, the lines they are the digests of and a number to add to those."""
        for digests, lines, shift in ends:
            self._end_pins.add(digests, lines, shift)
        size, count = len(saving), total // len(saving)
        before_saving = (saving[-1], *saving[:-1])
        # As link files each digest (the line before's) and new_epoch turns the pins at each epoch's first line:
        # of what follows no save phase's line, only the last two epochs' are kept.
        lines_before = range(n - 1 + total - len(tail), n - 1 + total)

        def filed(epoch: int, at: list[int]) -> dict[str, int]:  # epoch: 0, the last one; -1, the one before
            base = len(tail) + (epoch - 1) * size
            return {tail[base + p]: lines_before[base + p] for p in at}

        later = [p for p in range(1, size) if not before_saving[p]]
        turned = self.pins if count == 1 else filed(-1, later)
        turned.update(filed(0, [] if before_saving[0] else [0]))
        self._pins_before, self.pins = turned, filed(0, later)
        self._before_prev = last[-2] if total > 1 else self.prev_raw
        self.prev_raw, self.prev_seq, self._prev_end = last[-1], last_seq, saving[-1]
        self._tail, self._last_verified = self.active, n + total - 1
        self.verified_links += total

    def restart_at(self, prev_raw: bytes, prev_end: bool) -> None:
        """Link the next lines as if they followed ``prev_raw`` (of a save phase: ``prev_end``), all linked before
        it: a second process's start, part-way through the log (:meth:`take_cycles` then takes what it linked)."""
        self.prev_raw, self._pending, self._prev_end = prev_raw, None, prev_end
        self.pins, self._pins_before, self._end_pins = {}, {}, _EndPins()

    def _link_slow(self, n: int, raw: bytes, rec: Mapping[str, Any], prev_raw: bytes | None, before: bytes | None,
                   seq_before: Any) -> None:
        chain = self.active
        assert chain is not None
        carried = rec.get("prev")
        if prev_raw is None:
            if carried is None and "prev" not in rec:
                self.unchained, self._digest, self._tail = True, None, None
                self._bad("chain", "the log is not hash-chained (its lines carry no prev digest): it cannot "
                          "prove itself; it was written by an older fsmtrain, or its chain was stripped", n)
                return
            self.verified_links += 1
            self._seal(n, raw, chain)  # whether this log seals its lines
        expected = _expected(chain, rec, prev_raw)
        ok = carried == expected
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._first_break(*pending.named(ok, carried, self._seal(n, raw, chain)))
        if ok:
            return
        self.verdict.broken_links += 1
        if self._first is None and self._pending is None:
            if prev_raw is None:
                self._first_break(n, self._genesis_message(rec, chain, carried))
            else:
                rebuilt = chain is self.keyed and carried == self.plain.digest(prev_raw)
                dup = raw == prev_raw
                skips = not dup and before is not None and carried == chain.digest(before)
                self._pending = _Break(n, seq_before, rec.get("seq"), rebuilt, skips, dup, expected,
                                       self._seal(n - 1, prev_raw, chain), self._seal(n, raw, chain))

    def link_unparsed(self, raw: bytes) -> None:
        """A line that is not a JSON object: it cannot be checked, but the next line chains to it."""
        self._uncovered(self.prev_raw)
        self.prev_raw, self._before_prev, self.prev_seq = raw, self.prev_raw, None

    def _uncovered(self, last: bytes | None) -> None:
        """The line before (``last``) gets no successor whose link covers it: its seal must."""
        if self._tail is not None and last is not None:
            self._seal(self._last_verified, last, self._tail)
        self._tail = None

    def _genesis_message(self, rec: Mapping[str, Any], chain: Chain, carried: Any) -> str:
        msg = (f"line 1 does not chain to the genesis digest of run id {rec.get('run_id')!r} and the recorded "
               "config: the first line or its config was altered, or lines before it were removed")
        if chain is self.keyed and carried == _expected(self.plain, rec, None):
            msg += "; the chain was rebuilt without the key (it carries plain sha256 digests)"
        return msg

    def _first_break(self, line: int, message: str) -> None:
        self.verdict.first_break = line
        self._first = Finding("chain", message, line)
        if self.segments:
            self.segments[-1].verified = False

    def _bad(self, check: str, message: str, line: int | None) -> None:
        self.findings.append(Finding(check, message, line))

    def pinned_line(self, head: str) -> int | None:
        """The line whose digest ``head`` is, among those a checkpoint may pin (see ``pins``)."""
        return self.pins.get(head, self._pins_before.get(head, self._end_pins.mapping().get(head)))

    def pinned(self, line: int) -> None:
        """A checkpoint pinned ``line``: states commit in order, so no later one pins a line before it."""
        self._end_pins = _EndPins({d: n for d, n in self._end_pins.mapping().items() if n >= line})

    def locate(self, path: Path, head: str) -> int | None:
        """The line of ``path`` whose digest is ``head``: a second pass, for a checkpoint the log lacks."""
        chains = [c for c in (self.plain, self.keyed) if c is not None]
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if any(c.digest(raw) == head for c in chains):
                    return n
        return None

    def finish(self) -> list[Finding]:
        if self._pending is not None:
            self._first_break(*self._pending.named(True, None, None))
            self._pending = None
        v = self.verdict
        first = self._first
        if first is not None and v.broken_links > 1:
            first = Finding(first.check, f"{first.message} ({v.broken_links} broken links in all; the first is "
                            "named)", first.line, first.severity)
        self._uncovered(self.prev_raw)  # the last line
        seal = self.first_seal
        if seal is not None and (first is None or (seal.line or 0) < (first.line or 0)):
            first = seal  # a line that fails its seal with every link holding: the last line, or resealed
            v.first_break = seal.line
        if first is not None:
            self.findings.append(first)
        if self._last_verified and not self.unchained:
            v.sealed = self.sealed_seen
            if not self.sealed_seen:
                last = self._last_verified
                self.findings.append(Finding(
                    "chain", f"line {last}, the last line, is not sealed: no line of this log carries a seal (it was "
                    "written by an older fsmtrain), and the last line has no successor to carry its digest, so it is "
                    "covered by the recomputation of its figures, not by the chain", last, Severity.WARNING))
        if self.unchained or v.first_break is not None:
            v.ok = False
        else:
            v.ok = True if self.verified_links else None  # None: keyed, and no matching key given
        return self.findings
