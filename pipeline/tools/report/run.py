"""The run half of ``fsmtrain report``: one run's page (charts, path diagram, audit) from its
``events.jsonl`` alone, read once, without torch. Epochs are shown 1-based, as the console counts them."""

from __future__ import annotations

import math
import shutil
from html import escape
from pathlib import Path
from typing import Any

from fsmtrain.app.global_batch import describe_global_batch
from fsmtrain.core.drawing import DiagramError, Format, path_diagram
from fsmtrain.core.lifecycle import TRANSITIONS, Phase
from fsmtrain.core.log_file import collector_paused
from fsmtrain.core.run_path import RunPath
from fsmtrain.tools.audit import AuditReport
from fsmtrain.tools.report.run_log import RunData, as_float, read_run
from fsmtrain.tools.report.svgplot import (
    GREY,
    PALETTE,
    Band,
    HLine,
    Series,
    all_drawable,
    bar_chart,
    figure,
    line_chart,
    spans,
)

__all__ = ["RUN_PLOTS", "run_sections"]

# The ids of the plots and panels every run report has (the Chromium test checks each one).
RUN_PLOTS = ("plot-loss", "plot-lr", "plot-grad-norm", "plot-overfit", "plot-early-stopping",
             "diagram-lifecycle", "stop", "checkpoints", "plot-phase-time", "plot-callback-time", "audit")
_LOSSES = ("train_loss", "val_loss")


def _positive_span(values: list[float | None]) -> bool:
    if values and all_drawable(values):
        return min(values) > 0
    return min((v for v in values if v is not None and -math.inf < v < math.inf), default=0.0) > 0


def _loss_plot(data: RunData, bands: list[Band]) -> str:
    losses = {k: data.metric(k) for k in _LOSSES}
    series = [Series(k.replace("_", " "), data.x, losses[k], PALETTE[i]) for i, k in enumerate(_LOSSES)]
    predicted = data.slot("loss_prediction", "predicted_loss")
    if any(p is not None for p in predicted):
        series.append(Series("predicted_final_loss (the predicted final val loss, made at each epoch)", data.x,
                             predicted, PALETTE[2], dashed=True))
    last = next((p for p in reversed(predicted) if p is not None), None)
    hlines = [HLine(last, f"last prediction {last:.4g}", PALETTE[2])] if last is not None else []
    log = all(_positive_span(v) for v in losses.values())
    return line_chart("plot-loss", "Train and val loss per epoch", series, y_label="loss", log_y=log,
                      hlines=hlines, bands=bands)


def _metric_plots(data: RunData) -> list[str]:
    names = [k for k in data.table.columns.get("metric", {}) if k not in (*_LOSSES, "lr")]
    return [line_chart(f"plot-metric-{name}", f"{name} per epoch",
                       [Series(name, data.x, data.metric(name), PALETTE[(i + 3) % len(PALETTE)])], y_label=name)
            for i, name in enumerate(names)]


def _lr_plot(data: RunData) -> str:
    ys = data.metric("lr")
    vals = [v for v in ys if v is not None and v > 0]
    log = bool(vals) and len(vals) == len(ys) and max(vals) / min(vals) > 10
    return line_chart("plot-lr", "Learning rate per epoch", [Series("lr", data.x, ys, PALETTE[4])],
                      y_label="learning rate", log_y=log)


def _grad_plot(data: RunData) -> str:
    ys = data.slot("max_grad_norm")
    threshold = data.setting("GradientMonitorCallback", "warn_threshold", "callbacks", "gradient_monitor",
                             "warn_threshold")
    hlines = [HLine(threshold, f"warning threshold {threshold:g}")] if threshold is not None else []
    note = "" if threshold is not None else " (threshold not in the log)"
    return line_chart("plot-grad-norm", "Max gradient norm per epoch against the warning threshold" + note,
                      [Series("max grad norm", data.x, ys, PALETTE[5])], y_label="L2 norm",
                      log_y=_positive_span(ys), hlines=hlines)


def _shown_epochs(runs: list[tuple[float, float]]) -> str:
    parts = [f"{a:g}" if a == b else f"{a:g}-{b:g}" for a, b in runs[:30]]
    return ", ".join(parts) + (f" and {len(runs) - 30:,} more stretches" if len(runs) > 30 else "")


