"""Long curves are drawn reduced: the min and max of each bucket, so a spike survives, and the page
says so. No timings here: ``benchmarks/report_speed.py`` measures a
200,000-epoch report."""

from __future__ import annotations

import itertools
import math
import re
import sys
import tempfile
from pathlib import Path

import pytest

from fsmtrain.tools.report import write_run_report
from fsmtrain.tools.report.svgplot import MAX_POINTS, Series, all_drawable, drawable, line_chart, reduce_curve, spans

REPO = Path(__file__).resolve().parents[1]


def _curve(n: int, spike: int) -> tuple[list[float], list[float | None]]:
    x = [float(i + 1) for i in range(n)]
    y: list[float | None] = [1.0 + math.exp(-i / (n / 5)) + 0.01 * math.sin(i) for i in range(n)]
    y[spike] = 50.0
    return x, y


def test_a_reduced_curve_keeps_its_spike_its_floor_and_its_gaps() -> None:
    x, y = _curve(200_000, spike=123_457)
    for i in range(150_000, 151_000):  # a stretch of missing values (five buckets wide)
        y[i] = None
    y[10] = math.nan
    cut = reduce_curve(x, y)
    assert cut.points == 200_000 and cut.buckets == MAX_POINTS // 2 and len(cut.y) <= MAX_POINTS
    assert 50.0 in cut.y and x[123_457] in cut.x  # the spike, at its own epoch
    finite = [v for v in y if v is not None and math.isfinite(v)]
    drawn = [v for v in cut.y if v is not None]
    assert min(drawn) == min(finite) and max(drawn) == max(finite)
    assert all(math.isfinite(v) for v in drawn)
    gaps = [cut.x[i] for i, v in enumerate(cut.y) if v is None]
    assert gaps and all(150_000 <= g <= 151_001 for g in gaps)
    assert cut.x == sorted(cut.x)
    short = reduce_curve(x[:MAX_POINTS], y[:MAX_POINTS])
    assert short.buckets == 0 and short.y == y[:MAX_POINTS]  # short curves are drawn as they are


def _reduced_by_hand(x: list[float], y: list[float | None], log: bool) -> tuple[list[float], list[float | None]]:
    """Each bucket's least and greatest drawable value, the first of equals, in order; a gap where it has none."""
    n, buckets = len(y), MAX_POINTS // 2
    out_x: list[float] = []
    out_y: list[float | None] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        at = [i for i in range(lo, hi) if drawable(y[i], log)]
        if not at:
            out_x.append(x[(lo + hi - 1) // 2])
            out_y.append(None)
            continue
        least = min(at, key=lambda i: (y[i], i))
        greatest = min(at, key=lambda i: (-y[i], i))  # type: ignore[operator]
        for i in sorted({least, greatest}):
            out_x.append(x[i])
            out_y.append(y[i])
    return out_x, out_y


@pytest.mark.parametrize("case", ["drawable", "ties", "negative_zero", "nan", "none", "log_nonpositive"])
def test_a_curve_is_reduced_alike_whether_every_value_is_drawable_or_not(case: str) -> None:
    """Every value drawable (checked in bulk, each bucket's min and max found in C) or not (one at a time): the
    same buckets, points and first-of-equal choices as written out by hand."""
    x, y = _curve(30_011, spike=20_000)
    log = case == "log_nonpositive"
    if case == "ties":
        y = [round(v, 1) for v in y]  # type: ignore[arg-type]
    elif case == "negative_zero":
        y = [-0.0 if i % 7 == 0 else 0.0 for i in range(len(y))]
    elif case in ("nan", "none", "log_nonpositive"):
        y[15] = {"nan": math.nan, "none": None, "log_nonpositive": 0.0}[case]
    assert all_drawable(y, log) == (case in ("drawable", "ties", "negative_zero"))
    cut = reduce_curve(x, y, log=log)
    expected = _reduced_by_hand(x, y, log)
    assert (cut.x, repr(cut.y)) == (expected[0], repr(expected[1]))


def test_a_long_curve_is_a_small_chart_that_says_it_was_reduced() -> None:
    x, y = _curve(200_000, spike=77_777)
    svg = line_chart("plot-loss", "loss", [Series("val loss", x, y)], log_y=True)
    assert len(svg) < 400_000, len(svg)
    assert "<title>val loss at 77778: 50</title>" in svg  # the spike's point and tooltip, at its epoch
    note = re.search(r'<p class="note">([^<]*)</p>', svg)
    assert note is not None
    assert note.group(1) == ("reduced: 200,000 points drawn as 2,000, the smallest and largest value of each run of "
                             "200 consecutive points (1,000 runs a curve), so spikes stay"), note.group(1)


def test_flagged_epochs_become_few_bands() -> None:
    assert spans([1, 2, 3, 7, 8, 20]) == [(1, 3), (7, 8), (20, 20)]
    many = [float(e) for e in range(0, 200_000, 3)]  # every third epoch: 66,667 one-epoch stretches
    merged = spans(many, max_spans=100)
    assert len(merged) == 100 and merged[0][0] == 0 and merged[-1][1] == many[-1]
    assert all(a <= b for a, b in merged) and all(b < c for (_, b), (c, _) in itertools.pairwise(merged))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_long_run_report_is_small_says_it_reduced_and_keeps_the_spike() -> None:
    """A 6,000-epoch log of the benchmark's kind (a real run's epoch block repeated, audit-clean)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import report_speed
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    epochs = 6000
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "long"
        run.mkdir()
        report_speed.build_log(report_speed.real_run(Path(tmp) / "real"), epochs, run / "events.jsonl")
        page = write_run_report(run / "events.jsonl").read_text(encoding="utf-8")
    assert len(page.encode()) < 2_000_000
    spike = report_speed.spike_epoch(epochs) + 1
    assert f"<title>val loss at {spike}: {report_speed.SPIKE:.6g}</title>" in page
    loss = page[page.index('id="plot-loss"'):page.index('id="plot-lr"')]
    assert "reduced: " in loss and "so spikes stay" in loss
    overfit = page[page.index('id="plot-overfit"'):page.index('id="plot-early-stopping"')]
    assert overfit.count('<rect class="band"') <= MAX_POINTS // 4
    assert "flagged epochs: 1, 998, 1995, 2992, 3989, 4201-4320, 4986, 5983<" in overfit  # as stretches
    assert 'Audit: <span class="ok">OK' in page
