"""The syntax tier of a run config: YAML with duplicate keys rejected, ``1e-3`` read as a float,
size and alias-expansion bounds, and ``--set key.path=value`` overrides."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fsmtrain.app.config.problems import ConfigError, ConfigProblem, config_error

MAX_CONFIG_BYTES_ENV = "FSMTRAIN_MAX_CONFIG_BYTES"
DEFAULT_MAX_CONFIG_BYTES = 1_000_000
MAX_CONFIG_NODES = 100_000

# YAML 1.1 reads ``1e-3`` as a string; this resolver accepts the forms Python's float() accepts.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class ConfigLoader(yaml.SafeLoader):
    """The safe loader with floats as Python reads them; duplicate keys are found by ``_duplicates``."""


def _duplicates(node: yaml.Node, path: tuple[str, ...] = ()) -> list[ConfigProblem]:
    """Every repeated key in the composed tree, with its YAML path and both lines (PyYAML keeps the last)."""
    found: list[ConfigProblem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            if key in seen and key_node.tag != "tag:yaml.org,2002:merge":
                found.append(ConfigProblem(
                    ".".join((*path, key)), "each key once per mapping",
                    f"duplicate key {key!r} at line {line} (first at line {seen[key]})",
                ))
            seen.setdefault(key, line)
            found += _duplicates(value_node, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicates(item, (*path, str(i)))
    return found


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's message without its source snippet: what it found, and where (1-based)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        return f"{what} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _expanded_size(root: yaml.Node, budget: int) -> int | None:
    """How many nodes ``root`` is with every alias expanded (capped past ``budget``), counted without
    expanding; ``None`` for a document that contains itself."""
    sizes: dict[int, int] = {}
    inside: set[int] = set()

    def size(node: yaml.Node) -> int | None:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in inside:
            return None  # an alias to a node that holds it: endless
        inside.add(id(node))
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else []
        total = 1
        for child in children:
            n = size(child)
            if n is None:
                return None
            total = min(budget + 1, total + n)
        inside.discard(id(node))
        sizes[id(node)] = total
        return total
    return size(root)


def _parse_yaml(text: str, source: str) -> Any:
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, MAX_CONFIG_NODES)
        if size is None:
            raise config_error("", "a config that does not contain itself",
                               "config contains itself (a recursive YAML alias)", source)
        if size > MAX_CONFIG_NODES:
            raise config_error("", f"at most {MAX_CONFIG_NODES:,} nodes with its aliases expanded",
                               f"config expands to more than {MAX_CONFIG_NODES:,} nodes (YAML aliases)", source)
        problems = _duplicates(node)
        if problems:
            raise ConfigError(problems, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise config_error("", "valid YAML", _yaml_error(exc), source) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise config_error("", "YAML nested less deeply", "collections nested too deeply to read", source) from None
    finally:
        loader.dispose()


def max_config_bytes(source: str | None = None) -> int:
    """The size limit of a config file: ``FSMTRAIN_MAX_CONFIG_BYTES`` if set, else 1 MB."""
    raw = os.environ.get(MAX_CONFIG_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_CONFIG_BYTES
    try:
        limit = int(raw.replace("_", ""))
    except ValueError:
        limit = 0
    if limit <= 0:
        raise config_error(f"${MAX_CONFIG_BYTES_ENV} (environment)", "a positive whole number of bytes", repr(raw),
                           source)
    return limit


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file into a plain dict (syntax tier only)."""
    p = Path(path)
    if not p.is_file():
        found = "a directory" if p.is_dir() else "a path that does not exist" if not p.exists() else "not a file"
        raise config_error("", "a YAML file", f"{found}: {str(p)!r}", str(p))
    limit, size = max_config_bytes(str(p)), p.stat().st_size
    if size > limit:
        raise config_error("", f"a config file of at most {limit:,} bytes ({MAX_CONFIG_BYTES_ENV} sets the limit)",
                           f"{size:,} bytes", str(p))
    raw = p.read_bytes()
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\x00"), raw.index(b"\x00") + 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise config_error("", "a YAML text file (UTF-8)", f"binary content ({exc.reason} at byte {exc.start})",
                           str(p)) from None
    data = _parse_yaml(text, str(p))
    if not isinstance(data, dict):
        found = "an empty file (no keys at all)" if data is None else type(data).__name__
        raise config_error("", "a mapping of config keys", found, str(p))
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``"a.b=value"`` overrides to a copy of ``data``; ``value`` is parsed as YAML, and a number
    indexes a list (``callbacks.extra.0.kwargs.threshold=0.5``)."""
    out = copy.deepcopy(dict(data))
    problems: list[ConfigProblem] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            problems.append(ConfigProblem(key or item, "an override of the form key.path=value", repr(item)))
            continue
        try:
            problem = set_at(out, key, _parse_yaml(raw, f"--set {item}"))
        except ConfigError as exc:
            problems.extend(ConfigProblem(key, p.expected, p.found) for p in exc.problems)
            continue
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ConfigError(problems, "overrides")
    return out


def set_at(data: dict[str, Any], key: str, value: Any) -> ConfigProblem | None:
    """Set ``value`` at the dotted path ``key`` of ``data`` in place (a missing or null mapping is made,
    a number indexes a list); the problem, at ``key``, when the path cannot be set."""
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                span = f"from 0 to {len(node) - 1}" if node else "(it is empty)"
                return ConfigProblem(key, f"an index of {where} {span}",
                                     repr(part) if not part.isdigit() else f"{part} ({len(node)} items)")
            part_key: Any = int(part)
        elif isinstance(node, dict):
            part_key = part
        else:
            return ConfigProblem(key, f"{where} to be a mapping or a list", type(node).__name__)
        if depth == len(parts) - 1:
            node[part_key] = value
            return None
        child = node[part_key] if isinstance(node, list) else node.get(part_key)
        if child is None:
            child = node[part_key] = {}
        node = child
    return None


def override_of(path: str, overrides: Sequence[str]) -> str | None:
    """The ``--set`` that wrote the value at ``path`` (or above it), if one did."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if key and (path == key or path.startswith(key + ".")):
            return item
    return None
