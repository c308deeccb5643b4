"""The run half of ``fsmtrain report``: one run's page, made from its ``events.jsonl`` alone.

Reads the log once (no torch) into a table by column (:mod:`fsmtrain.tools.report.table`) and the
run's path (:class:`fsmtrain.core.run_path.PathCounter`), audits it with
:func:`fsmtrain.tools.audit.audit_file`, draws the path with :func:`fsmtrain.core.drawing.path_diagram`,
and lays out the charts of :mod:`fsmtrain.tools.report.svgplot`, long curves reduced
(:mod:`fsmtrain.tools.report.reduce`). Epochs are shown 1-based, as the console counts them.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from fsmtrain.app.global_batch import describe_global_batch
from fsmtrain.core.drawing import DiagramError, Format, path_diagram
from fsmtrain.core.lifecycle import FINAL, TRANSITIONS, Phase
from fsmtrain.core.run_path import PathCounter, RunPath
from fsmtrain.tools.audit import AuditReadError, AuditReport, audit_file
from fsmtrain.tools.audit.auditor import parse_line
from fsmtrain.tools.report.reduce import spans
from fsmtrain.tools.report.svgplot import GREY, PALETTE, Band, HLine, Series, bar_chart, figure, line_chart
from fsmtrain.tools.report.table import EpochTable

__all__ = ["RUN_PLOTS", "ReportError", "RunData", "read_run", "run_sections"]

# The ids of the plots and panels every run report has (the Chromium test checks each one).
RUN_PLOTS = ("plot-loss", "plot-lr", "plot-grad-norm", "plot-overfit", "plot-early-stopping",
             "diagram-lifecycle", "stop", "checkpoints", "plot-phase-time", "plot-callback-time", "audit")
_LOSSES = ("train_loss", "val_loss")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class ReportError(ValueError):
    """Input a report cannot be made from (no log, not a log, no such study); the message says which."""


def as_float(value: Any) -> float | None:
    """A number of the log (non-finite floats are written as the strings NaN/Infinity), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value)
    return None


@dataclass
class RunData:
    events_path: Path
    run_id: str = "?"
    max_epochs: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    table: EpochTable = field(default_factory=EpochTable)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    lines: int = 0
    path: PathCounter = field(default_factory=PathCounter)
    path_problem: str | None = None  # why the path diagram cannot be drawn
    global_batch: dict[str, Any] | None = None  # the newest segment's (per rank x ranks x accumulation)

    def setting(self, source: str, key: str, *config_path: str) -> float | None:
        """A callback's setting from its ``callback_settings`` event, else from the run's config."""
        value = self.settings.get(source, {}).get(key)
        if value is None:
            node: Any = self.config
            for part in config_path:
                node = node.get(part) if isinstance(node, Mapping) else None
            value = node
        return as_float(value)

    def metric(self, name: str) -> list[float | None]:
        return self.table.values("metric", name)

    def slot(self, name: str, key: str | None = None) -> list[float | None]:
        """A numeric slot per epoch; ``key`` picks one value of a mapping slot (``loss_prediction``)."""
        return self.table.values("slot", name if key is None else f"{name}.{key}")


# The log is read once, for the charts and the path diagram. Lines are parsed only when the page
# draws from them: the writer puts ``event`` before ``payload``, so the first ``"event":"`` of a
# line is its own; a transition's move is cut from its bytes (4 in 5 lines of an info-level log).
_SKIPPED = (b"trial_report", b"stop_request")
FINAL_PHASE = FINAL.value.encode()
_MOVE = re.compile(rb'"from":"(\w+)","to":"(\w+)","trigger":"(\w+)","epoch":(-?\d+|null),'
                   rb'"global_step":(-?\d+|null),')


def _int(text: bytes) -> int | None:
    return None if text == b"null" else int(text)


