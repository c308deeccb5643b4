"""Argument types of the command line: a number out of range is an argparse usage error (exit 2,
naming the option), not a value the command quietly bends. Light: argparse only."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = ["positive_float", "positive_int"]

N = TypeVar("N", int, float)


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--nproc``, ``--workers``, ``--top``...)."""
    return _positive(text, int, "a whole number >= 1")


def positive_float(text: str) -> float:
    """Seconds > 0 (``--timeout``)."""
    return _positive(text, float, "seconds > 0")


def _positive(text: str, parse: Callable[[str], N], expected: str) -> N:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}; found {text!r}") from None
    if not value > 0:  # NaN included
        raise argparse.ArgumentTypeError(f"expected {expected}; found {text!r}")
    return value
