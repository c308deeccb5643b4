"""The README's ``Trainer`` example runs again as written: like ``fsmtrain train``, a second run
takes the next free numbered folder and says so; ``run_dir=`` still names a folder exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _example() -> str:
    section = README[README.index("## Using the Trainer from Python"):]
    start = section.index("```python") + len("```python")
    return section[start:section.index("```", start)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_runs_twice(tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(_example(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)
    runs = []
    for _ in range(2):
        runs.append(subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=140, check=False))
    for done in runs:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "runs" / "demo" / "model.pt").is_file()
    assert (tmp_path / "runs" / "demo-2" / "model.pt").is_file()
    assert "runs/demo holds a run; this one goes to runs/demo-2" in runs[1].stderr, runs[1].stderr


def test_run_dir_names_the_folder_exactly(tmp_path: Path) -> None:
    from core_helpers import make_trainer

    from fsmtrain.app.rundir import RunDirError

    make_trainer(tmp_path / "run", epochs=1).fit()
    with pytest.raises(RunDirError, match="already holds a run"):
        make_trainer(tmp_path / "run", epochs=1)
    again = make_trainer(None, epochs=1, run_name=tmp_path / "run")
    assert again.run_dir == tmp_path / "run-2"
    again.fit()
    assert (tmp_path / "run-2" / "events.jsonl").is_file()
