"""Argument types of the command line: a number out of range is an argparse usage error (exit 2,
naming the option), not a value the command quietly bends. Light: argparse only."""

from __future__ import annotations

import argparse

__all__ = ["config_args", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """A whole number >= 1 (``--nproc``, ``--workers``, ``--top``...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; found {text!r}")
    return value


def positive_float(text: str) -> float:
    """Seconds > 0 (``--timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0; found {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0; found {text!r}")
    return value


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the YAML run config")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", default=[],
                   help="override a config value (YAML scalar), repeatable: --set optimizer_config.lr=0.01")
    p.add_argument("--device", help="shorthand for --set device=D (cpu, cuda, cuda:N, mps)")
