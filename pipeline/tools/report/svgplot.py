"""Inline SVG charts for ``fsmtrain report`` (lines, bars, parallel coordinates), each a ``<figure>``;
every point has a ``<title>`` tooltip, so exact values stay readable without scripts. A curve past
``MAX_POINTS`` is drawn by each bucket's smallest and largest value, so a spike survives, and the note says so."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from html import escape
from operator import itemgetter
from typing import TypeGuard

__all__ = ["GREY", "MAX_POINTS", "PALETTE", "Axis", "Band", "HLine", "Reduced", "Series", "TrialLine", "all_drawable",
           "bar_chart", "colormap", "drawable", "figure", "line_chart", "parallel_chart", "reduce_curve", "spans",
           "ticks"]

MAX_POINTS = 2000
_FIRST = itemgetter(0)
# Colour-blind-safe (Okabe-Ito) colours, in the order series take them.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000")
GREY = "#999999"
_STOPS = ((0.0, (13, 8, 135)), (0.5, (204, 71, 120)), (1.0, (240, 249, 33)))  # colormap's
_FONT = 'font-family="system-ui, sans-serif" font-size="11"'
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 64, 16, 12, 38
_WIDTH = 760  # every chart's, in CSS pixels


@dataclass
class Series:
    """One line of a line chart; ``None`` or non-finite values leave a gap."""

    name: str
    x: Sequence[float]
    y: Sequence[float | None]
    color: str = PALETTE[0]
    dashed: bool = False
    line: bool = True
    points: bool = True
    step: bool = False  # a counter: hold each value until the next x


@dataclass
class HLine:
    """A horizontal reference line (a threshold, a patience)."""

    value: float
    label: str
    color: str = "#B00020"


@dataclass
class Band:
    """A shaded stretch of x (epochs flagged as overfitting)."""

    x0: float
    x1: float
    label: str  # the tooltip of this band
    color: str = "#F4B6B6"
    legend: str = ""  # the legend entry of all bands (default: the first one's label)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a < 1e-3:
        return f"{v:.0e}".replace("e-0", "e-")
    if a >= 1e4:  # 150000 is 1.5e5, not 2e5
        return f"{v:.3g}".replace("e+0", "e").replace("e+", "e")
    return f"{v:.4g}"


def _tip_x(x: float) -> str:
    """An x in a tooltip: a whole number (an epoch, a step) exactly, whatever its size."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else _fmt(x)


def ticks(lo: float, hi: float, log: bool = False) -> list[float]:
    """Round ticks covering [lo, hi]: 1-2-5 steps, or powers of ten on a log axis."""
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        if b - a <= 2:
            out = [m * 10.0**e for e in range(a, b + 1) for m in (1, 2, 5)]
            return [t for t in out if lo / 1.0001 <= t <= hi * 1.0001] or [lo, hi]
        return [10.0**e for e in range(a, b + 1, math.ceil((b - a) / 8))]
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / 5  # about five ticks
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    out, t = [], math.ceil(lo / step - 1e-9) * step
    while t <= hi + step * 1e-9:
        out.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return out


def _scale(lo: float, hi: float, a: float, b: float, log: bool = False) -> Callable[[float], float]:
    """The map of [lo, hi] (log10 of it on a log axis) onto pixels [a, b]; one value is widened to a span."""
    f: Callable[[float], float] = math.log10 if log else float
    lo, hi = f(lo), f(hi)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    return lambda v: a + (f(v) - lo) / (hi - lo) * (b - a)


def figure(plot_id: str, title: str, svg: str, note: str = "") -> str:
    extra = f'<p class="note">{escape(note)}</p>' if note else ""
    return (f'<figure class="plot" id="{escape(plot_id)}"><figcaption>{escape(title)}</figcaption>'
            f"{svg}{extra}</figure>")


def _svg_open(width: int, height: int, label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}" {_FONT}>')


