"""``fsmtrain replay``: the command line of :mod:`fsmtrain.tools.replay`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsmtrain.core.events import EVENTS_FILE, jsonable
from fsmtrain.tools.replay.recording import ReplayError
from fsmtrain.tools.replay.replayer import replay_run

__all__ = ["register_cli"]


def _events_files(target: Path) -> list[Path]:
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise ReplayError(f"{target} does not exist: expected an {EVENTS_FILE} file or a directory of runs")
    found = [target / EVENTS_FILE] if (target / EVENTS_FILE).is_file() else sorted(target.rglob(EVENTS_FILE))
    if not found:
        raise ReplayError(f"no {EVENTS_FILE} under {target}: expected a run directory or a directory of runs")
    return found


def _parse_sweep(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ReplayError(f"--sweep expects KEY=V1,V2,... (e.g. early_stopping.patience=5,10,20), got {spec!r}")
    return key.strip(), items


def _sweep(files: Sequence[Path], key: str, values: Sequence[str], sets: Sequence[str], as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    status = 0
    for f in files:
        for v in values:
            try:
                res = replay_run(f, overrides=[*sets, f"{key}={v}"])
            except ReplayError as exc:  # one unusable run must not hide the others' rows
                print(f"fsmtrain replay: skipped {f}: {exc}", file=sys.stderr)
                status = 2
                break
            rows.append({"run": str(f.parent), "value": v, "stop_epoch": res.stop_epoch,
                         "stop_reason": res.stop_reason.value if res.stop_reason else None,
                         "unknown_after": res.exhausted_after, "best_val_loss": res.best_val_loss,
                         "recorded_epochs": res.recorded_epochs})
    if as_json:
        print(json.dumps(jsonable({"key": key, "rows": rows}), indent=2))
        return status
    table = [("run", key.rsplit(".", 1)[-1], "stop epoch", "stop reason", "best val loss", "recorded epochs")]
    for r in rows:
        stop = str(r["stop_epoch"]) if r["stop_epoch"] is not None else f">{r['unknown_after']} (unknown)"
        loss = r["best_val_loss"]
        table.append((r["run"], r["value"], stop, r["stop_reason"] or "-",
                      "-" if loss is None or not math.isfinite(loss) else f"{loss:.6g}", str(r["recorded_epochs"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return status


def _cmd(args: argparse.Namespace) -> int:
    try:
        files = _events_files(Path(args.events))
        sets = list(args.set or [])
        bad = next((s for s in sets if not s.partition("=")[1] or not s.partition("=")[0].strip()), None)
        if bad is not None:
            raise ReplayError(f"--set expects KEY=VALUE (e.g. early_stopping.patience=5), got {bad!r}")
        if args.sweep:
            return _sweep(files, *_parse_sweep(args.sweep), sets, args.json)
        status = 0
        reports = []
        for f in files:
            try:
                res = replay_run(f, overrides=sets)
            except ReplayError as exc:
                if len(files) == 1:
                    raise
                print(f"fsmtrain replay: skipped {f}: {exc}", file=sys.stderr)
                status = max(status, 2)
                continue
            reports.append({"events": str(f), **res.to_json()})
            if not sets and not res.matches:
                status = max(status, 1)
            if args.json:
                continue
            if sets:
                print(f"{f}: {res.what_if()}")
                if res.divergence is not None:
                    print(f"  departs from the recording at event #{res.divergence.index}")
            elif res.divergence is None:
                print(f"{f}: replay reproduces the recorded trace ({len(res.trace)} events, "
                      f"{res.epochs_completed} epochs, {res.stop_reason.name if res.stop_reason else 'unknown'})")
            else:
                print(f"{f}: replay DIVERGES from the recording; {res.divergence.describe()}")
        if args.json:
            print(json.dumps(reports if len(files) > 1 else reports[0], indent=2))
        return status
    except ValueError as exc:  # a ReplayError, or a ConfigError naming a bad --set
        print(f"fsmtrain replay: error: {exc}", file=sys.stderr)
        return 2


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain replay EVENTS [--set k=v ...] [--sweep k=v1,v2] [--json]``."""
    p = subparsers.add_parser(
        "replay",
        help="re-drive the lifecycle and callbacks from a recorded run (determinism check or what-if)",
        description=(
            "Without --set: check that the run replays to its recorded trace (exit 1 on divergence). "
            "With --set: say what the run would have done with those settings. "
            "With --sweep KEY=V1,V2,...: a table of stop epoch and best val loss per value."
        ),
    )
    p.add_argument("events", help=f"a run's {EVENTS_FILE}, its run directory, or a directory of runs")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="replay once per value and print a table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd)
