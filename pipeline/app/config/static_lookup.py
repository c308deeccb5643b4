"""Find what a dotted path names by reading source, without importing (executing) anything.

``fsmtrain validate`` checks that ``torch.optim.Adam`` is an optimizer class and that its
``optimizer_config`` matches ``Adam.__init__``. Importing ``torch`` to learn that costs seconds; the
answer is in the source. This module follows a dotted path the way ``import`` would (packages,
``from x import y``, ``from x import *`` with ``__all__``, relative imports), then a class's bases
(C3 order) and its ``__init__`` signature, from the AST.

It answers only what the source settles. Anything it cannot read with certainty (a name bound
twice or under an ``if``/``try``, a decorator, a metaclass other than ``ABCMeta``, ``__new__``, an
assignment, a module ``__getattr__``, a compiled module) raises :class:`Undecided`, and the caller
imports for real. It never proves that a module imports cleanly: that is the caller's decision.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.machinery import ModuleSpec

__all__ = ["Found", "Undecided", "lookup"]

# Classes that add no __init__/__new__ and no metaclass __call__: a base we need not read.
_NEUTRAL = frozenset({"builtins.object", "abc.ABC", "typing.Generic"})
_NEUTRAL_METACLASSES = frozenset({"abc.ABCMeta"})
_COMPOUND = (ast.If, ast.Try, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Match)
if sys.version_info >= (3, 11):
    _COMPOUND += (ast.TryStar,)
# A default value stands in for the real one: only whether a parameter has a default matters here.
_HAS_DEFAULT = object()


class Undecided(Exception):
    """The source does not settle the question; import to find out."""


@dataclass(frozen=True)
class Found:
    """What a dotted path names: a class (with its bases in method resolution order) or a function."""

    qualname: str  # module.Name where it is defined
    is_class: bool
    lineage: tuple[str, ...]  # the MRO as qualified names, the class first; () for a function
    signature: inspect.Signature  # as inspect.signature would give it (a class: its __init__ without self)


# --- modules -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Binding:
    kind: str  # class | function | module | from | other
    node: ast.AST | None = None
    target: str = ""  # module: the module bound; from: the module imported from
    name: str = ""  # from: the name imported


@dataclass
class _Module:
    name: str
    is_package: bool
    bindings: dict[str, list[tuple[_Binding, bool]]] = field(default_factory=dict)  # -> [(binding, unconditional)]
    stars: list[tuple[str, bool]] = field(default_factory=list)  # (module, unconditional) of each ``from m import *``
    exports: tuple[str, ...] | None = None  # a literal __all__, if there is exactly one
    dynamic_all: bool = False  # __all__ is computed: what ``import *`` takes is unknown


def _spec(name: str) -> ModuleSpec | None:
    """The spec ``import name`` would use, found without importing the parent packages."""
    parent, _, _ = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name)
    parent_spec = _spec(parent)
    if parent_spec is None or parent_spec.submodule_search_locations is None:
        return None
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None:
            spec: ModuleSpec | None = find_spec(name, list(parent_spec.submodule_search_locations), None)
            if spec is not None:
                return spec
    return None


@cache
def _is_module(name: str) -> bool:
    try:
        return _spec(name) is not None
    except (ImportError, ValueError):
        return False


def _absolute(module: _Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise Undecided(f"relative import beyond the top package in {module.name}")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _collect(module: _Module, body: Sequence[ast.stmt], unconditional: bool) -> list[str]:
    """Record the names ``body`` binds; returns the literal ``__all__`` entries found."""
    exports: list[str] = []

    def bind(name: str, binding: _Binding) -> None:
        module.bindings.setdefault(name, []).append((binding, unconditional))

    for node in body:
        if isinstance(node, ast.ClassDef):
            bind(node.name, _Binding("class", node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bind(node.name, _Binding("function", node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bind(alias.asname, _Binding("module", target=alias.name))
                else:
                    top = alias.name.split(".")[0]
                    bind(top, _Binding("module", target=top))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                if alias.name == "*":
                    module.stars.append((source, unconditional))
                else:
                    bind(alias.asname or alias.name, _Binding("from", target=source, name=alias.name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue  # an annotation alone binds nothing
            for target in targets:
                for name in _target_names(target):
                    bind(name, _Binding("other", node))
            value = getattr(node, "value", None)
            if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
                    and isinstance(value, (ast.List, ast.Tuple))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)):
                exports += [str(e.value) for e in value.elts if isinstance(e, ast.Constant)]
        elif isinstance(node, _COMPOUND):
            for block in _blocks(node):
                exports += _collect(module, block, False)
    return exports


def _target_names(target: ast.expr) -> list[str]:
    """The names an assignment target binds (``x``, ``a, *b``), not ``x.attr = ...`` or ``x[0] = ...``."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists directly inside a compound statement (not inside a def or class)."""
    blocks: list[list[ast.stmt]] = [getattr(node, name, []) for name in ("body", "orelse", "finalbody")]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return blocks


