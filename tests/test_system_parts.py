"""A missing system part skips its tests naming the part and ./setup.sh, and fails them under
FSMTRAIN_REQUIRE_SYSTEM=1 (tests/system_parts.py); setup.sh's closing line says what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from system_parts import PARTS, REQUIRE_ENV, SETUP

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# A generated test file: one part that no machine has, one that every machine has (this Python).
PROBE = '''
import sys
from system_parts import Part, require

NOWHERE = Part("nowhere", "Frobnicator (frob)", "the frob test", apt=(), brew=(), brew_cask=(),
               locate=lambda: __import__("shutil").which("fsmtrain-no-such-frobnicator"))
HERE = Part("here", "Python", "the python test", apt=(), brew=(), brew_cask=(), locate=lambda: sys.executable)


def test_needs_frob():
    require(NOWHERE)


def test_needs_python():
    assert require(HERE) == sys.executable
'''

# The same missing part decided at import, as a module that needs it for every test would.
PROBE_MODULE = '''
from system_parts import Part, require

require(Part("nowhere", "Frobnicator (frob)", "the frob tests", apt=(), brew=(), brew_cask=(), locate=lambda: None))


def test_anything():
    pass
'''


def _pytest(tmp_path: Path, source: str, require: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_probe.py").write_text(source, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    env["PYTHONPATH"] = str(TESTS)
    if require is not None:
        env[REQUIRE_ENV] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_probe.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110, check=False)


@pytest.mark.timeout(120)
def test_a_missing_part_skips_naming_the_part_and_setup(tmp_path: Path) -> None:
    for value in (None, "0"):
        out = _pytest(tmp_path, PROBE, value)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1 passed, 1 skipped" in out.stdout, out.stdout
        skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
        assert len(skipped) == 1 and f"Frobnicator (frob) is missing: run {SETUP} to install it" in skipped[0], \
            out.stdout


@pytest.mark.timeout(120)
def test_under_require_system_a_missing_part_fails(tmp_path: Path) -> None:
    out = _pytest(tmp_path, PROBE, "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout and "skipped" not in out.stdout, out.stdout
    assert f"{REQUIRE_ENV}=1 and Frobnicator (frob) is missing: run {SETUP}" in out.stdout, out.stdout
    # Decided at import (a whole module): a collection error, so the run fails too.
    out = _pytest(tmp_path, PROBE_MODULE, "1")
    assert out.returncode != 0 and "1 error" in out.stdout and "Frobnicator (frob) is missing" in out.stdout, \
        out.stdout
    out = _pytest(tmp_path, PROBE_MODULE, None)
    # 5: pytest's "no tests ran", as the one module in the run skipped whole
    assert out.returncode == 5 and "1 skipped" in out.stdout and "error" not in out.stdout, out.stdout


def _parts_cli(*args: str, path: str, require: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "FSMTRAIN_MERMAID_CHECK")}
    env["PATH"] = path
    if require:
        env[REQUIRE_ENV] = "1"
    return subprocess.run([sys.executable, str(TESTS / "system_parts.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(60)
def test_setup_closing_line_names_what_is_missing_and_what_it_skips(tmp_path: Path) -> None:
    """With nothing on PATH: dot, chromium, node and npm are missing (PostgreSQL may still be found in
    /usr/lib/postgresql, off PATH, where the tests look too)."""
    empty = str(tmp_path)
    out = _parts_cli("packages", "apt", path=empty, require=False)
    assert {"graphviz", "chromium", "nodejs", "npm"} <= set(out.stdout.split()), out.stdout
    for require in (False, True):
        out = _parts_cli("summary", path=empty, require=require)
        lines = out.stdout.splitlines()
        assert len(lines) == 1, out.stdout
        line = lines[0]
        assert line.startswith("setup: could not install Graphviz (dot), Chromium"), line
        for named in ("Node.js (node, npm)", "Mermaid (npm ci in tests/mermaid)", "tests/test_report_browser.py",
                      "the SVG diagram tests in tests/test_diagrams.py", "the Mermaid check in tests/test_diagrams.py",
                      f"run {SETUP} again"):
            assert named in line, named
        assert out.returncode == (1 if require else 0), out.returncode


def test_every_part_names_what_it_skips_and_how_it_is_installed() -> None:
    assert len({p.key for p in PARTS}) == len(PARTS)
    for part in PARTS:
        assert part.skips.startswith(("the ", "tests/")) and "tests/" in part.skips, part
        # Mermaid comes from npm ci, the others from a system package manager.
        assert part.key == "mermaid" or (part.apt and (part.brew or part.brew_cask)), part


def test_setup_script_is_executable_valid_bash_and_never_prompts() -> None:
    script = ROOT / "setup.sh"
    assert os.access(script, os.X_OK), "setup.sh is not executable"
    text = script.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in text.splitlines() if "apt-get install" in line and "say " not in line]
    assert installs and all(" -y " in line and "DEBIAN_FRONTEND=noninteractive" in line for line in installs), installs


# The suite's own system-part tests, on a machine where no part is found. Here every part is installed
# and none may be uninstalled, so a plugin makes each part's locate() find nothing (the one double:
# the machine without the parts); a test that looked for its binary itself instead of through
# system_parts would then run, and pass, instead of skipping.
NO_PARTS_PLUGIN = '''
import dataclasses
import system_parts

for name in ("GRAPHVIZ", "CHROMIUM", "POSTGRES", "NODE", "MERMAID"):
    setattr(system_parts, name, dataclasses.replace(getattr(system_parts, name), locate=lambda: None))
'''
SYSTEM_TESTS = {
    "tests/test_report_browser.py::test_run_and_study_reports_in_chromium": "Chromium",
    "tests/test_report_browser.py::test_the_checks_catch_a_request_an_error_and_a_blank_page": "Chromium",
    "tests/test_diagrams.py::test_dot_accepts_the_committed_dot_file": "Graphviz (dot)",
    "tests/test_diagrams.py::test_fresh_svgs_fit_a_screen": "Graphviz (dot)",
    "tests/test_diagrams.py::test_mermaid_itself_parses_the_diagrams_and_the_readme_block":
        "Mermaid (npm ci in tests/mermaid)",
    "tests/test_hpo_workers.py::test_two_processes_on_postgresql": "PostgreSQL (initdb, pg_ctl)",
    "tests/test_hpo_workers.py::test_a_killed_worker_is_failed_by_heartbeat_and_retried": "PostgreSQL (initdb, pg_ctl)",
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_suite_system_tests_skip_without_their_part_and_fail_under_require_system(tmp_path: Path) -> None:
    (tmp_path / "no_parts.py").write_text(NO_PARTS_PLUGIN, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(TESTS), str(ROOT)])
    env["COLUMNS"] = "1000"  # whole reasons on the short-summary lines
    cmd = [sys.executable, "-m", "pytest", "-q", "-rsfE", "-p", "no:cacheprovider", "-p", "no_parts", *SYSTEM_TESTS]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert out.returncode == 0 and f"{len(SYSTEM_TESTS)} skipped" in out.stdout, out.stdout + out.stderr
    reasons = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    for part in set(SYSTEM_TESTS.values()):
        assert any(f"{part} is missing: run {SETUP} to install it" in line for line in reasons), (part, reasons)

    env[REQUIRE_ENV] = "1"
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert out.returncode == 1 and "skipped" not in out.stdout and "passed" not in out.stdout, out.stdout
    # Each of the seven fails (ERROR where a fixture asks for the part), naming its part.
    for test, part in SYSTEM_TESTS.items():
        assert any(test in line and f"{REQUIRE_ENV}=1 and {part} is missing" in line
                   for line in out.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), (test, out.stdout)
