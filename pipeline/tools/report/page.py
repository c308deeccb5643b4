"""``fsmtrain report`` and its page: one self-contained HTML file for a run or a study. Charts are
inline SVG, with no JavaScript; a Content-Security-Policy forbids every request, so nothing leaks."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from html import escape
from pathlib import Path
from typing import Any

from fsmtrain.tools.report.run import run_sections
from fsmtrain.tools.report.run_log import ReportError
from fsmtrain.tools.report.study import open_study, storage_arg, study_sections

__all__ = ["ReportError", "page", "register_cli", "render_report", "write_run_report"]

_CSS = """
body{font-family:system-ui,sans-serif;margin:0 auto;max-width:1000px;padding:1rem 1.5rem;color:#222}
h1{font-size:1.5rem;margin:.2rem 0}h2{font-size:1.1rem;margin:.2rem 0 .5rem}
.summary{font-size:1.05rem}.meta{color:#666;font-size:.85rem}
nav{font-size:.85rem;margin:.6rem 0 1rem;line-height:1.7}nav a{margin-right:.8rem}
figure.plot,section.panel{margin:0 0 1.6rem;padding:.6rem .8rem;border:1px solid #ddd;border-radius:6px}
figcaption{font-weight:600;margin-bottom:.3rem}
figure svg{max-width:100%;height:auto}.note{color:#666;font-size:.85rem;margin:.3rem 0 0}
table{border-collapse:collapse;font-size:.85rem}td,th{border-bottom:1px solid #eee;padding:.2rem .5rem;
text-align:left;vertical-align:top}table.kv th{width:11rem;color:#555}
code.sha{font-size:.75rem;word-break:break-all}pre{white-space:pre-wrap;font-size:.8rem;background:#f7f7f7;
padding:.5rem}.ok{color:#0a7a3a}.bad,.missing{color:#b00020}
"""
# Nothing may be fetched: no scripts at all, inline styles, images only as data: URLs.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def page(title: str, summary: str, source: str, sections: list[str]) -> str:
    """The whole HTML document around ``sections`` (each a ``<figure>`` or ``<section>`` with an id)."""
    nav = "".join(f'<a href="#{i}">{escape(i.removeprefix("plot-").removeprefix("diagram-"))}</a>'
                  for i in (_section_id(s) for s in sections) if i)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'  # no favicon request
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>\n<body>"
        f'<header><h1>{escape(title)}</h1><p class="summary">{escape(summary)}</p>'
        f'<p class="meta">made by <code>fsmtrain report</code> from <code>{escape(source)}</code></p></header>'
        f"<nav>{nav}</nav>\n<main>\n" + "\n".join(sections) + "\n</main></body></html>\n"
    )


def _section_id(html: str) -> str | None:
    start = html.find(' id="')
    return html[start + 5:html.index('"', start + 5)] if start >= 0 else None


def check_output(path: Path) -> None:
    """``path`` can be a page: not a folder, and no file where a folder of it should be (else ReportError)."""
    if path.is_dir():
        raise ReportError(f"{path}: expected a file to write the HTML page to; found a folder")
    for folder in path.parents:
        if folder.exists() and not folder.is_dir():
            raise ReportError(f"{path}: expected a file in a folder; found {folder}, a file")


def _atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temp file beside it, then a rename)."""
    check_output(path)  # else the error would name the temp file, not the path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _events_of(target: str) -> Path | None:
    """The run log ``target`` names (a run directory or the log itself), or None for a study."""
    path = Path(target)
    if path.is_dir():
        if (path / "events.jsonl").is_file():
            return path / "events.jsonl"
        if storage_arg(target) != target:
            return None  # a study folder: its storage file
        raise ReportError(f"{target}: a folder without events.jsonl; pass a run directory, its events.jsonl, "
                          "or a study storage (a SQLite file, an Optuna journal file or a URL)")
    if path.is_file():
        with open(path, "rb") as fh:
            first = fh.readline(1 << 16)
        with contextlib.suppress(ValueError):
            rec = json.loads(first)
            return path if isinstance(rec, dict) and "event" in rec else None
    return None


def write_run_report(events: Path, out: Path | None = None) -> Path:
    """Render the run report of ``events`` to ``out`` (default: ``report.html`` beside the log)."""
    target = out if out is not None else events.parent / "report.html"
    title, summary, sections = run_sections(events)
    _atomic_write(target, page(title, summary, str(events), sections))
    return target


def render_report(target: str, *, study: str | None = None, out: Path | None = None,
                  run_reports: bool = True) -> tuple[Path, list[Path]]:
    """Write the report of ``target``; returns its path and the run reports made for a study."""
    events = _events_of(target) if study is None else None
    if events is not None:
        return write_run_report(events, out), []
    target = storage_arg(target)
    opened, storage_file = open_study(target, study)
    dest = out or (storage_file.parent if storage_file else Path.cwd()) / f"{opened.study_name}-report.html"
    made: list[Path] = []

    def run_link(run_dir: Path) -> Path | None:
        for base in (Path.cwd(), *([storage_file.parent] if storage_file is not None else [])):
            candidate = base / run_dir  # an absolute run_dir stays itself
            log = candidate / "events.jsonl"
            if not log.is_file():
                continue
            report = candidate / "report.html"
            stale = not report.exists() or report.stat().st_mtime < log.stat().st_mtime
            if run_reports and stale:
                made.append(write_run_report(log, report))
            return report if report.exists() else None
        return None

    title, summary, sections = study_sections(opened, dest.resolve().parent, run_link)
    _atomic_write(dest, page(title, summary, target, sections))
    return dest, made


def _cmd_report(args: argparse.Namespace) -> int:
    try:
        if args.output is not None:
            check_output(Path(args.output))  # before the work, not after it
        out, made = render_report(args.target, study=args.study, out=None if args.output is None else Path(args.output),
                                  run_reports=not args.no_runs)
    except ReportError as exc:
        print(f"fsmtrain report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fsmtrain report: {exc.filename or args.target}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for path in made:
        print(f"wrote {path}")
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} kB)")
    return 0


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain report`` to the ``fsmtrain`` parser."""
    parser = subparsers.add_parser(
        "report", help="a self-contained HTML page with the plots of a run or a study",
        description="Write one self-contained HTML page (inline SVG charts, no network) for a run, from its "
                    "events.jsonl, or for an Optuna study, from its storage.",
    )
    parser.add_argument("target", metavar="RUN_DIR|EVENTS_JSONL|STUDY",
                        help="a run directory or its events.jsonl; or an Optuna storage (SQLite file, journal "
                             "file or URL)")
    parser.add_argument("--study", metavar="NAME", default=None,
                        help="the study in the storage (needed when it holds more than one)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="where to write the page (default: RUN_DIR/report.html, or NAME-report.html next "
                             "to the study file)")
    parser.add_argument("--no-runs", action="store_true",
                        help="study: link only the run reports that exist; do not make missing ones")
    parser.set_defaults(func=_cmd_report)
