"""The run half of ``fsmtrain report``: one run's page, made from its ``events.jsonl`` alone.

Reads the log (no torch), audits it with :func:`pipeline.tools.audit.audit_file`, draws the run's
path with :func:`pipeline.core.drawing.run_diagram`, and lays out the charts of
:mod:`pipeline.tools.report.svgplot`. Epochs are shown 1-based, as the console counts them.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from pipeline.core.drawing import DiagramError, Format, read_run_path, run_diagram
from pipeline.core.lifecycle import TRANSITIONS, Phase
from pipeline.tools.audit import AuditReadError, AuditReport, audit_file
from pipeline.tools.report.svgplot import GREY, PALETTE, Band, HLine, Series, bar_chart, figure, line_chart

__all__ = ["RUN_PLOTS", "EpochRow", "ReportError", "RunData", "read_run", "run_sections"]

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
class EpochRow:
    index: int  # 0-based, as the log has it
    metrics: dict[str, float]
    slots: dict[str, Any]
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    callback_seconds: dict[str, float] = field(default_factory=dict)

    def slot(self, name: str, key: str | None = None) -> float | None:
        value = self.slots.get(name)
        if key is not None:
            value = value.get(key) if isinstance(value, Mapping) else None
        return as_float(value)


@dataclass
class RunData:
    events_path: Path
    run_id: str = "?"
    max_epochs: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    epochs: list[EpochRow] = field(default_factory=list)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    lines: int = 0
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


def read_run(events_path: Path) -> RunData:
    """Everything the page draws, from the log. A resumed run's re-run epochs count once (the last)."""
    data = RunData(events_path)
    by_epoch: dict[int, EpochRow] = {}
    try:
        fh = open(events_path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ReportError(f"cannot read {events_path}: {exc.strerror or exc}") from exc
    with fh:
        for n, raw in enumerate(fh, 1):
            data.lines = n
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # the audit section names broken lines
            if not isinstance(rec, dict):
                continue
            _take(data, by_epoch, rec)
    if data.lines == 0 or (not by_epoch and data.run_id == "?"):
        raise ReportError(f"{events_path}: no fsmtrain events in it; is this a run's events.jsonl?")
    data.epochs = [by_epoch[k] for k in sorted(by_epoch)]
    return data


def _take(data: RunData, by_epoch: dict[int, EpochRow], rec: Mapping[str, Any]) -> None:
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
        metrics = {str(k): v for k, v in ((k, as_float(v)) for k, v in (payload.get("metrics") or {}).items())
                   if v is not None}
        slots = payload.get("slots")
        by_epoch[rec["epoch"]] = EpochRow(
            rec["epoch"], metrics, dict(slots) if isinstance(slots, Mapping) else {},
            as_float(payload.get("seconds")) or 0.0, _numbers(payload.get("phase_seconds")),
            _numbers(payload.get("callback_seconds")))
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


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): f for k, f in ((k, as_float(v)) for k, v in value.items()) if f is not None}


# --- sections -------------------------------------------------------------------------------------
def _x(data: RunData) -> list[int]:
    return [e.index + 1 for e in data.epochs]


def _positive_span(values: list[float | None]) -> bool:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return bool(vals) and min(vals) > 0


def _loss_plot(data: RunData, bands: list[Band]) -> str:
    x = _x(data)
    series = [Series(k.replace("_", " "), x, [e.metrics.get(k) for e in data.epochs], PALETTE[i])
              for i, k in enumerate(_LOSSES)]
    predicted = [e.slot("loss_prediction", "predicted_loss") for e in data.epochs]
    if any(p is not None for p in predicted):
        series.append(Series("predicted final val loss (made at each epoch)", x, predicted, PALETTE[2],
                             dashed=True))
    last = next((p for p in reversed(predicted) if p is not None), None)
    hlines = [HLine(last, f"last prediction {last:.4g}", PALETTE[2])] if last is not None else []
    log = all(_positive_span([e.metrics.get(k) for e in data.epochs]) for k in _LOSSES)
    return line_chart("plot-loss", "Train and val loss per epoch", series, y_label="loss", log_y=log,
                      hlines=hlines, bands=bands)


def _metric_plots(data: RunData) -> list[str]:
    names: list[str] = []
    for e in data.epochs:
        names += [k for k in e.metrics if k not in (*_LOSSES, "lr") and k not in names]
    out = []
    for i, name in enumerate(names):
        ys = [e.metrics.get(name) for e in data.epochs]
        out.append(line_chart(f"plot-metric-{name}", f"{name} per epoch",
                              [Series(name, _x(data), ys, PALETTE[(i + 3) % len(PALETTE)])], y_label=name))
    return out


def _lr_plot(data: RunData) -> str:
    ys = [e.metrics.get("lr") for e in data.epochs]
    vals = [v for v in ys if v is not None and v > 0]
    log = bool(vals) and len(vals) == len(ys) and max(vals) / min(vals) > 10
    return line_chart("plot-lr", "Learning rate per epoch", [Series("lr", _x(data), ys, PALETTE[4])],
                      y_label="learning rate", log_y=log)