def read_run(events_path: Path) -> RunData:
    """Everything the page draws, from the log. A resumed run's re-run epochs count once (the last)."""
    data = RunData(events_path)
    try:
        fh = open(events_path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ReportError(f"cannot read {events_path}: {exc.strerror or exc}") from exc
    n = 0
    path = data.path
    with fh:
        for raw in fh:
            n += 1
            at = raw.find(b'"event":"')
            if at >= 0:
                if raw.startswith(b'transition"', at + 9):
                    move = _MOVE.search(raw, at)
                    if move is not None and move[2] != FINAL_PHASE:
                        src, dst, trigger, epoch, step = move.groups()
                        path.transition(src.decode(), dst.decode(), trigger.decode(), _int(step), _int(epoch), None)
                        continue
                elif raw.startswith(_SKIPPED, at + 9):
                    continue
            try:
                rec = parse_line(raw)  # a UnicodeDecodeError is a ValueError
            except ValueError as exc:  # the audit section names broken lines; the diagram is not drawn
                data.path_problem = data.path_problem or f"line {n}: not a JSON line ({exc}); run `fsmtrain audit`"
                continue
            if isinstance(rec, dict):
                try:
                    path.record(rec, f"line {n}")
                except DiagramError as exc:
                    data.path_problem = data.path_problem or str(exc)
                _take(data, rec)
    data.lines = n
    if n == 0 or (not len(data.table) and data.run_id == "?"):
        raise ReportError(f"{events_path}: no fsmtrain events in it; is this a run's events.jsonl?")
    data.table.finish()
    return data


def _take(data: RunData, rec: Mapping[str, Any]) -> None:
    event = rec.get("event")
    payload = rec.get("payload")
    payload = payload if isinstance(payload, Mapping) else {}
    if event == "run_start":
        data.run_id = str(rec.get("run_id", data.run_id))
        if isinstance(payload.get("max_epochs"), int):
            data.max_epochs = payload["max_epochs"]
        if isinstance(payload.get("config"), Mapping):
            data.config = dict(payload["config"])
        batch = payload.get("global_batch")
        data.global_batch = dict(batch) if isinstance(batch, Mapping) else None
    elif event == "epoch" and isinstance(rec.get("epoch"), int):
        _take_epoch(data.table, rec["epoch"], payload)
    elif event == "callback_settings" and isinstance(payload.get("settings"), Mapping):
        data.settings[str(payload.get("source"))] = dict(payload["settings"])
    elif event == "checkpoint":
        data.checkpoints.append(dict(payload))
    elif event == "checkpoint_removed":
        for ck in data.checkpoints:
            if ck.get("path") == payload.get("path"):
                ck["removed"] = True
    elif event == "result":
        data.result = dict(payload)


def _put_all(table: EpochTable, kind: str, row: int, values: Mapping[str, Any]) -> None:
    columns = table.kind(kind)
    for name, value in values.items():
        cls = value.__class__
        if cls is not float:
            if cls is int:
                value = float(value)
            elif (value := as_float(value)) is None:
                continue
        column = columns.get(name)
        if column is None:
            column = table.add(columns, str(name))
        column.values[row] = value
        column.present[row] = 1


def _take_epoch(table: EpochTable, epoch: int, payload: Mapping[str, Any]) -> None:
    # the hot path of a long log: one call per epoch, a few dozen values each (JSON gives dicts)
    row = table.row(epoch)
    for kind, key in (("metric", "metrics"), ("phase", "phase_seconds"), ("callback", "callback_seconds")):
        values = payload.get(key)
        if isinstance(values, dict):
            _put_all(table, kind, row, values)
    seconds = table.kind("time").get("epoch") or table.add(table.kind("time"), "epoch")
    seconds.values[row] = as_float(payload.get("seconds")) or 0.0
    seconds.present[row] = 1
    slots = payload.get("slots")
    if isinstance(slots, dict):
        _put_all(table, "slot", row, slots)
        for name, value in slots.items():
            if isinstance(value, dict):
                _put_all(table, "slot", row, {f"{name}.{key}": inner for key, inner in value.items()})


# --- sections -------------------------------------------------------------------------------------
def _x(data: RunData) -> list[int]:
    return [e + 1 for e in data.table.index]


def _positive_span(values: list[float | None]) -> bool:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return bool(vals) and min(vals) > 0


def _loss_plot(data: RunData, bands: list[Band]) -> str:
    x = _x(data)
    losses = {k: data.metric(k) for k in _LOSSES}
    series = [Series(k.replace("_", " "), x, losses[k], PALETTE[i]) for i, k in enumerate(_LOSSES)]
    predicted = data.slot("loss_prediction", "predicted_loss")
    if any(p is not None for p in predicted):
        series.append(Series("predicted_final_loss (the predicted final val loss, made at each epoch)", x, predicted,
                             PALETTE[2],
                             dashed=True))
    last = next((p for p in reversed(predicted) if p is not None), None)
    hlines = [HLine(last, f"last prediction {last:.4g}", PALETTE[2])] if last is not None else []
    log = all(_positive_span(v) for v in losses.values())
    return line_chart("plot-loss", "Train and val loss per epoch", series, y_label="loss", log_y=log,
                      hlines=hlines, bands=bands)


def _metric_plots(data: RunData) -> list[str]:
    names = [k for k in data.table.names("metric") if k not in (*_LOSSES, "lr")]
    out = []
    for i, name in enumerate(names):
        out.append(line_chart(f"plot-metric-{name}", f"{name} per epoch",
                              [Series(name, _x(data), data.metric(name), PALETTE[(i + 3) % len(PALETTE)])],
                              y_label=name))
    return out


def _lr_plot(data: RunData) -> str:
    ys = data.metric("lr")
    vals = [v for v in ys if v is not None and v > 0]
    log = bool(vals) and len(vals) == len(ys) and max(vals) / min(vals) > 10
    return line_chart("plot-lr", "Learning rate per epoch", [Series("lr", _x(data), ys, PALETTE[4])],
                      y_label="learning rate", log_y=log)


def _grad_plot(data: RunData) -> str:
    ys = data.slot("max_grad_norm")
    threshold = data.setting("GradientMonitorCallback", "warn_threshold", "callbacks", "gradient_monitor",
                             "warn_threshold")
    hlines = [HLine(threshold, f"warning threshold {threshold:g}")] if threshold is not None else []
    note = "" if threshold is not None else " (threshold not in the log)"
    return line_chart("plot-grad-norm", "Max gradient norm per epoch against the warning threshold" + note,
                      [Series("max grad norm", _x(data), ys, PALETTE[5])], y_label="L2 norm",
                      log_y=_positive_span(ys), hlines=hlines)


def _shown_epochs(runs: list[tuple[float, float]], limit: int = 30) -> str:
    parts = [f"{a:g}" if a == b else f"{a:g}-{b:g}" for a, b in runs[:limit]]
    more = f" and {len(runs) - limit:,} more stretches" if len(runs) > limit else ""
    return ", ".join(parts) + more


def _overfit(data: RunData) -> tuple[str, list[Band]]:
    """val/train loss of every epoch, with the epochs ``OverfitDetectionCallback`` flagged (slot
    ``overfit_gap_ratio`` set) marked and shaded, one band a stretch of flagged epochs."""
    x = _x(data)
    gap = data.slot("overfit_gap_ratio")
    flagged = [float(ep) for ep, g in zip(x, gap, strict=True) if g is not None]
    stretches = spans(flagged)
    bands = [Band(a, b, f"overfitting flagged in epoch {a:g}" if a == b else
                  f"overfitting flagged in epochs {a:g}-{b:g}", legend="epochs flagged as overfitting")
             for a, b in stretches]
    ratio: list[float | None] = []
    for train, val in zip(data.metric("train_loss"), data.metric("val_loss"), strict=True):
        ratio.append(val / train if train and val is not None and math.isfinite(train) else None)
    series = [Series("val loss / train loss", x, ratio, GREY, points=False),
              Series("flagged as overfitting", x, gap, "#B00020", line=False)]
    exact = spans(flagged, max_spans=len(flagged) or 1)
    note = (f"flagged epochs: {_shown_epochs(exact)}" if flagged else "no epoch was flagged as overfitting")
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
    return line_chart("plot-early-stopping", title, [Series("epochs without improvement", _x(data), ys, PALETTE[3],
                                                            step=True)], y_label="epochs", hlines=hlines)


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


def _stop_panel(report: AuditReport, data: RunData) -> str:
    ex = report.explanation
    rows = [("stop reason", ex.stop_reason or "the run never reached train_end"),
            ("requested by", ex.stop_source or "-"), ("why", ex.stop_message or "-"),
            ("in epoch", "-" if ex.stop_epoch is None else str(ex.stop_epoch + 1)),
            ("epochs completed", f"{ex.epochs_completed}" + (f" of {ex.max_epochs}" if ex.max_epochs else "")),
            ("best val loss", "-" if ex.best_val_loss is None else
             f"{ex.best_val_loss:.6g} (epoch {(ex.best_epoch or 0) + 1})")]
    if data.result is not None and as_float(data.result.get("objective")) is not None:
        rows.append(("objective", f"{as_float(data.result.get('objective')):.6g}"))
    said = describe_global_batch(data.global_batch)
    if said is not None:
        rows.append(("global batch", said))
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
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


def _checkpoint_panel(data: RunData) -> str:
    """The files the run keeps (the last write of each path it did not remove), then every write."""
    last: dict[str, dict[str, Any]] = {}
    for ck in data.checkpoints:
        last[str(ck.get("path"))] = ck
    kept = [ck for ck in last.values() if not ck.get("removed")]
    if not data.checkpoints:
        body = '<p class="note">no checkpoint was written</p>'
    else:
        body = (f"{_checkpoint_rows(data, kept)}<details><summary>all {len(data.checkpoints)} checkpoint writes "
                f"of the log</summary>{_checkpoint_rows(data, data.checkpoints)}</details>")
    return (f'<section class="panel" id="checkpoints"><h2>Checkpoints: {len(kept)} kept, sha256 as the log '
            f"recorded them</h2>{body}</section>")


def _time_plots(data: RunData) -> list[str]:
    phases, callbacks = data.table.totals("phase"), data.table.totals("callback")
    # shares of the epochs' time, as the audit gives them (a callback's hooks run inside its epoch)
    total = data.table.totals("time").get("epoch", 0.0)
    return [bar_chart("plot-phase-time", "Time per phase (share of epoch time)", list(phases.items()),
                      color=PALETTE[0], total=total),
            bar_chart("plot-callback-time", "Time per callback (share of epoch time)", list(callbacks.items()),
                      color=PALETTE[1], total=total)]


def _audit_panel(report: AuditReport) -> str:
    ok = report.ok
    verdict = "OK" if ok else f"FAILED: {len(report.violations)} violation(s)"
    if report.warnings:
        verdict += f", {len(report.warnings)} warning(s)"
    return (f'<section class="panel" id="audit"><h2>Audit: <span class="{"ok" if ok else "bad"}">'
            f"{escape(verdict)}</span></h2><pre>{escape(report.render())}</pre></section>")


def run_sections(events_path: Path) -> tuple[str, str, list[str]]:
    """The page title, a one-line summary and the sections (HTML) of a run report."""
    data = read_run(events_path)
    try:
        report = audit_file(events_path)
    except AuditReadError as exc:
        raise ReportError(str(exc)) from exc
    overfit, bands = _overfit(data)
    sections = [_loss_plot(data, bands), *_metric_plots(data), _lr_plot(data), _grad_plot(data), overfit,
                _early_stopping_plot(data), _diagram(data), _stop_panel(report, data),
                _checkpoint_panel(data), *_time_plots(data), _audit_panel(report)]
    ex = report.explanation
    summary = (f"{ex.stop_reason or 'unfinished'} after {ex.epochs_completed} epoch(s); audit "
               f"{'OK' if report.ok else 'FAILED'}; {data.lines} log lines")
    batch = describe_global_batch(data.global_batch)
    if batch is not None:
        summary += f"; global batch {batch}"
    return f"fsmtrain run {data.run_id}", summary, sections
