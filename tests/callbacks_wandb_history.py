"""Read the history rows of an offline W&B run with W&B's own reader of its ``.wandb`` file:
``wandb leet inspect --json`` (one JSON record a line; ``history`` records hold the logged row)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _records(run_root: Path) -> list[dict[str, Any]]:
    (run_dir,) = list(run_root.glob("wandb/offline-run-*"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wandb_history(run_root: Path) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``run_root/wandb``, as W&B itself reads them."""
    return [r["history"]["item"] for r in _records(run_root) if r.get("type") == "history"]


def wandb_summary(run_root: Path) -> dict[str, Any]:
    """The run's summary as W&B itself reads it: its summary updates, in order."""
    summary: dict[str, Any] = {}
    for r in _records(run_root):
        if r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    return summary