def _grad_plot(data: RunData) -> str:
    ys = [e.slot("max_grad_norm") for e in data.epochs]
    threshold = data.setting("GradientMonitorCallback", "warn_threshold", "callbacks", "gradient_monitor",
                             "warn_threshold")
    hlines = [HLine(threshold, f"warning threshold {threshold:g}")] if threshold is not None else []
    note = "" if threshold is not None else " (threshold not in the log)"
    return line_chart("plot-grad-norm", "Max gradient norm per epoch against the warning threshold" + note,
                      [Series("max grad norm", _x(data), ys, PALETTE[5])], y_label="L2 norm",
                      log_y=_positive_span(ys), hlines=hlines)


def _overfit(data: RunData) -> tuple[str, list[Band]]:
    """val/train loss of every epoch, with the epochs ``OverfitDetectionCallback`` flagged (slot
    ``overfit_gap_ratio`` set) marked and shaded."""
    flagged = [e.index + 1 for e in data.epochs if e.slots.get("overfit_gap_ratio") is not None]
    bands = [Band(ep, ep, f"overfitting flagged in epoch {ep}", legend="epochs flagged as overfitting")
             for ep in flagged]
    ratio: list[float | None] = []
    for e in data.epochs:
        train, val = e.metrics.get("train_loss"), e.metrics.get("val_loss")
        ratio.append(val / train if train and val is not None and math.isfinite(train) else None)
    series = [Series("val loss / train loss", _x(data), ratio, GREY, points=False),
              Series("flagged as overfitting", _x(data), [e.slot("overfit_gap_ratio") for e in data.epochs],
                     "#B00020", line=False)]
    note = (f"flagged epochs: {', '.join(map(str, flagged))}" if flagged else "no epoch was flagged as overfitting")
    svg = line_chart("plot-overfit", "Overfitting: val/train loss ratio and the epochs flagged", series,
                     y_label="val / train", bands=bands)
    return svg.replace("</figure>", f'<p class="note">{note}</p></figure>'), bands


def _early_stopping_plot(data: RunData) -> str:
    ys = [e.slot("early_stopping_wait") for e in data.epochs]
    patience = data.setting("EarlyStoppingCallback", "patience", "early_stopping", "patience")
    title = "Early stopping: epochs without improvement against the patience"
    if all(v is None for v in ys):
        return figure("plot-early-stopping", title, "", "no early-stopping counter in the log "
                      "(early stopping off, or a log written before the counter was recorded)")
    hlines = [HLine(patience, f"patience {patience:g}")] if patience is not None else []
    return line_chart("plot-early-stopping", title, [Series("epochs without improvement", _x(data), ys, PALETTE[3],
                                                            step=True)], y_label="epochs", hlines=hlines)


def _diagram(events_path: Path) -> str:
    title = "Lifecycle path of this run"
    try:
        if shutil.which("dot") is not None:
            svg = run_diagram(events_path, Format.SVG)
            svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML
            return f'<figure class="plot diagram" id="diagram-lifecycle"><figcaption>{title}</figcaption>{svg}</figure>'
        return _path_drawing(events_path, title)
    except DiagramError as exc:
        return figure("diagram-lifecycle", title, "", f"no diagram: {exc}")


def _path_drawing(events_path: Path, title: str) -> str:
    """Without Graphviz: the visited phases top to bottom, and each move taken with its count."""
    run = read_run_path(events_path)
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


def describe_global_batch(batch: Mapping[str, Any] | None) -> str | None:
    """``128 (64 per rank x 2 ranks x 1 accumulation step)``, from ``run_start``'s ``global_batch``."""
    if batch is None or not all(type(batch.get(k)) is int for k in ("global", "per_rank", "ranks", "accumulation")):
        return None
    steps = batch["accumulation"]
    return (f"{batch['global']} ({batch['per_rank']} per rank x {batch['ranks']} rank(s) x {steps} accumulation "
            f"step{'' if steps == 1 else 's'})")


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
    phases: dict[str, float] = {}
    callbacks: dict[str, float] = {}
    for e in data.epochs:
        for k, v in e.phase_seconds.items():
            phases[k] = phases.get(k, 0.0) + v
        for k, v in e.callback_seconds.items():
            callbacks[k] = callbacks.get(k, 0.0) + v
    return [bar_chart("plot-phase-time", "Time per phase (all epochs)", list(phases.items()), color=PALETTE[0]),
            bar_chart("plot-callback-time", "Time per callback (all epochs)", list(callbacks.items()),
                      color=PALETTE[1])]


def _audit_panel(report: AuditReport) -> str:
    ok = report.ok()
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
                _early_stopping_plot(data), _diagram(events_path), _stop_panel(report, data),
                _checkpoint_panel(data), *_time_plots(data), _audit_panel(report)]
    ex = report.explanation
    summary = (f"{ex.stop_reason or 'unfinished'} after {ex.epochs_completed} epoch(s); audit "
               f"{'OK' if report.ok() else 'FAILED'}; {data.lines} log lines")
    batch = describe_global_batch(data.global_batch)
    if batch is not None:
        summary += f"; global batch {batch}"
    return f"fsmtrain run {data.run_id}", summary, sections