@cache
def _module(name: str) -> _Module:
    try:
        spec = _spec(name)
    except (ImportError, ValueError) as exc:
        raise Undecided(f"cannot find module {name}: {exc}") from None
    origin = spec.origin if spec is not None else None
    if spec is None or origin is None or not spec.has_location or not origin.endswith(".py"):
        raise Undecided(f"no Python source for module {name}")
    try:
        with open(origin, "rb") as fh:
            tree = ast.parse(importlib.util.decode_source(fh.read()), origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise Undecided(f"cannot read {origin}: {exc}") from None  # the import reports it properly
    module = _Module(name, spec.submodule_search_locations is not None)
    exports = _collect(module, tree.body, True)
    all_bindings = module.bindings.get("__all__", [])
    if len(all_bindings) == 1 and all_bindings[0][1] and exports:
        module.exports = tuple(exports)
    elif all_bindings:
        module.dynamic_all = True
    return module


# --- names ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    kind: str  # module | class | function | neutral
    qualname: str
    node: ast.AST | None = None


def _exports(module_name: str, name: str, seen: frozenset[str]) -> bool:
    module = _module(module_name)
    if module.dynamic_all:
        raise Undecided(f"{module_name}.__all__ is not a literal list")
    if module.exports is not None:
        return name in module.exports
    if name.startswith("_"):
        return False
    if name in module.bindings:
        return True
    return any(_exports(src, name, seen | {src}) for src, _ in module.stars if src not in seen)


def _attr(module_name: str, name: str, seen: frozenset[str] = frozenset()) -> _Ref:
    """What ``module_name.name`` is, as ``import`` would bind it."""
    qualname = f"{module_name}.{name}"
    if qualname in _NEUTRAL or qualname in _NEUTRAL_METACLASSES:
        return _Ref("neutral", qualname)
    if qualname in seen:
        raise Undecided(f"{qualname} refers to itself")
    seen = seen | {qualname}
    module = _module(module_name)
    bindings = module.bindings.get(name, [])
    starred = []
    for src, unconditional in module.stars:
        if not unconditional:
            raise Undecided(f"{module_name} has a star import under a condition")
        if _exports(src, name, frozenset({module_name})):
            starred.append(src)
    if len(bindings) + len(starred) > 1 or (bindings and not bindings[0][1]):
        raise Undecided(f"{qualname} is bound more than once or conditionally")
    if starred:
        return _attr(starred[0], name, seen)
    if bindings:
        binding = bindings[0][0]
        if binding.kind in ("class", "function"):
            return _Ref(binding.kind, qualname, binding.node)
        if binding.kind == "module":
            if not _is_module(binding.target):
                raise Undecided(f"no module {binding.target}")
            return _Ref("module", binding.target)
        if binding.kind == "from":
            # ``from pkg import sub`` binds the submodule unless pkg binds the name itself
            sub = f"{binding.target}.{binding.name}"
            if _is_module(sub):
                return _Ref("module", sub)
            return _attr(binding.target, binding.name, seen)
        raise Undecided(f"{qualname} is assigned, not defined")
    if "__getattr__" in module.bindings:
        raise Undecided(f"{module_name} computes attributes at run time")
    if module.is_package and _is_module(qualname):
        return _Ref("module", qualname)
    raise Undecided(f"{qualname} is not defined in the source")


def _resolve(module_name: str, expr: ast.expr) -> _Ref:
    """An expression in a class statement's bases (``Optimizer``, ``nn.Module``, ``Generic[T]``)."""
    if isinstance(expr, ast.Subscript):
        return _resolve(module_name, expr.value)
    if isinstance(expr, ast.Name):
        if expr.id not in _module(module_name).bindings and expr.id == "object":
            return _Ref("neutral", "builtins.object")
        return _attr(module_name, expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(module_name, expr.value)
        if owner.kind != "module":
            raise Undecided(f"{ast.unparse(expr)} is not an attribute of a module")
        return _attr(owner.qualname, expr.attr)
    raise Undecided(f"{ast.unparse(expr)} is computed")


# --- classes -------------------------------------------------------------------------------------
def _class_node(ref: _Ref) -> ast.ClassDef:
    node = ref.node
    assert isinstance(node, ast.ClassDef)
    if node.decorator_list:
        raise Undecided(f"{ref.qualname} is decorated")
    return node


def _bases(ref: _Ref) -> list[_Ref]:
    node = _class_node(ref)
    module_name = ref.qualname.rpartition(".")[0]
    for keyword in node.keywords:
        meta = _resolve(module_name, keyword.value) if keyword.arg == "metaclass" else None
        if meta is None or meta.qualname not in _NEUTRAL_METACLASSES:
            raise Undecided(f"{ref.qualname} has class keyword {keyword.arg!r}")
    bases = [_resolve(module_name, b) for b in node.bases]
    for base in bases:
        if base.kind not in ("class", "neutral") or base.qualname in _NEUTRAL_METACLASSES:
            raise Undecided(f"{ref.qualname} derives from {base.qualname}, which is not a class")
    return bases


@cache
def _mro(ref: _Ref) -> tuple[_Ref, ...]:
    """C3 linearisation, as ``type.__mro__``."""
    if ref.kind == "neutral":
        obj = _Ref("neutral", "builtins.object")
        return (ref,) if ref == obj else (ref, obj)
    bases = _bases(ref) or [_Ref("neutral", "builtins.object")]
    sequences = [list(_mro(b)) for b in bases] + [list(bases)]
    out = [ref]
    while any(sequences):
        for seq in sequences:
            if seq and not any(seq[0] in other[1:] for other in sequences):
                head = seq[0]
                break
        else:
            raise Undecided(f"{ref.qualname} has no consistent method resolution order")
        out.append(head)
        sequences = [s[1:] if s and s[0] == head else s for s in sequences]
    return tuple(out)


def _class_level(body: Sequence[ast.stmt]) -> list[ast.stmt]:
    """Every statement of a class body, also those under if/try, but not inside its methods."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, _COMPOUND):
            for block in _blocks(stmt):
                out += _class_level(block)
    return out


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Delete)):
        targets = stmt.targets if isinstance(stmt, (ast.Assign, ast.Delete)) else [stmt.target]
        return any(name in _target_names(t) for t in targets)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    return False


def _own(ref: _Ref, name: str) -> ast.FunctionDef | None:
    """``name`` defined in the class body itself (once, unconditionally, as a plain method)."""
    node = _class_node(ref)
    found = [stmt for stmt in _class_level(node.body) if _binds(stmt, name)]
    if not found:
        return None
    method = found[0]
    if len(found) > 1 or method not in node.body or not isinstance(method, ast.FunctionDef) or method.decorator_list:
        raise Undecided(f"{ref.qualname}.{name} is not a single plain method")
    return method


def _parameters(args: ast.arguments, drop_first: bool) -> inspect.Signature:
    P = inspect.Parameter
    positional = [(a.arg, P.POSITIONAL_ONLY) for a in args.posonlyargs] + \
                 [(a.arg, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    first_default = len(positional) - len(args.defaults)
    params = [P(name, kind, default=_HAS_DEFAULT if i >= first_default else P.empty)
              for i, (name, kind) in enumerate(positional)]
    if drop_first:
        if not params:
            raise Undecided("a method without a self parameter")
        params = params[1:]
    if args.vararg is not None:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(P(a.arg, P.KEYWORD_ONLY, default=P.empty if default is None else _HAS_DEFAULT))
    if args.kwarg is not None:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _class_signature(mro: Sequence[_Ref]) -> inspect.Signature:
    # inspect.signature(cls): the first class in the MRO defining __new__ or __init__ decides.
    for cls in mro:
        if cls.kind == "neutral":
            break
        if any(_binds(stmt, special) for stmt in _class_level(_class_node(cls).body)
               for special in ("__new__", "__signature__", "__text_signature__")):
            raise Undecided(f"{cls.qualname} defines __new__ or a signature of its own")
        init = _own(cls, "__init__")
        if init is not None:
            return _parameters(init.args, drop_first=True)
    raise Undecided(f"{mro[0].qualname} has no __init__ of its own or in its bases")


def lookup(path: str) -> Found:
    """What ``path`` (``torch.optim.Adam``) names, read from source; :class:`Undecided` when unsure."""
    try:
        return _lookup(path)
    except RecursionError:  # a cycle of bases or re-exports that the guards did not catch
        raise Undecided(f"{path}: too deep to follow") from None


def _lookup(path: str) -> Found:
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise Undecided(f"{path!r} is not a dotted path")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix, as the import path tries it
        modname = ".".join(parts[:i])
        if not _is_module(modname):
            continue
        ref = _Ref("module", modname)
        for part in parts[i:]:
            if ref.kind != "module":
                raise Undecided(f"{path}: an attribute of a {ref.kind}")
            ref = _attr(ref.qualname, part)
        if ref.kind == "class":
            mro = _mro(ref)
            return Found(ref.qualname, True, tuple(c.qualname for c in mro), _class_signature(mro))
        if ref.kind == "function":
            node = ref.node
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if node.decorator_list:
                raise Undecided(f"{path} is decorated")
            return Found(ref.qualname, False, (), _parameters(node.args, drop_first=False))
        raise Undecided(f"{path} is a {ref.kind}")
    raise Undecided(f"no module in {path}")
