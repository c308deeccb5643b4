"""A callback mistake in a config's ``callbacks.extra`` is a one-line config error (exit 2) raised
before the run directory is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_misspelt_hook_in_an_extra_callback_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "mycallbacks.py").write_text(
        "from fsmtrain.callbacks import TrainingCallback\n\n"
        "class Misspelt(TrainingCallback):\n"
        "    def on_validation_end(self, epoch):\n"
        "        pass\n", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    proc = subprocess.run(
        [sys.executable, "-m", "fsmtrain", "train", str(ROOT / "configs" / "quickstart.yaml"), "--set", "epochs=1",
         "--set", "callbacks.extra=[{target: mycallbacks.Misspelt}]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (": callbacks: expected callbacks the runner accepts; found Misspelt.on_validation_end is not a hook "
            "and would never be called: did you mean on_val_end?") in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing half-written