def _overfit(data: RunData) -> tuple[str, list[Band]]:
    """val/train loss of every epoch, with the epochs ``OverfitDetectionCallback`` flagged (slot
    ``overfit_gap_ratio`` set) marked and shaded, one band a stretch of flagged epochs."""
    x, gap = data.x, data.slot("overfit_gap_ratio")
    flagged = [float(ep) for ep, g in zip(x, gap, strict=True) if g is not None]
    bands = [Band(a, b, f"overfitting flagged in epoch {a:g}" if a == b else
                  f"overfitting flagged in epochs {a:g}-{b:g}", legend="epochs flagged as overfitting")
             for a, b in spans(flagged)]
    ratio = [val / train if train and val is not None and math.isfinite(train) else None
             for train, val in zip(data.metric("train_loss"), data.metric("val_loss"), strict=True)]
    series = [Series("val loss / train loss", x, ratio, GREY, points=False),
              Series("flagged as overfitting", x, gap, "#B00020", line=False)]
    note = (f"flagged epochs: {_shown_epochs(spans(flagged, max_spans=len(flagged)))}" if flagged
            else "no epoch was flagged as overfitting")
    svg = line_chart("plot-overfit", "Overfitting: val/train loss ratio and the epochs flagged", series,
                     y_label="val / train", bands=bands)
    return svg.replace("</figure>", f'<p class="note">{escape(note)}</p></figure>'), bands


def _early_stopping_plot(data: RunData) -> str:
    ys = data.slot("early_stopping_wait")
    patience = data.setting("EarlyStoppingCallback", "patience", "early_stopping", "patience")
    title = "Early stopping: epochs without improvement against the patience"
    if all(v is None for v in ys):
        return figure("plot-early-stopping", title, "", "no early-stopping counter in the log "
                      "(early stopping off, or a log written before the counter was recorded)")
    hlines = [HLine(patience, f"patience {patience:g}")] if patience is not None else []
    series = Series("epochs without improvement", data.x, ys, PALETTE[3], step=True)
    return line_chart("plot-early-stopping", title, [series], y_label="epochs", hlines=hlines)


def _diagram(data: RunData) -> str:
    title = "Lifecycle path of this run"
    try:
        if data.path_problem is not None:
            raise DiagramError(f"{data.events_path}: {data.path_problem}")
        run = data.path.result()
        if shutil.which("dot") is not None:
            svg = path_diagram(run, data.events_path, Format.SVG)
            svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML
            return f'<figure class="plot diagram" id="diagram-lifecycle"><figcaption>{title}</figcaption>{svg}</figure>'
        return _path_drawing(run, title)
    except DiagramError as exc:
        return figure("diagram-lifecycle", title, "", f"no diagram: {exc}")


def _path_drawing(run: RunPath, title: str) -> str:
    """Without Graphviz: the visited phases top to bottom, and each move taken with its count."""
    visited = [p.value for p in Phase if any(p.value in (s, d) for s, d, _ in run.counts)]
    w, box, gap = 760, 26, 14
    h = len(visited) * (box + gap) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
           f'aria-label="{title}" font-family="system-ui, sans-serif" font-size="12">']
    for i, name in enumerate(visited):
        y = 5 + i * (box + gap)
        stroke = "#B00020" if name == run.last_phase else "#333"
        out.append(f'<rect x="10" y="{y}" width="150" height="{box}" rx="6" fill="#fff" stroke="{stroke}"/>'
                   f'<text x="85" y="{y + 17}" text-anchor="middle">{escape(name)}</text>')
    order = {(t.source.value, t.dest.value, t.trigger): i for i, t in enumerate(TRANSITIONS)}
    for j, (key, n) in enumerate(sorted(run.counts.items(), key=lambda kv: order.get(kv[0], 99))):
        src, dst, trig = key
        extra = f" / {run.reason}" if key == run.final and run.reason else ""
        out.append(f'<text x="190" y="{18 + j * 16}">{escape(f"{src} -> {dst}: {trig} x{n}{extra}")}</text>')
    out.append("</svg>")
    return figure("diagram-lifecycle", title, "".join(out), "Graphviz is not installed: a plain drawing")


def _setup(data: RunData) -> list[tuple[str, str]]:
    """The global batch and the strategy of the run's newest segment, where its log says them."""
    facts = (("global batch", describe_global_batch(data.global_batch)), ("strategy", data.strategy))
    return [(k, v) for k, v in facts if v is not None]


def _stop_panel(report: AuditReport, data: RunData) -> str:
    ex = report.explanation
    rows = [("stop reason", ex.stop_reason or "the run never reached train_end"),
            ("requested by", ex.stop_source or "-"), ("why", ex.stop_message or "-"),
            ("in epoch", "-" if ex.stop_epoch is None else str(ex.stop_epoch + 1)),
            ("epochs completed", f"{ex.epochs_completed}" + (f" of {ex.max_epochs}" if ex.max_epochs else "")),
            ("best val loss", "-" if ex.best_val_loss is None else
             f"{ex.best_val_loss:.6g} (epoch {(ex.best_epoch or 0) + 1})")]
    if data.result is not None and (objective := as_float(data.result.get("objective"))) is not None:
        rows.append(("objective", f"{objective:.6g}"))
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows + _setup(data))
    return f'<section class="panel" id="stop"><h2>Why the run stopped</h2><table class="kv">{body}</table></section>'


