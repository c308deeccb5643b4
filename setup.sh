#!/usr/bin/env bash
# The set-up command (README, "Set up and run"): the system packages the tests use, torch, the project
# with its dev and examples extras, and the pinned Mermaid of tests/mermaid. Safe to run again: each
# step skips what is present. Ends with one line: what it could not install and what that skips.
#   FSMTRAIN_TORCH_INDEX=<url>  install torch from that index (PyTorch's CPU or CUDA wheel index)
#   FSMTRAIN_REQUIRE_SYSTEM=1   exit 1 when a system part is still missing (CI)
set -euo pipefail
cd "$(dirname "$0")"

TORCH_VERSION=2.13.0
export DEBIAN_FRONTEND=noninteractive
say() { printf 'setup: %s\n' "$*"; }

if ! command -v python >/dev/null 2>&1; then
  say "no 'python' on PATH: make and activate a virtual environment (python3 -m venv .venv && . .venv/bin/activate), then run ./setup.sh again" >&2
  exit 1
fi
python -c 'import sys; sys.exit(sys.version_info < (3, 10) and "setup: Python >= 3.10 is needed; this python is " + sys.version.split()[0])'
# tests/system_parts.py (standard library only) is the one judge of which system parts are present.
parts() { python tests/system_parts.py "$@"; }

# --- 1. system packages: Graphviz, Chromium, PostgreSQL, Node.js + npm ------------------------------
apt_install() {
  local pkgs available="" p
  local -a sudo=()
  pkgs=$(parts packages apt)
  if [[ -z $pkgs ]]; then say "system packages: all present"; return 0; fi
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo=(sudo -n)
    elif command -v sudo >/dev/null 2>&1 && [[ -t 0 ]]; then sudo=(sudo)  # asks for the password at a terminal
    else say "not root and no usable sudo: not installing $pkgs"; return 0
    fi
  fi
  say "apt-get install $pkgs"
  "${sudo[@]+"${sudo[@]}"}" apt-get update -qq || say "apt-get update failed"
  for p in $pkgs; do
    if apt-cache show "$p" >/dev/null 2>&1; then available+=" $p"; else say "apt knows no package $p"; fi
  done
  [[ -n $available ]] || return 0
  # shellcheck disable=SC2086  # one word per package
  "${sudo[@]+"${sudo[@]}"}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold $available >/dev/null \
    || say "apt-get install$available failed"
}

brew_install() {
  local formulas casks
  formulas=$(parts packages brew)
  casks=$(parts packages brew-cask)
  if [[ -z $formulas$casks ]]; then say "system packages: all present"; return 0; fi
  # shellcheck disable=SC2086  # one word per package
  if [[ -n $formulas ]]; then brew install $formulas || say "brew install $formulas failed"; fi
  # shellcheck disable=SC2086
  if [[ -n $casks ]]; then brew install --cask $casks || say "brew install --cask $casks failed"; fi
}

if [[ $(uname -s) == Darwin ]] && command -v brew >/dev/null 2>&1; then brew_install
elif command -v apt-get >/dev/null 2>&1; then apt_install
else say "neither apt-get nor brew here: install $(parts packages apt) (Debian names) yourself"
fi

