"""``pipeline.app.config.static_lookup`` reads from source what ``validate`` used to import torch for. Whatever
it decides must be what the import says (differential test over every public callable of the
libraries a config names), and whatever the source does not settle must be left undecided."""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.app.config.resolution import _KIND_BASES
from pipeline.app.config.static_lookup import Found, Undecided, lookup

LIBRARIES = ("torch.optim", "torch.optim.lr_scheduler", "torch.nn", "torch.nn.functional", "pytorch_optimizer",
             "callbacks", "pipeline.training.models", "pipeline.training.data")
ROOTS = sorted(set().union(*_KIND_BASES.values()))


def _shape(sig: inspect.Signature) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in sig.parameters.values()]


def _public_callables() -> Iterator[tuple[str, object]]:
    for name in LIBRARIES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and callable(obj) and not inspect.ismodule(obj):
                yield f"{name}.{attr}", obj


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_decided_answer_is_what_the_import_says() -> None:
    decided = 0
    wrong = []
    for path, obj in _public_callables():
        try:
            found = lookup(path)
        except Undecided:
            continue
        decided += 1
        if found.is_class != inspect.isclass(obj):
            wrong.append(f"{path}: class? {found.is_class}")
            continue
        if found.is_class:
            assert isinstance(obj, type)
            real = {f"{c.__module__}.{c.__qualname__}" for c in obj.__mro__}
            for root in ROOTS:  # the kind checks validate makes
                if (root in found.lineage) != (root in real):
                    wrong.append(f"{path}: derives from {root}? source {root in found.lineage}, import {root in real}")
            if [q.rpartition(".")[2] for q in found.lineage] != [c.__qualname__ for c in obj.__mro__]:
                wrong.append(f"{path}: MRO {found.lineage} vs {obj.__mro__}")
        if _shape(found.signature) != _shape(inspect.signature(obj)):
            wrong.append(f"{path}: signature {found.signature} vs {inspect.signature(obj)}")
    assert not wrong, "\n".join(wrong)
    assert decided >= 300  # it reads most of them (492 of 584 with torch 2.13); the rest are imported


def test_the_paths_of_the_shipped_configs_are_read_from_source() -> None:
    adam = lookup("torch.optim.Adam")
    assert adam.is_class and "torch.optim.optimizer.Optimizer" in adam.lineage
    assert list(adam.signature.parameters)[:2] == ["params", "lr"]
    assert "torch.nn.modules.module.Module" in lookup("torch.nn.MSELoss").lineage  # via `from .modules import *`
    assert "torch.optim.lr_scheduler.LRScheduler" in lookup("torch.optim.lr_scheduler.CosineAnnealingLR").lineage
    data = lookup("pipeline.training.data.synthetic_regression")
    assert not data.is_class and data.signature.parameters["seed"].kind is inspect.Parameter.KEYWORD_ONLY


_NAMES = itertools.count()


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A throwaway package on sys.path (a new name each time: lookups are cached per process);
    every module in it raises if imported, and the test checks none was."""
    root = tmp_path / f"slpkg{next(_NAMES)}"
    root.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    assert not [m for m in sys.modules if m.split(".")[0] == root.name], "lookup imported the package"


def _write(root: Path, name: str, source: str) -> None:
    (root / name).write_text("raise RuntimeError('imported')\n" + textwrap.dedent(source))


def _found(path: str) -> Found:
    importlib.invalidate_caches()
    return lookup(path)


def test_follows_packages_relative_and_star_imports_with_all(pkg: Path) -> None:
    _write(pkg, "__init__.py", "from .api import *\n")
    _write(pkg, "api.py", "__all__ = ['Net']\nfrom .base import Base as _B\nclass Net(_B):\n    pass\n"
                          "class Hidden(_B):\n    pass\n")
    _write(pkg, "base.py", "import abc\nclass Base(abc.ABC):\n    def __init__(self, a, /, b, *c, d, e=1, **f):\n"
                           "        pass\n")
    net = _found(f"{pkg.name}.Net")
    assert net.lineage == (f"{pkg.name}.api.Net", f"{pkg.name}.base.Base", "abc.ABC", "builtins.object")
    assert [(p.name, p.kind.name) for p in net.signature.parameters.values()] == [
        ("a", "POSITIONAL_ONLY"), ("b", "POSITIONAL_OR_KEYWORD"), ("c", "VAR_POSITIONAL"), ("d", "KEYWORD_ONLY"),
        ("e", "KEYWORD_ONLY"), ("f", "VAR_KEYWORD")]
    with pytest.raises(Undecided):  # not in __all__: the star import does not bring it
        _found(f"{pkg.name}.Hidden")


def test_diamond_inheritance_takes_the_c3_order(pkg: Path) -> None:
    _write(pkg, "__init__.py", "")
    _write(pkg, "m.py", """
        class A:
            def __init__(self, a): ...
        class B(A): ...
        class C(A):
            def __init__(self, c): ...
        class D(B, C): ...
    """)
    d = _found(f"{pkg.name}.m.D")
    assert [q.rpartition(".")[2] for q in d.lineage] == ["D", "B", "C", "A", "object"]
    assert list(d.signature.parameters) == ["c"]  # C.__init__ comes before A's


@pytest.mark.parametrize("source", [
    "if X:\n    class T: ...\n",  # conditional
    "class T: ...\nclass T: ...\n",  # bound twice
    "import functools\n@functools.total_ordering\nclass T: ...\n",  # a decorator may replace the class
    "class M(type): ...\nclass T(metaclass=M): ...\n",  # a metaclass may define __call__
    "class T:\n    def __new__(cls, x): ...\n",  # __new__ decides the signature
    "class T:\n    @staticmethod\n    def __init__(x): ...\n",  # a decorated __init__
    "T = make_class()\n",  # computed
    "def __getattr__(name): ...\n",  # computed on access
    "from .nowhere import *\n",  # a star import of something that does not exist
    "class T(make_base()): ...\n",  # computed base
    "class T(T): ...\n",  # a cycle (the import would fail with a NameError)
    "class T(:\n",  # a syntax error: the import words it
])
def test_what_the_source_does_not_settle_is_undecided(pkg: Path, source: str) -> None:
    _write(pkg, "__init__.py", "")
    _write(pkg, "m.py", source)
    with pytest.raises(Undecided):
        _found(f"{pkg.name}.m.T")


def test_a_compiled_or_missing_module_is_undecided() -> None:
    with pytest.raises(Undecided):
        lookup("torch._C.Generator")
    with pytest.raises(Undecided):
        lookup("no_such_module_xyz.Thing")
