"""Each line's seal (:mod:`fsmtrain.core.chain`): the digest of its own bytes without ``seal``.
Links prove every line but the last; the seal proves the last one, and around a break says which
line was altered. A log whose lines are sealed must seal every line; one with no seal at all is of
the older format (its last line is then reported as outside the chain).
"""

from __future__ import annotations

from fsmtrain.core.chain import Chain
from fsmtrain.tools.audit.verdict import Finding, Severity

__all__ = ["SealCheck"]


class SealCheck:
    """Seals, checked where the chain needs them (:meth:`status`); ``first``: the first that fails."""

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
