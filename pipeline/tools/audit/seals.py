"""The audit's check of each line's seal (:mod:`fsmtrain.core.chain`): the digest of the line's own
bytes without its ``seal`` field. The chain's links prove every line but the last (its successor
carries its digest); the seal proves the last one too (and a line no checkable line follows), and
around a break it says which line was altered. A line whose successor's link holds needs no seal
check: that link covers every byte of it, seal included.

A log whose first line (or a ``run_start``) is sealed seals every line: a line of it without a seal
had it removed. A log with no seal at all was written before lines were sealed: its chain is checked
as before, and its last line is reported as outside the chain (a warning).
"""

from __future__ import annotations

from fsmtrain.core.chain import Chain
from fsmtrain.tools.audit.verdict import Finding, Severity

__all__ = ["SealCheck"]


class SealCheck:
    """The seal of a line, looked at where the chain needs it (:meth:`status`); ``first``: the first
    line found failing its seal."""

    def __init__(self) -> None:
        self.plain = Chain()
        self.seen = False  # a line carried a seal: the log seals its lines
        self.first: Finding | None = None
        self._known: dict[int, bool | None] = {}  # a few lines, around a break and at the end

    def status(self, n: int, raw: bytes, chain: Chain) -> bool | None:
        """Whether line ``n`` holds its seal under ``chain``: True, False (its seal does not match, or
        it has none in a log that seals its lines), None (no seal: a log of the older format)."""
        if n in self._known:
            return self._known[n]
        sealed = chain.check_seal(raw)[0]
        if sealed:
            self.seen = True
        elif sealed is False or self.seen:
            if self.first is None:
                self.first = Finding("chain", self._why(n, raw, chain, sealed), n)
            sealed = False
        self._known[n] = sealed
        return sealed

    def _why(self, n: int, raw: bytes, chain: Chain, sealed: bool | None) -> str:
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

    @staticmethod
    def older_format(last: int) -> Finding:
        return Finding("chain", f"line {last}, the last line, is not sealed: no line of this log carries a seal (it "
                       "was written by an older fsmtrain), and the last line has no successor to carry its digest, so "
                       "it is covered by the recomputation of its figures, not by the chain", last, Severity.WARNING)
