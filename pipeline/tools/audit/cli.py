"""``fsmtrain audit RUN_DIR [RUN_DIR...]|EVENTS``: the command (a run directory audits every rank's
log; the run directories of every node of a run on node-local disks audit as one run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fsmtrain.core.chain import LogKeyError, key_from_env, read_key_file
from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.audit.ranks import RankedAudit, audit_run_dir
from fsmtrain.tools.audit.verdict import EXIT_UNREADABLE, AuditReadError, AuditReport

__all__ = ["register_cli"]


def _cmd_audit(args: argparse.Namespace) -> int:
    paths = [args.events, *args.more]
    try:
        key = read_key_file(args.key_file) if args.key_file is not None else key_from_env()
        opts: dict[str, Any] = {"verify_checkpoints": not args.no_checkpoints, "key": key,
                                "allow_missing": args.allow_missing}
        report: AuditReport | RankedAudit = (
            audit_run_dir(*paths, **opts) if len(paths) > 1 or Path(args.events).is_dir()
            else audit_file(args.events, **opts))
    except (AuditReadError, LogKeyError) as exc:
        if args.json:
            print(json.dumps({"path": " ".join(paths), "ok": False, "error": str(exc)}))
        else:
            print(f"fsmtrain audit: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print(json.dumps(report.to_dict(args.strict), indent=2))
    else:
        sys.stdout.write(report.render(args.strict))
    return report.exit_code(args.strict)


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain audit`` to the ``fsmtrain`` parser."""
    parser = subparsers.add_parser(
        "audit", help="check a run's events.jsonl (hash chain, lifecycle, content) and explain the run",
        description="Check a run log's hash chain, its moves against the lifecycle table and its content "
                    "(result, stop, timestamps, checkpoints), and explain the run. "
                    "Exit 0: holds; 1: violations; 2: the file or the key file cannot be read.")
    parser.add_argument("events", metavar="RUN_DIR|EVENTS_JSONL",
                        help="a run directory (every rank's log of a multi-process run, and that the ranks agreed) "
                             "or one events.jsonl")
    parser.add_argument("more", nargs="*", metavar="RUN_DIR",
                        help="the run directories of the other nodes of a run on node-local disks (audited as one run)")
    parser.add_argument("--json", action="store_true",
                        help="print a machine-readable verdict (chain, key, segments, violations, story)")
    parser.add_argument("--strict", action="store_true",
                        help="warnings (e.g. checkpoint files not present, non-finite losses) fail the audit too")
    parser.add_argument("--no-checkpoints", action="store_true", help="do not hash the checkpoint files")
    parser.add_argument("--allow-missing", action="store_true",
                        help="committed checkpoint files that are gone (moved or deleted on purpose) are a warning, "
                             "not a violation")
    parser.add_argument("--key-file", metavar="FILE", default=None,
                        help="the log key (HMAC-SHA256 chain); default: the FSMTRAIN_LOG_KEY environment variable")
    parser.set_defaults(func=_cmd_audit)
