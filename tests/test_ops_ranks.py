"""A manual step on several ranks: its backward and optimizer steps are its own, out of DDP's reach,
so ``fsmtrain train --nproc 2`` refuses it by name, one line and no traceback, before any step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from resume_harness import REPO, env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_manual_step_on_two_ranks_is_refused_by_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fsmtrain", "train", str(REPO / "configs" / "gan.yaml"),
                           "--nproc", "2", "--run-dir", str(tmp_path / "run")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "the manual step fsmtrain.training.models.gan_step runs its own backward" in done.stderr, done.stderr[-3000:]
    assert "it trains on one process (this run has 2)" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list((tmp_path / "run").glob("**/step_*.pt"))
