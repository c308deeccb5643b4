"""Every public name still imports from where the README shows it, and every package's public face
(its ``__all__``) resolves, lazily exported names included."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
IMPORT_LINES = sorted({line.strip() for block in _BLOCKS for line in block.splitlines()
                       if re.match(r"\s*(from \S+ import .+|import \S+)\s*$", line)})
PACKAGES = ["pipeline", "pipeline.core", "pipeline.training", "pipeline.app", "pipeline.app.config", "pipeline.app.hpo",
            "pipeline.tools", "pipeline.tools.audit", "pipeline.tools.replay", "pipeline.tools.report",
            "pipeline.tools.diagrams", "callbacks"]


def test_the_readme_shows_import_lines() -> None:
    assert len(IMPORT_LINES) >= 8, IMPORT_LINES


@pytest.mark.parametrize("line", IMPORT_LINES)
def test_a_readme_import_line_works(line: str) -> None:
    exec(line, {})


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_names_only_what_it_has(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in getattr(module, "__all__", ()) if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names {missing}, which it does not have"
