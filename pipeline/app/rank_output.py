"""What the ranks of a multi-process run print: whole lines, each in one write (``print`` writes text
and newline in two calls, so two ranks' lines could land on one), tagged ``[rank r]`` but on rank 0."""

from __future__ import annotations

import io
import sys
from typing import TextIO

__all__ = ["RankLines", "tag_rank_output"]


class RankLines(io.TextIOBase):
    """A text stream that passes on whole lines only, each in one write, prefixed with ``prefix``."""

    def __init__(self, target: TextIO, prefix: str) -> None:
        super().__init__()
        self.target, self.prefix = target, prefix
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            self.target.write("".join(f"{self.prefix}{line}\n" for line in done.split("\n")))
            self.target.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:  # a line without its end yet: passed on whole, so it is not lost
            self.target.write(f"{self.prefix}{self._pending}")
            self._pending = ""
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()

    def isatty(self) -> bool:
        return bool(getattr(self.target, "isatty", lambda: False)())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")


def tag_rank_output(rank: int) -> None:
    """This process is rank ``rank``: its stdout writes whole lines, tagged unless rank 0. Rank 0 on a
    terminal keeps its (line-buffered) stream, where its progress bar redraws a line in place."""
    if isinstance(sys.stdout, RankLines) or (rank == 0 and sys.stdout.isatty()):
        return
    sys.stdout = RankLines(sys.stdout, "" if rank == 0 else f"[rank {rank}] ")
