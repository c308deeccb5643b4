"""What a config check reports: one located mistake (``ConfigProblem``) and the error that lists
them all (``ConfigError``)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass


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
        n = len(self.problems)
        if n == 1:  # one mistake, one line
            super().__init__(f"{where}: {self.problems[0]}")
            return
        lines = [f"{where} has {n} problems:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def closest(word: str, candidates: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not matches:  # case slips ("adam" for "Adam") score low on ratio alone
        lowered = {c.lower(): c for c in candidates}
        matches = [lowered[m] for m in difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)]
    return matches[0] if matches else None
