"""The audit's check of each line's seal (:mod:`pipeline.core.chain`): the digest of the line's own
bytes without its ``seal`` field. The chain's links prove every line but the last (its successor
carries its digest); the seal proves the last one too, and names an altered line directly.

Once a line of a log carries a seal, every later line must: the writer seals every line, so a line
without one had it removed (or was written by an older fsmtrain that resumed a newer log). A log
with no seal at all was written before lines were sealed: its chain is checked as before, and its
last line is reported as outside the chain (a warning).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.chain import SEAL_FIELD, Chain
from pipeline.tools.audit.verdict import Finding, Severity

__all__ = ["SealCheck"]


class SealCheck:
    """Fed the seal check of every line the chain verifies (:meth:`failed` for those that are not
    sealed as they should be); :meth:`finding` gives the first failure."""

    def __init__(self, plain: Chain) -> None:
        self.plain = plain
        self.seen = False  # a line carried a seal: from then on every line must
        self.broken = 0
        self.first: Finding | None = None

    def unsealed(self, n: int, raw: bytes, rec: Mapping[str, Any], chain: Chain, sealed: bool | None) -> bool | None:
        """Line ``n`` carries no valid seal (``sealed`` False: a seal that does not match, None: none
        at its end). Returns False when that is a failure, None for a line of the older format."""
        if sealed is None and not self.seen:
            return None
        self.broken += 1
        if self.first is None:
            self.first = Finding("chain", self._why(n, raw, rec, chain, sealed), n)
        return False

    def _why(self, n: int, raw: bytes, rec: Mapping[str, Any], chain: Chain, sealed: bool | None) -> str:
        if sealed is False:
            if chain is not self.plain and self.plain.check_seal(raw)[0]:
                return (f"line {n} was altered and resealed without the key (its seal is the plain sha256 of its "
                        "bytes, not their HMAC)")
            return f"line {n} was altered after it was written: the seal it carries is not the digest of its bytes"
        if SEAL_FIELD in rec:
            return (f"line {n} was altered after it was written: its seal is not its last field (a field was "
                    "added after it)")
        return (f"line {n} carries no seal, but the lines before it do: its seal was removed (the line was altered "
                "after it was written), or an older fsmtrain wrote it")

    def finding(self) -> Finding | None:
        """The first line that fails its seal, with how many do."""
        first = self.first
        if first is None or self.broken == 1:
            return first
        return Finding(first.check, f"{first.message} ({self.broken} lines fail their seals; the first is named)",
                       first.line)

    @staticmethod
    def older_format(last: int) -> Finding:
        return Finding("chain", f"line {last}, the last line, is not sealed: no line of this log carries a seal (it "
                       "was written by an older fsmtrain), and the last line has no successor to carry its digest, so "
                       "it is covered by the recomputation of its figures, not by the chain", last, Severity.WARNING)
