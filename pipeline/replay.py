"""Placeholder: being written (see the issue for `fsmtrain replay`)."""

from __future__ import annotations

import argparse
from typing import Any


def register_cli(subparsers: "argparse._SubParsersAction[Any]") -> None:
    """Add the `replay` subcommand to the `fsmtrain` parser (nothing yet)."""
    return None
