"""A path given to the command line that is not what it should be is named for what it is: a
missing path, a directory given as a config file, a file given as a run directory (exit 2, one line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _fsmtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "fsmtrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=100, check=False)


def _refused(done: subprocess.CompletedProcess[str], words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


def test_resume_of_a_missing_path_says_it_does_not_exist(tmp_path: Path) -> None:
    _refused(_fsmtrain("resume", "runs/nope", cwd=tmp_path), "runs/nope does not exist")


def test_resume_of_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("epochs: 1\n")
    _refused(_fsmtrain("resume", "x.yaml", cwd=tmp_path), "x.yaml is a file: expected a run directory")


@pytest.mark.parametrize("command", ["train", "validate"])
def test_a_directory_given_as_config_is_named_a_directory(tmp_path: Path, command: str) -> None:
    (tmp_path / "configs").mkdir()
    _refused(_fsmtrain(command, "configs", cwd=tmp_path), "expected a YAML file; found a directory")


def test_a_missing_config_says_the_path_does_not_exist(tmp_path: Path) -> None:
    _refused(_fsmtrain("validate", "nope.yaml", cwd=tmp_path),
             "expected a YAML file; found a path that does not exist")
