"""An import-linter contract of this project's own (``lint-imports`` loads it from ``pyproject.toml``).

``no_flat_modules``: no module matches any of the ``forbidden`` names (``*`` matches within one
part of a dotted name). The config, hpo, audit, replay and report packages replaced flat modules
such as ``pipeline.app.config_schema``; a new file under an old name, or an import of one, would
bring the flat room back. import-linter's own ``forbidden`` contract needs its modules to exist,
so it cannot say "this name must not exist".
"""

from __future__ import annotations

import fnmatch
from typing import Any

from importlinter import Contract, ContractCheck, fields, output


class NoFlatModulesContract(Contract):
    type_name = "no_flat_modules"

    forbidden = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        patterns = [str(p) for p in self.forbidden]  # type: ignore[attr-defined]
        found = sorted(
            m for m in graph.modules
            if any(fnmatch.fnmatchcase(m, p) and m.count(".") == p.count(".") for p in patterns)
        )
        return ContractCheck(kept=not found, warnings=[], metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module in check.metadata["found"]:
            output.print_error(f"{module} is one of the flat modules the packages replaced; "
                               "put it in its package instead")
            output.new_line()
