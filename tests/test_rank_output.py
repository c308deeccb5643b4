"""What a rank of a multi-process run prints reaches the shared terminal in whole lines, the other
ranks' tagged (issue 23, item 4: a user callback's print came once per rank, sometimes two on one
line). The real two-rank run is in tests/test_distributed_scale.py; this is the stream itself."""

from __future__ import annotations

import io

from fsmtrain.app.launch import RankLines


class _Writes(io.StringIO):
    """A stream that keeps every write it was given, as the terminal's pipe would receive them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_rank_passes_on_whole_lines_each_in_one_write_and_tagged() -> None:
    target = _Writes()
    out = RankLines(target, "[rank 1] ")
    print("epoch 0 ended,", "said a callback", file=out)  # print writes the text, then the newline
    out.write("half a ")
    assert target.writes == ["[rank 1] epoch 0 ended, said a callback\n"]  # nothing of a line cut in two
    print("line\nand another", file=out)
    assert target.writes[1:] == ["[rank 1] half a line\n", "[rank 1] and another\n"]
    assert all(w.endswith("\n") for w in target.writes)


def test_a_line_without_its_end_is_not_lost_at_flush() -> None:
    target = _Writes()
    out = RankLines(target, "")
    out.write("no newline yet")
    out.flush()
    assert target.getvalue() == "no newline yet"
