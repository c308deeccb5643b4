"""A user's folder named ``callbacks`` does not hide fsmtrain's built-in package of that name.

Found: ``fsmtrain train`` run from a project folder holding a ``callbacks/`` folder (with or without
an ``__init__.py``) ended in an ``ImportError`` traceback ("cannot import name
'EpochSummaryCallback' from 'callbacks'") before training, from the console script and from
``python -m pipeline``; a notebook in such a folder could not build a ``Trainer`` from a config.

The processes run with the project as installed (the README installs it editable), not with the
repository on ``PYTHONPATH``: a path entry holding fsmtrain's regular package would win over a
namespace folder and hide the bug.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "configs" / "quickstart.yaml"
pytestmark = pytest.mark.timeout(180)

MY_CALLBACK = '''
from pipeline import TrainingCallback


class MyCallback(TrainingCallback):
    pass
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WANDB_SERVICE")}
    env["WANDB_MODE"] = "offline"
    return env


def _project(tmp_path: Path, package: bool) -> Path:
    """A user's project folder with its own ``callbacks`` (a package, or a plain folder)."""
    project = tmp_path / "project"
    (project / "callbacks").mkdir(parents=True)
    if package:
        (project / "callbacks" / "__init__.py").write_text("")
    (project / "callbacks" / "mine.py").write_text(MY_CALLBACK)
    return project


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=170, check=False)


def _fsmtrain(entry: str) -> list[str]:
    if entry == "script":
        exe = shutil.which("fsmtrain")
        assert exe is not None, "the fsmtrain console script is not installed"
        return [exe]
    return [sys.executable, "-m", "pipeline"]


@pytest.mark.parametrize(("package", "entry"), [(False, "script"), (True, "script"), (True, "module")])
def test_train_from_a_folder_with_its_own_callbacks(tmp_path: Path, package: bool, entry: str) -> None:
    project = _project(tmp_path, package)
    done = _run([*_fsmtrain(entry), "train", str(QUICK), "--run-dir", "runs", "--set", "epochs=1",
                 "--set", "wandb.enabled=false"], project)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Traceback" not in out, out
    assert "seed 0: COMPLETED after 1 epoch(s)" in done.stdout, out


def test_a_config_naming_the_users_hidden_callbacks_says_why(tmp_path: Path) -> None:
    project = _project(tmp_path, package=True)
    done = _run([*_fsmtrain("script"), "validate", str(QUICK), "--set",
                 'callbacks.extra=[{"target": "callbacks.mine.MyCallback"}]'], project)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out
    assert (f"found callbacks has no attribute 'mine'; {project / 'callbacks'} is not importable while fsmtrain "
            "runs: fsmtrain's built-in callbacks package has the name 'callbacks'; rename yours") in out, out


def test_a_users_module_importing_its_own_callbacks_says_why(tmp_path: Path) -> None:
    project = _project(tmp_path, package=False)
    (project / "mynets.py").write_text("from callbacks.mine import MyCallback\n"
                                       "from pipeline.training.models import MLP as Net\n")
    done = _run([*_fsmtrain("script"), "validate", str(QUICK), "--set", "net=mynets.Net"], project)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out
    assert (f"found importing mynets failed: No module named 'callbacks.mine'; {project / 'callbacks'} is not "
            "importable while fsmtrain runs") in out, out


def test_the_python_api_in_such_a_folder_gets_fsmtrains_callbacks(tmp_path: Path) -> None:
    """The README's Python example, as a notebook started in the project folder runs it (the folder
    first on the import path), with the default callbacks a run directory brings."""
    project = _project(tmp_path, package=True)
    script = (
        "from pipeline import Trainer\n"
        "import torch\n"
        "from torch import nn\n"
        "from pipeline.training.data import synthetic_regression\n"
        "from pipeline.training.models import MLP\n"
        "import callbacks\n"
        "from callbacks import TrainingCallback\n"
        "print(callbacks.__path__[0])\n"
        "train, val = synthetic_regression(batch_size=64, seed=0)\n"
        "model = MLP(in_features=8, out_features=1, hidden=[8])\n"
        "trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), train, val,\n"
        "                  max_epochs=1, run_dir='runs', console_level='error')\n"
        "print(trainer.fit().stop_reason.name)\n")
    done = _run([sys.executable, "-c", script], project)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split()
    assert lines[0] == str(REPO / "callbacks") and lines[-1] == "COMPLETED", done.stdout
    assert (project / "runs" / "checkpoints" / "latest.pt").is_file()


def test_a_foreign_callbacks_imported_first_is_named(tmp_path: Path) -> None:
    project = _project(tmp_path, package=True)
    done = _run([sys.executable, "-c", "import callbacks\nimport pipeline.app\n"], project)
    assert done.returncode == 1
    assert (f"ImportError: the module 'callbacks' imported in this process is {project / 'callbacks' / '__init__.py'}, "
            f"not fsmtrain's built-in callbacks ({REPO / 'callbacks'}): fsmtrain needs that name; rename your "
            "package") in done.stderr, done.stderr
