"""The study half of ``fsmtrain report``: an Optuna study's page from its storage alone (history,
importances, parallel coordinates, intermediate values, and the trials linking their run reports)."""

from __future__ import annotations

import itertools
import json
import math
import os
import sqlite3
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from html import escape
from pathlib import Path
from typing import Any

from fsmtrain.core.context import validation_label
from fsmtrain.tools.report.run_log import ReportError, as_float
from fsmtrain.tools.report.svgplot import (
    GREY,
    PALETTE,
    Axis,
    Series,
    TrialLine,
    bar_chart,
    colormap,
    figure,
    line_chart,
    parallel_chart,
)

__all__ = ["IMPORTANCE_METHOD", "STUDY_PLOTS", "open_study", "param_importances", "run_dirs_of", "storage_arg",
           "storage_url", "study_sections"]

STUDY_PLOTS = ("plot-history", "plot-importances", "plot-parallel", "plot-intermediate", "trials")


def storage_arg(text: str) -> str:
    """A study folder (``runs/<project>/<study>``) stands for the storage file in it."""
    path = Path(text)
    if "://" not in text and path.is_dir():
        for name in ("study.db", "study.journal"):
            if (path / name).is_file():
                return str(path / name)
    return text


def storage_url(target: str) -> tuple[Any, Path | None]:
    """``target`` as an Optuna storage (a URL, a SQLite file or a journal file) and its file, if any.
    A missing file is an error: Optuna would create an empty database there."""
    if "://" in target:
        return target, None
    path = Path(target)
    if not path.is_file():
        raise ReportError(f"{target}: no such run directory, events.jsonl or study storage file")
    with open(path, "rb") as fh:
        first = fh.readline(1 << 16)
    if first.startswith(b"SQLite format 3"):
        _require_optuna_tables(path, target)
        return f"sqlite:///{path.resolve()}", path
    try:
        op = json.loads(first).get("op_code") if first.strip() else None
    except (ValueError, AttributeError):
        op = None
    if op is None:
        raise ReportError(f"{target}: neither a run's events.jsonl nor an Optuna storage (a SQLite file or an Optuna "
                          "journal file)")
    import optuna
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path))), path


def _require_optuna_tables(path: Path, target: str) -> None:
    """Optuna would add its tables to any SQLite file it is pointed at: check, read-only, first."""
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error as exc:
        raise ReportError(f"{target}: cannot read this SQLite file: {exc}") from exc
    if "studies" not in tables:
        raise ReportError(f"{target}: a SQLite file without Optuna's tables, not a study storage")


def open_study(target: str, name: str | None) -> tuple[Any, Path | None]:
    """Study ``name`` (or the storage's only study) loaded from ``target``, and the storage's file, if any."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, path = storage_url(target)
    try:
        names = optuna.get_all_study_names(storage=storage)
    except Exception as exc:  # a file that is no Optuna storage, a bad URL, an unreachable server
        raise ReportError(f"{target}: not an Optuna storage Optuna can read ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    listed = ", ".join(sorted(names)) or "none"
    if name is None:
        if len(names) != 1:
            raise ReportError(f"{target}: pass --study NAME; the storage has {len(names)} studies ({listed})")
        name = names[0]
    elif name not in names:
        raise ReportError(f"{target}: no study {name!r}; it has: {listed}")
    return optuna.load_study(study_name=name, storage=storage), path


def run_dirs_of(trial: Any) -> list[str]:
    """A trial's run directories: ``fsmtrain hpo`` stores ``{seed: run dir}``; other code a list or a path."""
    dirs = trial.user_attrs.get("run_dirs") or []
    if isinstance(dirs, Mapping):
        return [str(d) for _, d in sorted(dirs.items(), key=lambda kv: _seed_order(kv[0]))]
    return [str(d) for d in dirs] if isinstance(dirs, (list, tuple)) else [str(dirs)]


def _seed_order(seed: Any) -> tuple[int, str]:
    text = str(seed)
    return (int(text), "") if text.lstrip("-").isdigit() else (0, text)


def _value(trial: Any, finite: bool = True) -> float | None:
    """A single-objective trial's value (``finite``: None unless finite)."""
    v = as_float(trial.value) if trial.values is not None and len(trial.values) == 1 else None
    return v if v is not None and (math.isfinite(v) or not finite) else None


def _positive(values: Sequence[float | None]) -> bool:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return bool(vals) and min(vals) > 0 and max(vals) / min(vals) > 10


def _history(study: Any, complete: list[Any], pruned: list[Any]) -> str:
    minimize = study.direction.name == "MINIMIZE"
    values = [v for v in map(_value, complete) if v is not None]  # each of them has one
    best = list(itertools.accumulate(values, min if minimize else max))
    xs = [t.number for t in complete]
    series = [Series("objective of a complete trial", xs, values, PALETTE[0], line=False),
              Series("best so far", xs, best, PALETTE[1], points=False, step=True)]
    last = [(t.number, as_float(t.intermediate_values[max(t.intermediate_values)])) for t in pruned
            if t.intermediate_values]
    if last:
        series.append(Series("pruned trial (last reported value)", [n for n, _ in last], [v for _, v in last],
                             GREY, line=False))
    return line_chart("plot-history", f"Optimization history ({'minimize' if minimize else 'maximize'})",
                      series, x_label="trial", y_label="objective", log_y=_positive([v for s in series for v in s.y]))


