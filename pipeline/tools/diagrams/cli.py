"""``fsmtrain diagram``: the drawings of :mod:`fsmtrain.core.drawing`, and the callbacks a config runs."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from fsmtrain.core.drawing import (
    SUFFIXES,
    DiagramError,
    Format,
    GraphvizMissing,
    callback_diagram,
    lifecycle_diagram,
    run_diagram,
    write_lifecycle_files,
)
from fsmtrain.core.hooks import TrainingCallback

__all__ = ["config_callbacks", "register_cli"]


def config_callbacks(config_path: str | Path, *, trial: bool | None = None) -> list[TrainingCallback]:
    """The callbacks ``fsmtrain train`` runs for a config; ``trial`` adds an HPO trial's ``PrunerCallback``
    (default: when the config has an ``optimize`` section)."""
    from fsmtrain.app import config as config_mod

    cfg = config_mod.load_config(config_path)
    with_trial = cfg.optimize is not None if trial is None else trial
    optuna_trial = None
    if with_trial:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna_trial = optuna.create_study().ask()
    # A run directory is needed for the checkpoint callback to be in the list; nothing is written.
    with tempfile.TemporaryDirectory(prefix="fsmtrain-diagram-") as tmp:
        return config_mod.build_callbacks(cfg, run_dir=Path(tmp) / "run", trial=optuna_trial)


# Image and document files no format of fsmtrain diagram is: -o life.png would hold Mermaid text.
_NOT_WRITTEN = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".pdf", ".eps", ".ps")


def _format_of(args: argparse.Namespace) -> Format:
    if args.format is not None:
        return Format(args.format)
    output = str(args.output or "").lower()
    return next((fmt for fmt, suffix in SUFFIXES.items() if output.endswith(suffix)), Format.MERMAID)


def _output_problem(output: str, fmt: Format, explicit: bool) -> str | None:
    """Why ``-o output`` cannot take the ``fmt`` drawing (None: it can), checked before anything is drawn."""
    path = Path(output)
    suffix = path.suffix.lower()
    other = next((f for f, s in SUFFIXES.items() if s == suffix and f is not fmt), None)
    if other is not None or suffix in _NOT_WRITTEN:
        what = "a format fsmtrain diagram does not write" if other is None else f"the suffix of --format {other.value}"
        expected = (f"a {SUFFIXES[fmt]} file for --format {fmt.value}" if explicit else
                    "a file ending in .mmd (mermaid), .dot (dot) or .svg (svg, the image format it writes)")
        return f"-o {output}: expected {expected}; found {path.suffix}, {what}"
    if path.is_dir():
        return f"-o {output}: expected a file to write; found a folder"
    for folder in path.parents:
        if folder.exists() and not folder.is_dir():
            return f"-o {output}: expected a file in a folder; found {folder}, a file"
    if not path.parent.is_dir():
        return f"-o {output}: expected a file in an existing folder; found that {path.parent} does not exist"
    return None


def _cmd_diagram(args: argparse.Namespace) -> int:
    fmt = _format_of(args)
    problem = (None if args.output is None or args.write is not None
               else _output_problem(args.output, fmt, args.format is not None))
    if problem is not None:
        print(f"fsmtrain diagram: {problem}", file=sys.stderr)
        return 2
    try:
        if args.write is not None:
            for path in write_lifecycle_files(args.write):
                print(f"wrote {path}")
            return 0
        if args.run is not None:
            text = run_diagram(args.run, fmt)
        elif args.config is not None:
            text = callback_diagram(config_callbacks(args.config, trial=args.hpo or None), fmt)
        else:
            text = lifecycle_diagram(fmt)
    except (GraphvizMissing, DiagramError, OSError, ValueError) as exc:  # ValueError: a ConfigError
        print(f"fsmtrain diagram: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:  # e.g. a folder that is not writable
        print(f"fsmtrain diagram: cannot write -o {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain diagram`` to the ``fsmtrain`` parser."""
    parser = subparsers.add_parser(
        "diagram", help="draw the lifecycle (Mermaid, DOT or SVG), with callbacks or one run's path",
        description="Draw the training lifecycle from the machine's own table.",
    )
    parser.add_argument("--format", choices=[f.value for f in Format], default=None,
                        help="output format (default: from -o's suffix .mmd/.dot/.svg, else mermaid)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="CONFIG", default=None,
                        help="also list, per phase and transition, the callbacks this config runs, in order")
    parser.add_argument("--hpo", action="store_true",
                        help="with --config: draw it as an HPO trial runs it (adds PrunerCallback)")
    source.add_argument("--run", metavar="RUN_DIR|EVENTS_JSONL", default=None,
                        help="draw the path one run took (edge counts, stop reason and epoch; a multi-process "
                             "run's path once, with its number of ranks)")
    source.add_argument("--write", metavar="DIR", default=None,
                        help="regenerate DIR/lifecycle.{mmd,dot,svg} (the committed diagrams)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help="write here instead of stdout")
    parser.set_defaults(func=_cmd_diagram)
