"""What the ``fsmtrain`` commands share: their exit statuses, the usage error, and the options and
loading of a config (``fsmtrain.cli`` and ``fsmtrain.app.run_commands`` use them; ``fsmtrain.cli``
re-exports :class:`ExitCode`, :class:`UsageError` and :func:`exit_code_for`).

Imported while the parser is built, so it imports only light code at the top (see ``fsmtrain.cli``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, TextIO

from fsmtrain.core.stop import StopReason

if TYPE_CHECKING:
    from fsmtrain.app.config import RunConfig

__all__ = ["ExitCode", "UsageError", "config_args", "exit_code_for", "load_config_of", "print_warnings", "worst"]


class UsageError(ValueError):
    """Options that do not go together (one line, exit 2)."""


class ExitCode(IntEnum):
    """Process exit status of ``fsmtrain`` (with several seeds: the most severe one)."""

    OK = 0  # COMPLETED, EARLY_STOP or PRUNED; validate/preflight passed
    ERROR = 1  # training raised an exception (details in events.jsonl)
    CONFIG = 2  # invalid config or command line; nothing was trained or written
    NAN = 3  # a loss became NaN/inf and NaNDetectionCallback stopped the run
    PREFLIGHT = 4  # preflight built everything but the step gave non-finite loss or gradients
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell convention)
    BROKEN_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, as a C tool ends there
    TERMINATED = 143  # SIGTERM (128 + 15), what schedulers send before they kill


def exit_code_for(reason: StopReason) -> ExitCode:
    """A run's exit status is a fact of its stop reason (``fsmtrain.core.stop``)."""
    return ExitCode(reason.exit_code)


def _severity(code: ExitCode) -> int:
    """Over several seeds the most severe status wins: the reasons' own severities, under SIGTERM's,
    which is a signal rather than a reason and outranks them all."""
    if code is ExitCode.TERMINATED:
        return max(r.severity for r in StopReason) + 1
    return max((r.severity for r in StopReason if r.exit_code == code), default=0)


def worst(codes: Sequence[ExitCode]) -> ExitCode:
    """The status of a command that ran several seeds: the most severe of theirs (OK for none)."""
    return max(codes, key=_severity, default=ExitCode.OK)


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the YAML run config")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", default=[],
                   help="override a config value (YAML scalar), repeatable: --set optimizer_config.lr=0.01")
    p.add_argument("--device", help="shorthand for --set device=D (cpu, cuda, cuda:N, mps)")


def load_config_of(args: argparse.Namespace) -> RunConfig:
    from fsmtrain.app.config import load_config

    overrides = list(args.set or [])
    if getattr(args, "device", None):
        overrides.append(f"device={args.device}")
    return load_config(args.config, overrides)


def print_warnings(cfg: RunConfig, out: TextIO) -> None:
    for w in cfg.warnings:
        print(f"warning: {w}", file=out)