def _importances(study: Any) -> str:
    scores, why_none = param_importances(study)
    title = f"Parameter importances ({IMPORTANCE_METHOD})"
    if scores is None:
        return figure("plot-importances", title, "", why_none or "")
    return bar_chart("plot-importances", title, list(scores.items()), unit="", color=PALETTE[2])


IMPORTANCE_METHOD = "Optuna's default evaluator, as optuna.importance.get_param_importances(study)"


def param_importances(study: Any) -> tuple[dict[str, float] | None, str | None]:
    """The parameter importances Optuna's own tools show (its default evaluator), or None and why.
    The one place both ``hpo-report`` and the study page take them from."""
    import optuna

    finite = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
              if t.value is not None and math.isfinite(t.value)]
    if len(finite) < 2:
        return None, f"needs at least 2 completed trials with a finite value ({len(finite)})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}, None
    except (RuntimeError, ValueError) as exc:
        return None, " ".join(str(exc).split())


def _on_axis(trial: Any, axis: Axis) -> float | None:
    """Where ``trial`` sits on a parameter's axis: its value, or the index of its category."""
    if axis.name not in trial.params:
        return None
    value = trial.params[axis.name]
    return float(axis.categories.index(str(value))) if axis.categories else as_float(value)


def _parallel(study: Any, complete: list[Any]) -> str:
    from optuna.distributions import CategoricalDistribution

    names = sorted({p for t in complete for p in t.params})
    axes = [Axis("objective")]
    for p in names:
        dist = next(t.distributions[p] for t in complete if p in t.distributions)
        if isinstance(dist, CategoricalDistribution):
            axes.append(Axis(p, categories=[str(c) for c in dist.choices]))
        else:
            axes.append(Axis(p, log=bool(getattr(dist, "log", False))))
    values = [_value(t) for t in complete]
    finite = [v for v in values if v is not None]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    minimize = study.direction.name == "MINIMIZE"
    lines = []
    for t, v in zip(complete, values, strict=True):
        share = 0.0 if hi == lo or v is None else (v - lo) / (hi - lo)
        color = colormap(share if minimize else 1 - share)
        tip = f"trial {t.number}: {v:.6g}; " + ", ".join(f"{k}={t.params[k]}" for k in names if k in t.params)
        lines.append(TrialLine([v, *(_on_axis(t, ax) for ax in axes[1:])], color, tip))
    return parallel_chart("plot-parallel", "Parallel coordinates (complete trials; dark = best)", axes, lines)


def _intermediate(complete: list[Any], pruned: list[Any]) -> str:
    series: list[Series] = []
    for trials, color, label in ((complete, PALETTE[0], "complete"), (pruned, PALETTE[1], "pruned")):
        for t in trials:
            steps = sorted(t.intermediate_values)
            if steps:
                series.append(Series(f"trial {t.number} ({label})", steps,
                                     [as_float(t.intermediate_values[s]) for s in steps], color, points=False))
    if not series:
        return figure("plot-intermediate", "Intermediate values", "", "no trial reported intermediate values")
    return line_chart("plot-intermediate", "Intermediate values: pruned (orange) vs complete (blue) trials", series,
                      x_label="validation (from 1)", y_label="reported value",
                      log_y=_positive([v for s in series for v in s.y]),
                      legend=[("complete trial", PALETTE[0], False), ("pruned trial", PALETTE[1], False)])


def _trial_table(study: Any, out_dir: Path, run_link: Callable[[Path], Path | None]) -> str:
    rows = []
    for t in study.get_trials(deepcopy=False):
        at = validation_label(t.user_attrs.get("pruned") or {}, last_step=t.last_step)
        state = t.state.name.lower() + (f" at {at}" if t.state.name == "PRUNED" else "")
        v = _value(t, finite=False)
        links = [f'<span class="missing">{escape(d)} (not found)</span>' if (target := run_link(Path(d))) is None
                 else f'<a href="{escape(os.path.relpath(target, out_dir))}">{escape(Path(d).name)}</a>'
                 for d in run_dirs_of(t)]
        seconds = None if t.duration is None else t.duration.total_seconds()
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
        rows.append(f"<tr><td>{t.number}</td><td>{escape(state)}</td><td>{'-' if v is None else f'{v:.6g}'}</td>"
                    f"<td>{escape(params)}</td><td>{'-' if seconds is None else f'{seconds:.1f} s'}</td>"
                    f"<td>{' '.join(links) or '-'}</td></tr>")
    return ('<section class="panel" id="trials"><h2>Trials</h2><table><tr><th>trial</th><th>state</th><th>value</th>'
            "<th>parameters</th><th>duration</th><th>run reports</th></tr>" + "".join(rows) + "</table></section>")


def study_sections(study: Any, out_dir: Path, run_link: Callable[[Path], Path | None]) -> tuple[str, str, list[str]]:
    """Title, summary and sections of a study report; ``run_link(run_dir)`` gives that run's report or None."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and _value(t) is not None]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    best = f"; best {study.best_value:.6g} (trial {study.best_trial.number})" if complete else ""
    summary = f"{len(trials)} trials: {len(complete)} complete, {len(pruned)} pruned{best}"
    sections = [_history(study, complete, pruned), _importances(study), _parallel(study, complete),
                _intermediate(complete, pruned), _trial_table(study, out_dir, run_link)]
    return f"fsmtrain study {study.study_name}", summary, sections