def _legend(items: Sequence[tuple[str, str, bool]], x: float, y: float) -> list[str]:
    out = []
    for name, color, dashed in items:
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 18:.1f}" y2="{y:.1f}" stroke="{color}" '
                   f'stroke-width="2"{dash}/><text x="{x + 22:.1f}" y="{y + 4:.1f}">{escape(name)}</text>')
        x += 30 + 6.2 * len(name)
    return out


def line_chart(plot_id: str, title: str, series: Sequence[Series], *, x_label: str = "epoch", y_label: str = "",
               log_y: bool = False, hlines: Sequence[HLine] = (), bands: Sequence[Band] = (),
               legend: Sequence[tuple[str, str, bool]] | None = None) -> str:
    """A line chart over whole-number x (epochs, trials, steps); ``log_y`` drops values <= 0 and a long
    series is drawn reduced, each noted below it."""
    width, height = _WIDTH, 300
    floor = 0.0 if log_y else -math.inf  # as ``drawable``, inline: a long series is a million values
    dropped = sum(1 for s in series if not all_drawable(s.y, log_y)
                  for y in s.y if y is not None and not floor < y < math.inf)
    cuts = [reduce_curve(s.x, s.y, log=log_y) for s in series]
    series = [replace(s, x=r.x, y=r.y) if r.buckets else s for s, r in zip(series, cuts, strict=True)]
    xs = [float(x) for s in series for x, y in zip(s.x, s.y, strict=True) if drawable(y, log_y)]
    ys = [float(y) for s in series for y in s.y if drawable(y, log_y)]
    ys += [h.value for h in hlines if drawable(h.value, log_y)]
    xs += [v for b in bands for v in (b.x0, b.x1)]
    if not xs or not ys:
        return figure(plot_id, title, "", "no values to draw")
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = (y0 / 1.15, y1 * 1.15) if log_y else (y0 - pad, y1 + pad)
    top, bottom = _PAD_T, height - _PAD_B - 18  # 18: the legend's row
    sx, sy = _scale(x0, x1, _PAD_L, width - _PAD_R), _scale(y0, y1, bottom, top, log=log_y)
    out = [_svg_open(width, height, title)]
    for b in bands:
        left, right = max(sx(b.x0 - 0.5), _PAD_L), min(sx(b.x1 + 0.5), width - _PAD_R)
        out.append(f'<rect class="band" x="{left:.1f}" y="{top}" width="{max(right - left, 1):.1f}" '
                   f'height="{bottom - top}" fill="{b.color}" opacity="0.45"><title>{escape(b.label)}</title></rect>')
    for t in ticks(min(ys) if log_y else y0, max(ys) if log_y else y1, log_y):
        if not (y0 <= t <= y1):
            continue
        y = sy(t)
        out.append(f'<line x1="{_PAD_L}" y1="{y:.1f}" x2="{width - _PAD_R}" y2="{y:.1f}" stroke="#e3e3e3"/>'
                   f'<text x="{_PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    whole = {float(round(t)) for t in ticks(x0, x1) if abs(t - round(t)) < 1e-9}
    for t in sorted(whole | ({x0} if x0 == x1 else set())):
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#666"/>'
                   f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<rect x="{_PAD_L}" y="{top}" width="{width - _PAD_L - _PAD_R}" height="{bottom - top}" '
               f'fill="none" stroke="#666"/>')
    out.append(f'<text x="{(_PAD_L + width - _PAD_R) / 2:.1f}" y="{bottom + 30}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    if y_label:
        out.append(f'<text transform="translate(12 {(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle">'
                   f'{escape(y_label + (" (log scale)" if log_y else ""))}</text>')
    for h in hlines:
        if drawable(h.value, log_y):
            y = sy(h.value)
            out.append(f'<line class="hline" x1="{_PAD_L}" y1="{y:.1f}" x2="{width - _PAD_R}" y2="{y:.1f}" '
                       f'stroke="{h.color}" stroke-dasharray="6 4" stroke-width="1.5"><title>{escape(h.label)}'
                       f'</title></line><text x="{width - _PAD_R - 4}" y="{y - 4:.1f}" text-anchor="end" '
                       f'fill="{h.color}">{escape(h.label)}</text>')
    for s in series:
        out += _draw_series(s, sx, sy, log_y)
    if legend is None:
        legend = [(s.name, s.color, s.dashed) for s in series]
        legend += [(b.legend or b.label, b.color, False) for b in bands[:1]]
    out += _legend(legend, _PAD_L, height - 10)
    out.append("</svg>")
    notes = [f"{dropped} value(s) <= 0 or not finite are not drawn"] if dropped else []
    notes += _reduced_note(cuts)
    return figure(plot_id, title, "".join(out), "; ".join(notes))


def _reduced_note(cuts: Sequence[Reduced]) -> list[str]:
    done = [r for r in cuts if r.buckets]
    if not done:
        return []
    big = max(done, key=lambda r: r.points)
    drawn, per_bucket = sum(len(r.y) for r in done), math.ceil(big.points / big.buckets)
    return [f"reduced: {sum(r.points for r in done):,} points drawn as {drawn:,}, the smallest and largest value of "
            f"each run of {per_bucket:,} consecutive points ({big.buckets:,} runs a curve), so spikes stay"]


def _draw_series(s: Series, sx: Callable[[float], float], sy: Callable[[float], float], log_y: bool) -> list[str]:
    out: list[str] = []
    runs: list[list[tuple[float, float, float, float]]] = [[]]
    for x, y in zip(s.x, s.y, strict=True):
        if not drawable(y, log_y):
            runs.append([])
            continue
        runs[-1].append((sx(x), sy(y), float(x), float(y)))
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    for run in runs:
        if s.line and len(run) > 1:
            pts: list[str] = []
            for i, (px, py, _, _) in enumerate(run):
                if s.step and i:
                    pts.append(f"{px:.1f},{run[i - 1][1]:.1f}")
                pts.append(f"{px:.1f},{py:.1f}")
            out.append(f'<polyline class="series" points="{" ".join(pts)}" fill="none" stroke="{s.color}" '
                       f'stroke-width="2"{dash}><title>{escape(s.name)}</title></polyline>')
        if s.points or len(run) == 1:
            for px, py, x, y in run:
                out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.6" fill="{s.color}">'
                           f'<title>{escape(s.name)} at {_tip_x(x)}: {y:.6g}</title></circle>')
    return out


