"""The code base stays clean: ruff on everything, mypy --strict on the package fsmtrain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "pipeline", "callbacks", "tests", "benchmarks"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_overhead_benchmark_runs_and_reports_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--rounds", "1", "--epochs", "1", "--batches", "8",
         "--case", "no_callbacks", "--case", "every_hook_noop", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    results = {r["case"]: r for r in json.loads(proc.stdout)}
    assert set(results) == {"no_callbacks", "every_hook_noop"}
    assert all(r["ratio_median"] > 0 and r["steps_per_s"] > 0 for r in results.values())
