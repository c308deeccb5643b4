"""The walk of ``fsmtrain train``: which of fsmtrain's modules a train enters, and how straight.

Runs ``fsmtrain train configs/quickstart.yaml --set epochs=1`` in this process under
``sys.setprofile`` and follows the calls made from ``cmd_train`` among fsmtrain's own modules (a
call through torch or ``transitions`` counts from the fsmtrain module that made it). Each
(caller module, callee module) edge counts once, at its first call, so the per-batch loop does not
drown the figures. Prints:

- modules entered: the distinct modules called into;
- climbs up a layer: edges from a lower layer into a higher one (the import-linter layers:
  cli > tools > app > callbacks > training > core);
- returns to a module already left: in the order the edges first occur, an entry into a module
  the walk had entered before (and the modules entered most often).

    python benchmarks/train_walk.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("fsmtrain.core", "fsmtrain.training", "fsmtrain.callbacks", "fsmtrain.app", "fsmtrain.tools",
          "fsmtrain.cli")


def layer_of(module: str) -> int:
    """The module's layer, bottom 0; -1 for the package's own ``__init__``/``__main__``."""
    return max((i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")), default=-1)


class Walk:
    """The fsmtrain-to-fsmtrain call edges made while ``cmd_train`` runs, in first-call order."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the modules of the live fsmtrain frames inside cmd_train
        self.edges: dict[tuple[str, str], None] = {}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("fsmtrain"):
            return
        if event == "call":
            if not self.stack and frame.f_code.co_name != "cmd_train":
                return
            if self.stack and self.stack[-1] != module:
                self.edges.setdefault((self.stack[-1], module), None)
            self.stack.append(module)
        elif event == "return" and self.stack:
            self.stack.pop()


def main() -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    from fsmtrain.cli import main as fsmtrain_main

    walk = Walk()
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["train", str(REPO / "configs" / "quickstart.yaml"), "--set", "epochs=1", "--run-dir", tmp]
        sys.setprofile(walk.profile)
        try:
            code = fsmtrain_main(argv)
        finally:
            sys.setprofile(None)
    entered: list[str] = []
    for _, callee in walk.edges:
        if not entered or entered[-1] != callee:
            entered.append(callee)
    seen: set[str] = set()
    returns = 0
    for module in entered:
        returns += module in seen
        seen.add(module)
    climbs = [(a, b) for a, b in walk.edges if layer_of(b) > layer_of(a) >= 0]
    print(f"exit code {code}")
    print(f"modules entered: {len(seen)}")
    print(f"climbs up a layer: {len(climbs)}")
    for a, b in climbs:
        print(f"  {a} -> {b}")
    print(f"returns to a module already left: {returns}")
    counts = Counter(entered)
    print("entered most often: " + ", ".join(f"{m} {n}" for m, n in counts.most_common(6)))
    print(f"entered: app.job {counts['fsmtrain.app.job']}, app.run_commands {counts['fsmtrain.app.run_commands']}")


if __name__ == "__main__":
    main()
