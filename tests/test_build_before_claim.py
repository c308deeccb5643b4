"""``fsmtrain train`` builds a seed's run before it claims the run directory: a data builder that
raises is a config error (exit 2) and leaves no folder behind, however often it is run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

BUILDER = '''
def load_csv(*, batch_size, seed, path):
    with open(path) as fh:
        return fh.read()
'''


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    env.pop("WANDB_SERVICE", None)
    return env


def _config(folder: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg.update(name="csv", epochs=1, data="mydata.load_csv", data_config={"path": "missing.csv"},
               wandb={"enabled": False})
    path = folder / "csv.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _fsmtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsmtrain", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=110, check=False)


@pytest.mark.timeout(240)
def test_a_data_builder_that_raises_leaves_no_run_folder(tmp_path: Path) -> None:
    (tmp_path / "mydata.py").write_text(BUILDER, encoding="utf-8")
    config = _config(tmp_path)
    for _ in range(2):  # a second try finds no csv-seed0 to step over (no csv-seed0-2)
        done = _fsmtrain("train", str(config), "--run-dir", "runs", cwd=tmp_path)
        out = done.stdout + done.stderr
        assert done.returncode == 2, out
        assert "Traceback" not in out, out
        assert "mydata.load_csv raised FileNotFoundError" in out and "data_config.path" in out, out
        left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*")) \
            if (tmp_path / "runs").exists() else []
        assert left == [], left


@pytest.mark.timeout(120)
def test_validate_without_data_says_the_data_was_not_built(tmp_path: Path) -> None:
    (tmp_path / "mydata.py").write_text(BUILDER, encoding="utf-8")
    done = _fsmtrain("validate", str(_config(tmp_path)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if ": valid (" in x]
    assert "the data was not built" in line, line
    assert "--data" in line, line
