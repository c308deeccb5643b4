"""The house shows its layers: the import-linter contract holds, and the core is torch-free."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A meta-path finder that refuses heavy imports: importing the core with it installed proves the core
# never needs them (a check of sys.modules alone would miss an import done and then unloaded).
_BLOCK = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {'torch', 'numpy', 'wandb', 'optuna', 'scipy'}:
                raise ImportError(f'blocked: {name}')
            return None
    sys.meta_path.insert(0, Block())
""")


@pytest.mark.slow
def test_import_linter_contracts_hold() -> None:
    # The interpreter under test, not whichever `lint-imports` is first on PATH (another install's).
    lint = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    proc = subprocess.run([sys.executable, "-c", lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("statement", [
    "import fsmtrain.core",
    "from fsmtrain import StopReason, TrainingCallback, Phase, HOOKS, read_events",
    "import fsmtrain.core.drawing",
])
def test_core_imports_without_torch(statement: str) -> None:
    code = _BLOCK + statement + "\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_lazy_top_level_api_resolves_every_name() -> None:
    import fsmtrain

    for name in fsmtrain.__all__:
        assert getattr(fsmtrain, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = fsmtrain.nope
