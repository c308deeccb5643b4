"""The README stays true: its embedded lifecycle diagram and its commands match the project."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.training.models import MLP

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_embeds_the_committed_lifecycle_diagram() -> None:
    mmd = (ROOT / "diagrams" / "lifecycle.mmd").read_text(encoding="utf-8").rstrip("\n")
    assert "```mermaid\n" + mmd + "\n```" in README, "README's Mermaid diagram is stale: paste diagrams/lifecycle.mmd"


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    setup = "pip install torch==2.13.0 && pip install -e '.[dev,examples]'"
    test = "python -m pytest -q"
    main_job = "fsmtrain train configs/quickstart.yaml"
    for command in (setup, test, main_job):
        assert f"\n{command}\n" in README
    for command in (setup, test):
        assert f"\n{command}\n" in ci


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_python_example_runs_as_written(tmp_path: Path) -> None:
    """The example of "Using the Trainer from Python", run as written: epoch lines and model.pt."""
    section = README[README.index("## Using the Trainer from Python"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 3)]
    (tmp_path / "example.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WANDB_SERVICE", None)
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if re.match(r"^\d+/10\s", line)]
    assert len(lines) >= 2, done.stdout + done.stderr  # one aligned line per epoch
    assert len({len(line) for line in lines}) == 1  # aligned columns
    weights = torch.load(tmp_path / "runs" / "demo" / "model.pt")
    assert set(weights) == set(MLP(in_features=8, out_features=1, hidden=[64, 64]).state_dict())
    assert (tmp_path / "runs" / "demo" / "metrics.csv").is_file()
    assert any((tmp_path / "runs" / "demo" / "checkpoints").glob("epoch_*.pt"))
