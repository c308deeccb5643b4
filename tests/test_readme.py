"""The README stays true: its embedded lifecycle diagram and its commands match the project."""

from __future__ import annotations

from pathlib import Path

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
