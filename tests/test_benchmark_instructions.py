"""``benchmarks/instructions.py``: the arithmetic on cachegrind's files and the refusals. The
valgrind runs themselves (about 100 s a process, torch's import included) stay out of the suite;
the figures are in the closing notes, with the command that gives them."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import instructions  # noqa: E402
from compare import WORKLOADS  # noqa: E402

while str(REPO / "benchmarks") in sys.path:  # instructions.py puts its folder there too
    sys.path.remove(str(REPO / "benchmarks"))

# The shape of a `valgrind --tool=cachegrind --cache-sim=no` output file (3.19): a header, then per
# source file and function, lines of "line-number Ir"; a function may appear under several lines.
HEADER = "desc: I1 cache: 32768 B, 64 B, 8-way associative\ncmd: python x.py\nevents: Ir\n"


def _file(counts: dict[tuple[str, str], list[int]], summary: int) -> str:
    body = "".join(f"fl=/src/{fl}\nfn={fn}\n" + "".join(f"{i + 10} {n}\n" for i, n in enumerate(ns))
                   for (fl, fn), ns in counts.items())
    return HEADER + body + f"summary: {summary}\n"


def test_a_cachegrind_file_is_summed_per_function() -> None:
    text = _file({("ceval.c", "_PyEval_EvalFrameDefault"): [100, 50], ("dtoa.c", "_Py_dg_dtoa"): [7]}, 157)
    count = instructions.parse_cachegrind(text)
    assert count.total == 157
    assert count.by_function == {("ceval.c", "_PyEval_EvalFrameDefault"): 150, ("dtoa.c", "_Py_dg_dtoa"): 7}


def test_one_epoch_is_the_long_run_minus_the_short_over_the_extra_epochs() -> None:
    short = instructions.parse_cachegrind(_file({("a.c", "f"): [1000], ("b.c", "g"): [5]}, 1005))
    long = instructions.parse_cachegrind(_file({("a.c", "f"): [3000], ("c.c", "h"): [400]}, 3400))
    epoch = instructions.per_epoch(short, long, 10)
    assert epoch.total == 239  # (3400 - 1005) // 10: start-up and teardown cancel out
    assert epoch.by_function[("a.c", "f")] == 200
    assert epoch.by_function[("c.c", "h")] == 40
    assert epoch.by_function[("b.c", "g")] == -1  # only in the short run: -5 // 10


def test_the_report_gives_the_ratio_and_where_the_extra_goes() -> None:
    base = instructions.Count(1_000_000, Counter({("ceval.c", "eval"): 600_000, ("x.c", "y"): 10}))
    other = instructions.Count(1_030_000, Counter({("ceval.c", "eval"): 620_000, ("_json.c", "enc"): 9_000,
                                                               ("x.c", "y"): 0}))
    text = instructions.report(WORKLOADS["epochs"], ["raw", "fsm"], {"raw": base, "fsm": other}, 5)
    assert "| raw | 1.00 M | 50.0 K | 1.0000 |" in text
    assert "| fsm | 1.03 M | 51.5 K | 1.0300 |" in text
    assert "Where fsm executes more than raw, per epoch (+30 K in all)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == ["| 20.0 | `eval` | ceval.c |", "| 9.0 | `enc` | _json.c |"]  # only what it spends more on


def test_a_file_that_is_not_cachegrind_s_is_refused() -> None:
    with pytest.raises(ValueError, match="not a cachegrind output file"):
        instructions.parse_cachegrind("hello\n")


def test_without_valgrind_it_says_so_and_runs_nothing(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no valgrind on it
    assert instructions.main(["--frameworks", "raw,fsm"]) == 2
    assert "needs valgrind" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--frameworks", "raw"], "two or more of"),
    (["--frameworks", "raw,nope"], "two or more of"),
    (["--short", "5", "--long", "5"], "2 <= short < long"),
])
def test_bad_arguments_are_named(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        instructions.main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
