"""``fsmtrain report``: the command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fsmtrain.tools.report.page import check_output, render_report
from fsmtrain.tools.report.run_log import ReportError

__all__ = ["register_cli"]


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