def bar_chart(plot_id: str, title: str, items: Sequence[tuple[str, float]], *, unit: str = "s",
              color: str = PALETTE[0], total: float | None = None) -> str:
    """Horizontal bars, largest first, with each value's share of ``total`` (default: their sum)."""
    items = sorted(((k, v) for k, v in items if math.isfinite(v)), key=lambda kv: -kv[1])
    if not items:
        return figure(plot_id, title, "", "no values to draw")
    label_w = min(260, 12 + 6.6 * max(len(k) for k, _ in items))
    row, top = 20, 6
    height = top + row * len(items) + 8
    total = (total if total is not None and total > 0 else sum(v for _, v in items)) or 1.0
    vmax = max(v for _, v in items) or 1.0
    bar_w = _WIDTH - label_w - 150
    out = [_svg_open(_WIDTH, height, title)]
    for i, (name, v) in enumerate(items):
        y = top + i * row
        w = max(bar_w * v / vmax, 1.0)
        out.append(f'<text x="{label_w - 6:.1f}" y="{y + 13}" text-anchor="end">{escape(name)}</text>'
                   f'<rect class="bar" x="{label_w:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" '
                   f'fill="{color}"><title>{escape(name)}: {v:.6g} {unit}</title></rect>'
                   f'<text x="{label_w + w + 6:.1f}" y="{y + 13}">{v:.4g} {unit} '
                   f'({100 * v / total:.1f}%)</text>')
    out.append("</svg>")
    return figure(plot_id, title, "".join(out))


@dataclass
class Axis:
    """One vertical axis of a parallel-coordinates chart."""

    name: str
    log: bool = False
    categories: list[str] = field(default_factory=list)  # a categorical axis: values are their indexes


