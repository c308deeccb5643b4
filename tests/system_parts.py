"""The system parts the suite uses beyond pip — Graphviz, Chromium, PostgreSQL, Node.js and the pinned
Mermaid — where each is found, and the one way a test goes without one: :func:`require`.

``./setup.sh`` installs them; this module is the single judge of what is present, for the tests and
for set-up alike (``setup.sh`` asks it which packages to install and prints its closing line)::

    python tests/system_parts.py packages apt   # the apt packages of the parts not found (or brew, brew-cask)
    python tests/system_parts.py summary        # one line: what is missing and what that skips

A missing part skips its tests with a reason naming the part and ``./setup.sh``; with
``FSMTRAIN_REQUIRE_SYSTEM=1`` (CI) it fails them instead, so a green CI run skipped nothing.
Standard library only: set-up runs it before the project's dependencies are installed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, NoReturn, TypeVar

REPO = Path(__file__).resolve().parents[1]
SETUP = "./setup.sh"
REQUIRE_ENV = "FSMTRAIN_REQUIRE_SYSTEM"
MERMAID_ENV = "FSMTRAIN_MERMAID_CHECK"  # optional: another folder holding check.mjs and its node_modules
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Part(Generic[T_co]):
    """One system part: its key (for ``setup.sh``), its name in messages, what its absence skips, the
    packages that install it, and how to find it (``locate`` returns what the tests use, or None)."""

    key: str
    name: str
    skips: str
    apt: tuple[str, ...]
    brew: tuple[str, ...]  # ``brew install``
    brew_cask: tuple[str, ...]  # ``brew install --cask``
    locate: Callable[[], T_co | None]


def _which(*names: str) -> str | None:
    return next((found for name in names if (found := shutil.which(name))), None)


def find_dot() -> str | None:
    return _which("dot")


def find_chromium() -> str | None:
    app = Path("/Applications/Chromium.app/Contents/MacOS/Chromium")  # brew install --cask chromium
    return _which("chromium", "chromium-browser") or (str(app) if app.is_file() else None)


def _version_key(bindir: Path) -> tuple[int, ...]:
    digits = "".join(c if c.isdigit() else " " for c in bindir.parent.name).split()
    return tuple(int(d) for d in digits)


def find_postgres_bin() -> Path | None:
    """The folder with ``initdb``, ``pg_ctl`` and ``createdb``: Debian keeps them off PATH in
    /usr/lib/postgresql/<version>/bin (newest wins), Homebrew's postgresql@N in opt/postgresql@N/bin."""
    tools = ("initdb", "pg_ctl", "createdb")
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for prefix in (Path("/opt/homebrew/opt"), Path("/usr/local/opt")):
        candidates += sorted(prefix.glob("postgresql*/bin"), key=_version_key, reverse=True)
    on_path = shutil.which("pg_ctl")
    if on_path:  # a symlink such as /usr/local/bin/pg_ctl: its real folder has the other tools
        candidates.append(Path(on_path).resolve().parent)
    return next((d for d in candidates if all((d / t).is_file() for t in tools)), None)


def find_node() -> str | None:
    node = shutil.which("node")
    return node if node and shutil.which("npm") else None


def mermaid_folder() -> Path:
    return Path(os.environ.get(MERMAID_ENV) or REPO / "tests" / "mermaid")


def find_mermaid() -> Path | None:
    """tests/mermaid with every dependency of its package.json in node_modules, and Node to run it."""
    folder = mermaid_folder()
    try:
        deps = json.loads((folder / "package.json").read_text(encoding="utf-8"))["dependencies"]
    except (OSError, ValueError, KeyError):
        return None
    installed = all((folder / "node_modules" / name / "package.json").is_file() for name in deps)
    return folder if installed and shutil.which("node") else None


GRAPHVIZ = Part("graphviz", "Graphviz (dot)", "the SVG diagram tests in tests/test_diagrams.py",
                apt=("graphviz",), brew=("graphviz",), brew_cask=(), locate=find_dot)
CHROMIUM = Part("chromium", "Chromium", "tests/test_report_browser.py",
                apt=("chromium",), brew=(), brew_cask=("chromium",), locate=find_chromium)
POSTGRES = Part("postgres", "PostgreSQL (initdb, pg_ctl)", "the PostgreSQL tests in tests/test_hpo_workers.py",
                apt=("postgresql",), brew=("postgresql@16",), brew_cask=(), locate=find_postgres_bin)
NODE = Part("node", "Node.js (node, npm)", "the Mermaid check in tests/test_diagrams.py",
            apt=("nodejs", "npm"), brew=("node",), brew_cask=(), locate=find_node)
MERMAID = Part("mermaid", "Mermaid (npm ci in tests/mermaid)", "the Mermaid check in tests/test_diagrams.py",
               apt=(), brew=(), brew_cask=(), locate=find_mermaid)
PARTS: tuple[Part[object], ...] = (GRAPHVIZ, CHROMIUM, POSTGRES, NODE, MERMAID)


def required() -> bool:
    """True when ``FSMTRAIN_REQUIRE_SYSTEM`` is set to a true value: a missing part fails its tests."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def missing_reason(part: Part[T], why: str = "") -> str:
    state = f"is not usable here ({why})" if why else "is missing"
    return f"{part.name} {state}: run {SETUP} to install it"


def go_without(part: Part[T], why: str = "") -> NoReturn:
    """Skip the current test (or module) for a missing ``part``; under FSMTRAIN_REQUIRE_SYSTEM=1, fail it."""
    import pytest

    reason = missing_reason(part, why)
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(part: Part[T]) -> T:
    """What ``part.locate()`` found; where it found nothing, :func:`go_without` the part."""
    found = part.locate()
    if found is None:
        go_without(part)
    return found


def missing() -> list[Part[object]]:
    return [p for p in PARTS if p.locate() is None]


def summary(absent: list[Part[object]]) -> str:
    """set-up's closing line."""
    if not absent:
        return (f"setup: everything is present ({', '.join(p.name for p in PARTS)}); "
                "no test skips for a missing system part")
    skips = list(dict.fromkeys(p.skips for p in absent))
    return (f"setup: could not install {', '.join(p.name for p in absent)}, so these tests skip: "
            f"{'; '.join(skips)} ({REQUIRE_ENV}=1 fails them instead); install what is named, "
            f"then run {SETUP} again")


def packages(manager: str, absent: list[Part[object]]) -> list[str]:
    """The packages of ``manager`` (apt, brew, brew-cask) that install the ``absent`` parts."""
    field = {"apt": "apt", "brew": "brew", "brew-cask": "brew_cask"}[manager]
    return list(dict.fromkeys(pkg for p in absent for pkg in getattr(p, field)))


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "packages" and argv[1] in ("apt", "brew", "brew-cask"):
        print(" ".join(packages(argv[1], missing())))
        return 0
    if len(argv) == 2 and argv[0] == "has":  # exit status 0 when the part is found
        part = {p.key: p for p in PARTS}.get(argv[1])
        return 2 if part is None else int(part.locate() is None)
    if argv == ["summary"]:
        absent = missing()
        print(summary(absent))
        return 1 if absent and required() else 0
    print("usage: python tests/system_parts.py packages {apt|brew|brew-cask} | has PART | summary", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
