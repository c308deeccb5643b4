"""``fsmtrain hpo``: the subcommand; the study machinery is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fsmtrain.app.arg_types import config_args, overrides_of, positive_float, positive_int

__all__ = ["cmd_hpo", "register_cli"]


def cmd_hpo(args: argparse.Namespace) -> int:
    from fsmtrain.app.config import load_config_and_data
    from fsmtrain.app.hpo.study import prepare, run_study
    cfg, data = load_config_and_data(args.config, overrides_of(args))
    for w in cfg.warnings:
        print(f"warning: {w}", file=sys.stderr)
    plan = prepare(cfg, data, args.config, study=args.study, storage=args.storage, n_trials=args.n_trials,
                   timeout=args.timeout, workers=args.workers)
    return run_study(plan, sys.stdout)


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain hpo`` to the ``fsmtrain`` parser."""
    p = subparsers.add_parser(
        "hpo", help="run the Optuna study of a config's optimize: section (one audited run per trial and seed)",
        description="Run the hyper-parameter study a config's optimize: section describes (storage: see --storage).")
    config_args(p)
    p.add_argument("--storage", metavar="URL_OR_FILE",
                   help="sqlite:///f.db or f.db (one process), a journal file (--workers on one machine), or a "
                        "database URL such as postgresql://user:pass@host/db (workers on many machines; default: "
                        "runs/<project>/<study>/study.db, or study.journal with --workers or when the study has one)")
    p.add_argument("--study", metavar="NAME", help="study name (default: optimize.study_name, the config's name)")
    p.add_argument("--n-trials", type=positive_int, metavar="N",
                   help="trials this command runs, over all its workers (default: optimize.n_trials)")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="start no trial after S seconds (default: optimize.timeout)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="K",
                   help="worker processes on this machine (default 1)")
    p.set_defaults(func=cmd_hpo)