@dataclass
class TrialLine:
    """One trial in a parallel-coordinates chart: its place on each axis, colour and tooltip."""

    values: list[float | None]
    color: str
    tip: str


def parallel_chart(plot_id: str, title: str, axes: Sequence[Axis], lines: Sequence[TrialLine]) -> str:
    """Parallel coordinates: one vertical axis per entry of ``axes``, one polyline per trial."""
    if not axes or not lines:
        return figure(plot_id, title, "", "no complete trials to draw")
    width, height = _WIDTH, 320
    top, bottom = 28, height - 22
    left, right = 70, width - 70
    step = (right - left) / max(len(axes) - 1, 1)
    scales: list[Callable[[float], float]] = []
    out = [_svg_open(width, height, title)]
    for i, ax in enumerate(axes):
        vals = [v for v in (ln.values[i] for ln in lines) if drawable(v, ax.log)]
        lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
        if ax.categories:
            lo, hi = -0.5, len(ax.categories) - 0.5
        scales.append(_scale(lo, hi, bottom, top, log=ax.log and lo > 0))
        x = left + i * step
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#444"/>'
                   f'<text x="{x:.1f}" y="{top - 12}" text-anchor="middle" font-weight="bold">'
                   f'{escape(ax.name + (" (log)" if ax.log else ""))}</text>')
        labels = ([(float(k), c) for k, c in enumerate(ax.categories)] if ax.categories
                  else [(lo, _fmt(lo)), (hi, _fmt(hi))])
        for v, text in labels:
            out.append(f'<text x="{x + 4:.1f}" y="{scales[i](v) + 4:.1f}" fill="#555">{escape(text)}</text>')
    for ln in lines:
        pts = [f"{left + i * step:.1f},{scales[i](v):.1f}" for i, v in enumerate(ln.values)
               if drawable(v, axes[i].log)]
        out.append(f'<polyline class="trial" points="{" ".join(pts)}" fill="none" stroke="{ln.color}" '
                   f'stroke-width="1.6" opacity="0.8"><title>{escape(ln.tip)}</title></polyline>')
    out.append("</svg>")
    return figure(plot_id, title, "".join(out))


def colormap(t: float) -> str:
    """``t`` in [0, 1] to a colour from dark blue (0, best) to yellow (1)."""
    t = min(max(t, 0.0), 1.0)
    (a, ca), (b, cb) = _STOPS[:2] if t <= 0.5 else _STOPS[1:]
    f = (t - a) / (b - a)
    return "#" + "".join(f"{round(c0 + f * (c1 - c0)):02x}" for c0, c1 in zip(ca, cb, strict=True))


@dataclass(frozen=True)
class Reduced:
    x: list[float]
    y: list[float | None]
    points: int  # how many the curve had
    buckets: int  # 0: not reduced


def drawable(v: float | None, log: bool = False) -> TypeGuard[float]:
    """A value a chart can place: finite, and positive on a log axis (NaN fails both comparisons)."""
    return v is not None and (0.0 if log else -math.inf) < v < math.inf


def all_drawable(y: Sequence[float | None], log: bool = False) -> TypeGuard[Sequence[float]]:
    """Whether every value of ``y`` is :func:`drawable`, found by a few calls that each run in C (a long series is a
    million values): no None, a finite sum (an inf or a NaN makes it inf or NaN) and, on a log axis, a positive
    least. False can also mean that it could not tell (a sum that overflows): ask :func:`drawable` then."""
    try:
        total = sum(y)  # type: ignore[arg-type]  # (a None fails it: one pass, not two)
    except TypeError:
        return False
    return math.isfinite(total) and (not log or not y or min(y) > 0)  # type: ignore[type-var,operator]


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
    whole = y if all_drawable(y, log) else None
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if whole is not None:  # every value drawable: the bucket's least and greatest, each the first of its equals
            part = whole[lo:hi]
            for i in sorted({lo + part.index(min(part)), lo + part.index(max(part))}):
                out_x.append(float(x[i]))
                out_y.append(y[i])
            continue
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
