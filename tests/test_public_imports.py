"""Every public name still imports from where the README shows it, and every package's public face
(its ``__all__``) resolves, lazily exported names included."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (fsmtrain supports 3.10)
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
IMPORT_LINES = sorted({line.strip() for block in _BLOCKS for line in block.splitlines()
                       if re.match(r"\s*(from \S+ import .+|import \S+)\s*$", line)})
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
PACKAGES: list[str] = SETUPTOOLS["packages"]


def test_the_readme_shows_import_lines() -> None:
    assert len(IMPORT_LINES) >= 8, IMPORT_LINES


@pytest.mark.parametrize("line", IMPORT_LINES)
def test_a_readme_import_line_works(line: str) -> None:
    exec(line, {})  # the README's own line, as a user would type it


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_names_only_what_it_has(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in getattr(module, "__all__", ()) if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names {missing}, which it does not have"


def test_the_package_list_is_every_folder() -> None:
    """``pyproject.toml`` lists the packages by hand (the folders map to other names): a new folder
    that is not listed would be left out of a wheel."""
    folders = {"fsmtrain.callbacks"} | {
        ".".join(("fsmtrain", *init.parent.relative_to(ROOT / "pipeline").parts))
        for init in (ROOT / "pipeline").rglob("__init__.py")}
    assert set(PACKAGES) == folders
    assert SETUPTOOLS["package-dir"] == {"fsmtrain": "pipeline", "fsmtrain.callbacks": "callbacks"}


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_one_import_name_from_any_folder(tmp_path: Path) -> None:
    """``fsmtrain`` and ``fsmtrain.callbacks`` import from a folder that is not the checkout; the folder
    names ``pipeline`` and ``callbacks`` are not installed, so a user's own module of that name is theirs."""
    done = _python("import fsmtrain\n"
                   "from fsmtrain import Trainer, TrainingCallback, StopReason\n"
                   "from fsmtrain.callbacks import EarlyStoppingCallback\n"
                   "assert issubclass(EarlyStoppingCallback, TrainingCallback)\n"
                   "print(fsmtrain.__name__, Trainer.__module__, StopReason.COMPLETED.name)\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fsmtrain", "fsmtrain.app.trainer", "COMPLETED"]
    for name in ("pipeline", "callbacks"):
        gone = _python(f"import {name}", tmp_path)
        assert gone.returncode == 1 and f"No module named '{name}'" in gone.stderr, gone.stderr
    (tmp_path / "callbacks.py").write_text("MINE = 1\n")
    mine = _python("import fsmtrain.callbacks, callbacks\nprint(callbacks.MINE, fsmtrain.callbacks.__name__)", tmp_path)
    assert mine.returncode == 0 and mine.stdout.split() == ["1", "fsmtrain.callbacks"], mine.stderr


@pytest.mark.parametrize(("old", "new"), [
    ("pipeline.training.data.digits", "fsmtrain.training.data.digits"),
    ("callbacks.EarlyStoppingCallback", "fsmtrain.callbacks.EarlyStoppingCallback")])
def test_an_old_name_is_refused_with_the_new_one(old: str, new: str) -> None:
    """From the checkout the old folder would import as a second copy of fsmtrain: refused, never aliased."""
    from fsmtrain.app.config.problems import ConfigError
    from fsmtrain.app.config.resolution import resolve_dotted

    with pytest.raises(ConfigError) as caught:
        resolve_dotted(old)
    assert f"an old name of fsmtrain's own {new!r} (did you mean {new}?)" in str(caught.value)
