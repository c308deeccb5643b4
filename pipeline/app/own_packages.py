"""fsmtrain's own ``callbacks`` package, whatever the user's folders hold.

``callbacks`` is a common name for a folder of an ML project. fsmtrain puts the user's folders (the
config's, the run's recorded ones, the working folder) at the front of the import path, and
``python -m`` or a notebook puts the working folder there anyway; a ``callbacks`` folder or module
in one of them would then be what fsmtrain's own ``import callbacks`` finds, and every command
would end in an ``ImportError`` traceback. So before that can happen fsmtrain loads its own
``callbacks`` package from where it is installed (beside ``pipeline``), under its name: the import
system then hands that module to every later ``import callbacks``. Nothing is loaded where no such
folder is in the way.

The user's package of that name cannot be imported in the same process; a dotted path that names
it fails with :func:`hidden_note` saying why, instead of a bare "no attribute".
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

__all__ = ["OWN_CALLBACKS", "hidden_note", "keep_own_callbacks"]

NAME = "callbacks"
OWN_CALLBACKS = Path(__file__).resolve().parents[2] / NAME
"""Where fsmtrain's ``callbacks`` package is installed: beside ``pipeline`` (``pyproject.toml``)."""


def _ours(module: ModuleType) -> bool:
    return any(Path(p).resolve() == OWN_CALLBACKS for p in getattr(module, "__path__", None) or ())


def _holds(folder: Path) -> Path | None:
    """``folder``'s own ``callbacks`` (a package, a namespace folder or a module), if it has one."""
    for candidate in (folder / NAME, folder / f"{NAME}.py"):
        if candidate.exists() and candidate.resolve() != OWN_CALLBACKS:
            return candidate
    return None


def _found_is_ours() -> bool:
    spec = importlib.util.find_spec(NAME)  # finds only: nothing is executed
    return spec is not None and any(Path(p).resolve() == OWN_CALLBACKS
                                    for p in spec.submodule_search_locations or ())


def keep_own_callbacks(folders: Iterable[Path] = ()) -> None:
    """Make sure ``import callbacks`` gives fsmtrain's package, now and once ``folders`` are put at
    the front of the import path (see the module docstring). Raises ``ImportError`` when another
    ``callbacks`` was imported into this process first: fsmtrain cannot run beside it."""
    loaded = sys.modules.get(NAME)
    if loaded is not None:
        if not _ours(loaded):
            where = getattr(loaded, "__file__", None) or list(getattr(loaded, "__path__", None) or [])
            raise ImportError(f"the module {NAME!r} imported in this process is {where}, not fsmtrain's built-in "
                              f"callbacks ({OWN_CALLBACKS}): fsmtrain needs that name; rename your package",
                              name=NAME)
        return
    if _found_is_ours() and not any(_holds(Path(f)) for f in folders):
        return
    spec = importlib.util.spec_from_file_location(NAME, OWN_CALLBACKS / "__init__.py",
                                                  submodule_search_locations=[str(OWN_CALLBACKS)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise


def hidden_note(dotted: str) -> str:
    """Why ``dotted`` cannot name a user's ``callbacks``: where that package is, if one is on the
    import path ("" when none is, or ``dotted`` is not under that name)."""
    if dotted.split(".", 1)[0] != NAME:
        return ""
    for entry in sys.path:
        found = _holds(Path(entry or "."))
        if found is not None:
            return (f"; {found.resolve()} is not importable while fsmtrain runs: fsmtrain's built-in callbacks "
                    f"package has the name {NAME!r}; rename yours")
    return ""
