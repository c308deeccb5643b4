"""``benchmarks/instructions.py``: the arithmetic on callgrind's dumps and the refusals. The valgrind
runs themselves (about 3 minutes a process, torch's import included) stay out of the suite; the
figures are in ``benchmarks/RESULTS_instructions.md`` and the closing notes, with the command that
gives them."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import compare  # noqa: E402
import instructions  # noqa: E402

while str(REPO / "benchmarks") in sys.path:  # instructions.py puts its folder there too
    sys.path.remove(str(REPO / "benchmarks"))

# The shape of a `valgrind --tool=callgrind --compress-strings=no --compress-pos=no` dump (3.19): a
# header, then per object, file and function, lines of "line-number Ir"; a call's record (cfn=,
# calls=) is followed by one line with the call's inclusive cost.
HEADER = "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npart: 3\npositions: line\nevents: Ir\n"


def _dump(body: str, summary: int) -> str:
    return HEADER + body + f"summary: {summary}\n\ntotals: {summary}\n"


def test_a_dump_is_summed_per_function_and_a_call_s_inclusive_cost_is_left_out() -> None:
    text = _dump(
        "ob=/usr/bin/python3.11\nfl=/src/Python/ceval.c\nfn=_PyEval_EvalFrameDefault\n10 100\n11 50\n"
        "cfl=/src/Python/dtoa.c\ncfn=_Py_dg_dtoa\ncalls=3 200\n12 7000\n"  # inclusive: not ceval's own
        "fi=/src/Include/internal/pycore_frame.h\n40 5\nfe=/src/Python/ceval.c\n13 1\n"
        "fl=/src/Python/dtoa.c\nfn=_Py_dg_dtoa\n200 7000\n"
        "fl=/src/Python/ceval.c\nfn=_PyEval_EvalFrameDefault'2\n10 3\n"  # a deeper level of a recursion
        "ob=/usr/lib/libcrypto.so.3\nfl=???\nfn=0x000000000029ad80\n0 40\n",  # no debug information
        7199,
    )
    count = instructions.parse_callgrind(text)
    assert count.total == 7199
    assert count.by_function == {
        ("ceval.c", "_PyEval_EvalFrameDefault"): 154,
        ("pycore_frame.h", "_PyEval_EvalFrameDefault"): 5,  # inlined: under its own file, as cachegrind shows it
        ("dtoa.c", "_Py_dg_dtoa"): 7000,
        ("libcrypto.so.3", "0x000000000029ad80"): 40,
    }
    assert sum(count.by_function.values()) == count.total


def test_compressed_names_are_read_too() -> None:
    text = _dump("fl=(1) /src/a.c\nfn=(1) f\n1 10\nfn=(2) g\n2 5\nfl=(1)\nfn=(1)\n3 1\n", 16)
    assert instructions.parse_callgrind(text).by_function == {("a.c", "f"): 11, ("a.c", "g"): 5}


def test_the_steady_epochs_are_the_dumps_between_the_second_mark_and_the_last() -> None:
    def count(total: int, f: int) -> instructions.Count:
        return instructions.Count(total, Counter({("a.c", "f"): f, ("b.c", "g"): total - f}))

    # 5 epochs, 5 marks: start-up, epoch 0 (warm-up), then epochs 1, 2, 3; epoch 4 ends with the run
    dumps = [count(9_000_000, 1), count(80, 40), count(50, 10), count(52, 12), count(49, 11)]
    epochs = instructions.steady_epochs(dumps, 5)
    assert epochs.totals == [50, 52, 49]
    assert epochs.median == 50
    assert epochs.by_function == {("a.c", "f"): 11, ("b.c", "g"): 39}  # means, rounded down


def test_a_dump_too_many_or_too_few_is_refused() -> None:
    one = instructions.Count(1, Counter())
    with pytest.raises(RuntimeError, match=r"expected one dump per epoch mark \(5\), got 6.*getppid"):
        instructions.steady_epochs([one] * 6, 5)


def test_the_report_gives_medians_ranges_ratio_and_where_the_extra_goes() -> None:
    base = instructions.Epochs([1_000_000, 990_000, 1_020_000],
                               Counter({("ceval.c", "eval"): 600_000, ("x.c", "y"): 10}))
    other = instructions.Epochs([1_030_000, 1_029_000, 1_100_000],
                                Counter({("ceval.c", "eval"): 620_000, ("_json.c", "enc"): 9_000, ("x.c", "y"): 0}))
    text = instructions.report(compare.WORKLOADS["epochs"], ["raw", "fsm"], {"raw": base, "fsm": other}, 5)
    assert "| raw | 1.00 M | 0.99 M to 1.02 M | 50.0 K | 1.0000 |" in text
    assert "| fsm | 1.03 M | 1.03 M to 1.10 M | 51.5 K | 1.0300 |" in text
    assert "median of 3 steady epochs" in text
    assert "Where fsm executes more than raw, per epoch (+30,000 in all" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == ["| 20.0 | `eval` | ceval.c |", "| 9.0 | `enc` | _json.c |"]  # only what it spends more on


def test_a_file_that_is_not_callgrind_s_is_refused() -> None:
    with pytest.raises(ValueError, match="not a callgrind output file"):
        instructions.parse_callgrind("hello\n")


def test_the_worker_calls_getppid_at_each_mark_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def getppid() -> int:
        calls.append(1)
        return 1

    monkeypatch.setattr(os, "getppid", getppid)
    marks = compare._CalledMarks()
    marks.append(1.5)
    marks.append(2.5)
    assert marks == [1.5, 2.5]
    assert len(calls) == 2
    assert compare.MARK_CALL == "getppid"  # what instructions.py has callgrind dump before


def test_without_valgrind_it_says_so_and_runs_nothing(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no valgrind on it
    assert instructions.main(["--frameworks", "raw,fsm"]) == 2
    assert "needs valgrind" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--frameworks", "raw"], "two or more of"),
    (["--frameworks", "raw,nope"], "two or more of"),
    (["--epochs", "2"], "3 or more"),
])
def test_bad_arguments_are_named(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        instructions.main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