# --- 2. torch first, pinned, so the project's own install never resolves another torch --------------
have_torch=$(python -c 'from importlib import metadata
try:
    print(metadata.version("torch"))
except metadata.PackageNotFoundError:
    pass')
index=${FSMTRAIN_TORCH_INDEX:-}
build=""
[[ $have_torch == *+* ]] && build=${have_torch#*+}
if [[ ${have_torch%%+*} == "$TORCH_VERSION" && ( -z $index || ${index%/} == */"$build" ) ]]; then
  say "torch $have_torch is installed"
else
  if [[ -n $have_torch && -n $index ]]; then
    say "torch $have_torch is installed; replacing it with the build from $index"
    python -m pip uninstall -y -q torch
  fi
  if [[ -n $index ]]; then python -m pip install "torch==$TORCH_VERSION" --index-url "$index"
  else python -m pip install "torch==$TORCH_VERSION"
  fi
  have_torch=$(python -c 'from importlib import metadata; print(metadata.version("torch"))')
  if [[ -n $index && ${index%/} != */"${have_torch#*+}" ]]; then  # e.g. a find-links folder in pip's config won
    say "torch $have_torch is installed, not a build from ${index%/}: pip found it elsewhere (a find-links or extra index in pip config list)"
  fi
fi

# --- 3. the project, editable, with its dev and examples extras -------------------------------------
# Skipped when fsmtrain is installed editable from this folder and every requirement that pyproject.toml
# names now (extras and their own dependencies included) is installed at a version it accepts.
if python -I - <<'PY'  # -I: the installed state, not this folder's fsmtrain.egg-info or PYTHONPATH
import json, sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

try:
    import tomllib
except ImportError:  # Python 3.10: no TOML reader in the standard library; pip decides
    sys.exit(1)
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

root = Path.cwd().resolve()
try:
    dist = metadata.distribution("fsmtrain")
except metadata.PackageNotFoundError:
    sys.exit(1)
url = json.loads(dist.read_text("direct_url.json") or "{}")
if not url.get("dir_info", {}).get("editable") or Path(unquote(urlparse(url.get("url", "")).path)).resolve() != root:
    sys.exit(1)
project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
if dist.version != project["version"] or scripts != project.get("scripts", {}):
    sys.exit(1)
todo = [Requirement(r) for r in project["dependencies"]]
todo += [Requirement(r) for extra in ("dev", "examples") for r in project["optional-dependencies"][extra]]
seen = set()
while todo:
    req = todo.pop()
    key = (req.name.lower(), frozenset(req.extras))
    if key in seen:
        continue
    seen.add(key)
    try:
        have = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(have.version, prereleases=True):
        sys.exit(1)
    for line in have.requires or []:
        sub = Requirement(line)
        if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
            todo.append(sub)
# The strict editable install links each module: one added since needs the install again.
import importlib.util
spec = importlib.util.find_spec("fsmtrain")
if spec is None or spec.origin is None:
    sys.exit(1)
installed = Path(spec.origin).parent
for folder, prefix in (("pipeline", installed), ("callbacks", installed / "callbacks")):
    for src in (root / folder).rglob("*.py"):
        if "__pycache__" not in src.parts and not (prefix / src.relative_to(root / folder)).exists():
            sys.exit(1)
PY
then
  say "fsmtrain (editable, this folder) and its dev and examples extras are installed"
else
  # strict: a tree of links to pipeline/ (as fsmtrain) and callbacks/ (as fsmtrain.callbacks), which mypy
  # and every tool can read as a plain package; a module added later needs this install again
  python -m pip install -e '.[dev,examples]' --config-settings editable_mode=strict
fi
# Where PYTHONDONTWRITEBYTECODE is set nothing caches bytecode, and every fsmtrain command would compile
# the sources again (about a second of CPU): compile them where they are imported from, the link tree.
if python -m compileall -q "$(python -I -c 'import fsmtrain, os; print(os.path.dirname(fsmtrain.__file__))')"
then say "fsmtrain compiled (bytecode cache)"
else say "fsmtrain could not all be compiled (above); each command compiles it as it runs"
fi

# --- 4. the pinned Mermaid (Node, jsdom) that parses the diagrams in tests/test_diagrams.py ----------
lock=tests/mermaid/node_modules/.package-lock.json
if [[ -f $lock && $lock -nt tests/mermaid/package-lock.json ]] && parts has mermaid; then
  say "tests/mermaid/node_modules is installed"
elif command -v npm >/dev/null 2>&1; then
  (cd tests/mermaid && npm ci --no-audit --no-fund --loglevel=error) || say "npm ci in tests/mermaid failed"
else
  say "no npm: not running npm ci in tests/mermaid"
fi

# --- the one closing line ---------------------------------------------------------------------------
parts summary
