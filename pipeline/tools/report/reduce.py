"""Fewer points for long curves: past ``MAX_POINTS``, each bucket of consecutive points is drawn by
its smallest and largest value, in order, so a one-epoch spike survives (an average would smooth it
away). A bucket with no drawable value stays a gap; the page says what was reduced."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import TypeGuard

__all__ = ["MAX_POINTS", "Reduced", "drawable", "reduce_curve", "spans"]

MAX_POINTS = 2000
_FIRST = itemgetter(0)


@dataclass(frozen=True)
class Reduced:
    x: list[float]
    y: list[float | None]
    points: int  # how many the curve had
    buckets: int  # 0: not reduced

    @property
    def per_bucket(self) -> int:
        return math.ceil(self.points / self.buckets) if self.buckets else 1


def drawable(v: float | None, log: bool = False) -> TypeGuard[float]:
    """A value a chart can place: finite, and positive on a log axis (NaN fails both comparisons)."""
    return v is not None and (0.0 if log else -math.inf) < v < math.inf


def reduce_curve(x: Sequence[float], y: Sequence[float | None], *, log: bool = False,
                 max_points: int = MAX_POINTS) -> Reduced:
    """``(x, y)`` unchanged up to ``max_points`` points; else the min and max of ``max_points // 2`` buckets."""
    n = len(y)
    if n <= max_points:
        return Reduced(list(x), list(y), n, 0)
    buckets = max(1, max_points // 2)
    floor = 0.0 if log else -math.inf
    out_x: list[float] = []
    out_y: list[float | None] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        points = [(v, i) for i in range(lo, hi) if (v := y[i]) is not None and floor < v < math.inf]
        if not points:  # nothing to draw here: a gap, as the full curve has one
            out_x.append(float(x[(lo + hi - 1) // 2]))
            out_y.append(None)
            continue
        for i in sorted({min(points, key=_FIRST)[1], max(points, key=_FIRST)[1]}):  # the first of equal values
            out_x.append(float(x[i]))
            out_y.append(y[i])
    return Reduced(out_x, out_y, n, buckets)


def spans(xs: Sequence[float], *, step: float = 1.0, max_spans: int = MAX_POINTS // 4) -> list[tuple[float, float]]:
    """Sorted x values (flagged epochs) as ``(first, last)`` runs of consecutive values; more than
    ``max_spans`` runs are merged across the smallest gaps until that many are left."""
    runs: list[tuple[float, float]] = []
    for v in xs:
        if runs and v - runs[-1][1] <= step:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    if len(runs) <= max_spans:
        return runs
    gaps = sorted(range(len(runs) - 1), key=lambda i: runs[i + 1][0] - runs[i][1])
    joined = set(gaps[: len(runs) - max_spans])  # close the smallest gaps first
    merged: list[tuple[float, float]] = []
    for i, run in enumerate(runs):
        if merged and i - 1 in joined:
            merged[-1] = (merged[-1][0], run[1])
        else:
            merged.append(run)
    return merged
