"""Argument types of the command line: a number out of range is a usage error (exit 2) naming the option."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["config_args", "overrides_of", "positive_float", "positive_int", "set_args"]


def _positive(text: str, convert: type[int] | type[float], expected: str) -> Any:
    try:
        value = convert(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected {expected}; found {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--nproc``, ``--workers``, ``--top``...)."""
    return int(_positive(text, int, "a whole number >= 1"))


def positive_float(text: str) -> float:
    """Seconds > 0 (``--timeout``)."""
    return float(_positive(text, float, "seconds > 0"))


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The ``--set`` items of ``config_args``, ``--device`` as one more."""
    return [*(args.set or []), *([f"device={args.device}"] if getattr(args, "device", None) else [])]


def set_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--set`` (``what`` it may change) and its ``--device`` shorthand."""
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", default=[], help=what)
    p.add_argument("--device", help="shorthand for --set device=D (cpu, cuda, cuda:N, mps)")


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the YAML run config")
    set_args(p, "override a config value (YAML scalar), repeatable: --set optimizer_config.lr=0.01")
