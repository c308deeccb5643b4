"""The README stays true: its embedded lifecycle diagram and its commands match the project."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsmtrain.training.models import MLP

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_embeds_the_committed_lifecycle_diagram() -> None:
    mmd = (ROOT / "diagrams" / "lifecycle.mmd").read_text(encoding="utf-8").rstrip("\n")
    assert "```mermaid\n" + mmd + "\n```" in README, "README's Mermaid diagram is stale: paste diagrams/lifecycle.mmd"


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def _bash_block_after(text: str, lead: str) -> list[str]:
    """The lines of the first ```bash block after the sentence that starts with ``lead``."""
    at = text.index("\n" + lead)
    start = text.index("```bash\n", at) + len("```bash\n")
    return text[start:text.index("```", start)].strip("\n").splitlines()


SETUP_BLOCK = _bash_block_after(_section("Set up and run"), "The set-up command")
TEST_BLOCK = _bash_block_after(_section("Set up and run"), "The test command")

# What .ci/run may hold besides the README's commands: set options, the cd to the repo root, and
# exports of plain values (no command substitution: that would run something).
_CI_SETTINGS = re.compile(r'set( [-+][a-zA-Z]+( [a-z]+)?)+'
                          r'|cd "\$\(dirname "\$0"\)/\.\."'
                          r'|export [A-Za-z_]\w*=[\w./:,+-]*')


def ci_commands(script: str) -> list[str]:
    """The commands ``script`` runs: every line but the shebang, comments, blanks and ``_CI_SETTINGS``."""
    lines = script.splitlines()
    assert lines and lines[0].startswith("#!"), "the script starts with a shebang"
    return [line.strip() for line in lines[1:]
            if line.strip() and not line.strip().startswith("#") and not _CI_SETTINGS.fullmatch(line.strip())]


def test_readme_names_one_setup_command_one_test_command_and_the_main_job() -> None:
    assert SETUP_BLOCK == ["./setup.sh"]
    assert TEST_BLOCK == ["python -m pytest -q -n auto --maxprocesses 4 --dist loadfile"]
    assert "\nfsmtrain train configs/quickstart.yaml\n" in _section("Set up and run")


def test_ci_runs_exactly_the_readme_setup_and_test_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ci_commands(ci) == SETUP_BLOCK + TEST_BLOCK, ".ci/run must run the README's set-up and test commands " \
        "verbatim and nothing else (environment exports, set options and the cd aside)"
    assert "\nexport FSMTRAIN_REQUIRE_SYSTEM=1\n" in ci  # a skip for a missing system part fails CI


@pytest.mark.parametrize("extra", [
    "apt-get install -y graphviz",
    "(cd tests/mermaid && npm ci)",
    "export FSMTRAIN_MERMAID_CHECK=$(npm ci)",
    "./setup.sh && pip install torch",
    "cd tests && npm ci",
])
def test_the_ci_check_catches_a_command_beside_the_readme(extra: str) -> None:
    script = "#!/usr/bin/env bash\nset -euo pipefail\nexport WANDB_MODE=offline\n" + extra + "\n" + \
        "\n".join(SETUP_BLOCK + TEST_BLOCK) + "\n"
    assert ci_commands(script) != SETUP_BLOCK + TEST_BLOCK


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