def _checkpoint_rows(data: RunData, checkpoints: list[dict[str, Any]]) -> str:
    run_dir = data.events_path.parent
    rows = []
    for ck in checkpoints:
        path = str(ck.get("path", "?"))
        state = "removed by the run" if ck.get("removed") else (
            "present" if (run_dir / path).exists() else "not present")
        epoch = ck.get("epoch")
        rows.append(f"<tr><td>{'-' if not isinstance(epoch, int) else epoch + 1}</td>"
                    f"<td>{escape(str(ck.get('kind', '')))}</td><td><code>{escape(path)}</code></td>"
                    f"<td><code class=\"sha\">{escape(str(ck.get('sha256', '')))}</code></td><td>{state}</td></tr>")
    return ("<table><tr><th>epoch</th><th>kind</th><th>path</th><th>sha256</th><th>file</th></tr>"
            + "".join(rows) + "</table>")


def _file_id(path: Path) -> tuple[int, int] | str:
    """Which file ``path`` is: hard links of one file share it; a missing name is one of its own."""
    try:
        st = path.stat()
    except OSError:
        return str(path)
    return st.st_dev, st.st_ino


def _checkpoint_panel(data: RunData) -> str:
    """The files the run keeps (each path's last write, unless removed), then every write: one write
    under several names (hard links) is one write, named by one sha256."""
    last = {str(ck.get("path")): ck for ck in data.checkpoints}
    kept = [ck for ck in last.values() if not ck.get("removed")]
    files = len({_file_id(data.events_path.parent / str(ck.get("path"))) for ck in kept})
    writes = len({(ck.get("sha256"), ck.get("epoch")) for ck in data.checkpoints})
    body = ('<p class="note">no checkpoint was written</p>' if not data.checkpoints else
            f"{_checkpoint_rows(data, kept)}<details><summary>all {writes} checkpoint writes of the log "
            f"({len(data.checkpoints)} names committed)</summary>{_checkpoint_rows(data, data.checkpoints)}</details>")
    return (f'<section class="panel" id="checkpoints"><h2>Checkpoints: {files} file(s) kept under {len(kept)} '
            f"name(s), sha256 as the log recorded them</h2>{body}</section>")


def _time_plots(data: RunData) -> list[str]:
    # shares of the epochs' time, as the audit gives them (a callback's hooks run inside its epoch)
    total = data.table.totals("time").get("epoch", 0.0)
    return [bar_chart(f"plot-{kind}-time", f"Time per {kind} (share of epoch time)",
                      list(data.table.totals(kind).items()), color=PALETTE[i], total=total)
            for i, kind in enumerate(("phase", "callback"))]


def _audit_panel(report: AuditReport) -> str:
    ok = report.ok
    verdict = "OK" if ok else f"FAILED: {len(report.violations)} violation(s)"
    if report.warnings:
        verdict += f", {len(report.warnings)} warning(s)"
    return (f'<section class="panel" id="audit"><h2>Audit: <span class="{"ok" if ok else "bad"}">'
            f"{escape(verdict)}</span></h2><pre>{escape(report.render())}</pre></section>")


def run_sections(events_path: Path) -> tuple[str, str, list[str]]:
    """The page title, a one-line summary and the sections (HTML) of a run report."""
    with collector_paused():  # (until what was read is let go: a long log's is millions of objects, and no cycles)
        return _sections(events_path)


def _sections(events_path: Path) -> tuple[str, str, list[str]]:
    data, report = read_run(events_path)
    overfit, bands = _overfit(data)
    sections = [_loss_plot(data, bands), *_metric_plots(data), _lr_plot(data), _grad_plot(data), overfit,
                _early_stopping_plot(data), _diagram(data), _stop_panel(report, data),
                _checkpoint_panel(data), *_time_plots(data), _audit_panel(report)]
    ex = report.explanation
    summary = (f"{ex.stop_reason or 'unfinished'} after {ex.epochs_completed} epoch(s); audit "
               f"{'OK' if report.ok else 'FAILED'}; {data.lines} log lines")
    summary += "".join(f"; {k} {v}" for k, v in _setup(data))
    return f"fsmtrain run {data.run_id}", summary, sections
