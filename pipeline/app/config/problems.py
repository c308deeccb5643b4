"""What a config check reports: one located mistake (``ConfigProblem``) and the error that lists
them all (``ConfigError``); pydantic's schema errors worded so (:func:`schema_problems`)."""

from __future__ import annotations

import difflib
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


@dataclass(frozen=True)
class ConfigProblem:
    """One mistake (or warning) in a config, located by its YAML path (``early_stopping.patience``)."""

    path: str
    expected: str
    found: str
    suggestion: str | None = None

    def __str__(self) -> str:
        text = f"{self.path or '<root>'}: expected {self.expected}; found {self.found}"
        return text + (f" (did you mean {self.suggestion}?)" if self.suggestion else "")


class ConfigError(ValueError):
    """A config is invalid. ``problems`` holds every mistake found; ``str()`` lists them all."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = source if source and source.startswith("--set") else f"config {source}" if source else "config"
        lines = [f"{where} has {len(self.problems)} problems:", *(f"  - {p}" for p in self.problems)]
        super().__init__(f"{where}: {self.problems[0]}" if len(self.problems) == 1 else "\n".join(lines))


def config_error(path: str, expected: str, found: str, source: str | None = None) -> ConfigError:
    """A ConfigError of one problem."""
    return ConfigError([ConfigProblem(path, expected, found)], source)


def closest(word: str, candidates: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not matches:  # case slips ("adam" for "Adam") score low on ratio alone
        lowered = {c.lower(): c for c in candidates}
        matches = [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)]
    return matches[0] if matches else None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _annotation_at(model: type[BaseModel], loc: Sequence[int | str]) -> Any:
    """Walk ``loc`` through the schema: the annotation there (None where ``loc`` leaves it)."""
    ann: Any = model
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(str(part))
            if field is None:
                return None
            ann = field.annotation
        elif get_origin(ann) in (list, dict):
            ann = get_args(ann)[-1] if get_args(ann) else Any
        else:
            return None
    return _unwrap(ann)


def schema_problems(err: ValidationError, schema: type[BaseModel]) -> list[ConfigProblem]:
    """pydantic's errors about ``schema`` as config problems (with the closest known key or option)."""
    problems: list[ConfigProblem] = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            section = _annotation_at(schema, loc[:-1])
            known = list(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
            where = f" of {'.'.join(map(str, loc[:-1]))}" if loc[:-1] else ""
            problems.append(ConfigProblem(path, f"a known key{where}", f"unknown key {str(loc[-1])!r}",
                                          closest(str(loc[-1]), known)))
        elif e["type"] == "missing":
            problems.append(ConfigProblem(path, "a value (this key is required)", "nothing"))
        else:
            ann = _annotation_at(schema, loc) if e["type"] == "literal_error" else None
            options = [str(a) for a in get_args(ann)] if get_origin(ann) is Literal else []
            msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Input should be ")
            problems.append(ConfigProblem(path, msg, repr(e["input"]), closest(str(e["input"]), options)))
    return problems
