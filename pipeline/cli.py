"""The ``fsmtrain`` command line: ``validate``, ``preflight`` and ``init`` here, the others in
``run_commands`` and the ``_PLUGINS`` modules. Each command imports what it needs when it runs, so
``--help``, ``audit`` and ``diagram`` start without torch."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from fsmtrain.app import run_commands
from fsmtrain.app.arg_types import config_args
from fsmtrain.app.run_commands import ExitCode, UsageError, exit_code_for, load_config_of, print_warnings

__all__ = ["ExitCode", "UsageError", "build_parser", "exit_code_for", "main"]


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_config_of(args)
    if cfg.optimize is not None:  # its storage is reachable and agrees on the study's direction
        from fsmtrain.app.hpo.study import check_study
        check_study(cfg, args.config)
    from fsmtrain.app.config.checks import check_builds
    built, data = check_builds(cfg)  # what train would reject when it builds, found now
    if args.data:  # the data builder called once, its first batch through the step on the CPU
        from fsmtrain.app.preflight import check_first_batch
        data = check_first_batch(cfg)
    print_warnings(cfg, sys.stdout)
    print(f"{args.config}: valid ({len(cfg.seeds)} seed(s), {cfg.epochs or 'unbounded'} epochs, net {cfg.net}, "
          f"optimizer{'s ' + ', '.join(cfg.optimizers) if cfg.optimizers else ' ' + cfg.optimizer}, "
          f"{len(cfg.warnings)} warning(s)); built {', '.join(built)} and {data}; "
          f"{'' if args.data else 'no batch was run: '}`fsmtrain preflight {args.config}` runs one step")
    return int(ExitCode.OK)


def cmd_preflight(args: argparse.Namespace) -> int:
    from fsmtrain.app.preflight import PreflightFailed, run_preflight
    cfg = load_config_of(args)
    print_warnings(cfg, sys.stdout)
    try:
        ok = run_preflight(cfg, sys.stdout)
    except PreflightFailed as exc:
        print(exc, file=sys.stderr)
        return int(ExitCode.PREFLIGHT)
    return int(ExitCode.OK if ok else ExitCode.PREFLIGHT)


def cmd_init(args: argparse.Namespace) -> int:
    from fsmtrain.app.config.starter import STARTER_CONFIG, init_problem
    directory = Path(args.dir)
    problem = init_problem(directory, args.name, args.force)
    if problem is not None:
        print(f"fsmtrain init: {problem}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    target = directory / args.name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        target.write_text(STARTER_CONFIG, encoding="utf-8")
    except OSError as exc:  # e.g. a folder that is not writable
        print(f"fsmtrain init: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    print(f"wrote {target}; next: fsmtrain validate {target} && fsmtrain train {target}")
    return int(ExitCode.OK)


_PLUGINS = ("fsmtrain.tools.diagrams.cli", "fsmtrain.tools.audit.cli", "fsmtrain.tools.replay.cli",
            "fsmtrain.tools.report.page", "fsmtrain.app.hpo.cli", "fsmtrain.tools.report.hpo_report",
            "fsmtrain.app.predict")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsmtrain", description="Train PyTorch models from a YAML config on an explicit lifecycle machine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run_commands.register_cli(sub)  # train, resume: the commands that train come first
    p = sub.add_parser("validate", help="check a config (schema, imports, warnings) without training")
    config_args(p)
    p.add_argument("--data", action="store_true",
                   help="also call the data builder once and run its first batch through the step on the CPU "
                        "(a missing data file or a batch the step cannot take is then found here, exit 2)")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("preflight", help="build everything and run one forward/backward/optimizer step")
    config_args(p)
    p.set_defaults(func=cmd_preflight)
    p = sub.add_parser("init", help="write a commented starter config")
    p.add_argument("dir", nargs="?", default=".", help="folder to write it to (default: .)")
    p.add_argument("--name", default="fsmtrain.yaml", help="file name inside DIR, not a path (default: fsmtrain.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_init)
    for module in _PLUGINS:
        importlib.import_module(module).register_cli(sub)
    return parser


# A user's mistake, reported in one line: (module, error class), looked up only if imported.
_USER_ERRORS = (("fsmtrain.app.config.problems", "ConfigError"), ("fsmtrain.app.rundir", "RunDirError"),
                ("fsmtrain.training.resume", "ResumeError"), ("fsmtrain.app.run_commands", "UsageError"),
                ("fsmtrain.training.inference", "InferenceError"))


def _is_config_error(exc: BaseException) -> bool:
    return any(module in sys.modules and isinstance(exc, getattr(sys.modules[module], name))
               for module, name in _USER_ERRORS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Without ``argv`` (the ``fsmtrain`` script) it owns the process: the signals a
    command catches end it with 128 + the first one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    args.owns_process = argv is None
    try:
        code = _run(args)
        sys.stdout.flush()  # inside the try: a closed pipe shows at this flush, not at exit
    except BrokenPipeError:
        # the reader of stdout is gone (`| head`): stdout to /dev/null, so the last flush cannot raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = int(ExitCode.BROKEN_PIPE)
    except BaseException:
        from fsmtrain.core.signals import uninstall
        uninstall(default=args.owns_process)  # the handlers a command found come back (owned: the defaults)
        raise
    return _exit_status(code, args.owns_process)


def _run(args: argparse.Namespace) -> int:
    from fsmtrain.core.engine import Interrupted
    try:
        return int(args.func(args))
    except ValueError as exc:
        if not _is_config_error(exc):
            raise
        print(f"fsmtrain {args.command}: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    except Interrupted as exc:  # honoured during start-up, before a run started
        print(f"fsmtrain {args.command}: {exc} before the run started; nothing was trained", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fsmtrain: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)


# How long the process that owns a command waits for the threads the interpreter would join.
THREADS_BOUND_S = 30.0


def _exit_status(code: int, owns_process: bool) -> int:
    """128 + the first signal the command caught, else ``code``. An owned process first waits (bounded)
    for its other threads, and ends at once when one does not end."""
    from fsmtrain.core.signals import installed, uninstall
    stuck = _unfinished_threads(THREADS_BOUND_S) if owns_process else []
    signals = installed()
    uninstall(default=owns_process)  # first: a signal from here on is the default action, not a lost one
    final = code if signals is None else signals.exit_status(code)
    if final != code and signals is not None:
        print(signals.said(final), file=sys.stderr, flush=True)
    if owns_process:  # what is left is freed with the process: the interpreter's last collection skips it
        gc.freeze()
    if stuck:
        print(f"fsmtrain: gave up waiting {THREADS_BOUND_S:g} s for thread(s) {', '.join(stuck)}; exit code {final} "
              "without the exit handlers", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(final)  # the interpreter would wait for those threads without end
    return final


def _unfinished_threads(bound_s: float) -> list[str]:
    """Join the threads the interpreter waits for at exit, within ``bound_s``; those still running."""
    deadline = time.monotonic() + bound_s
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in others if t.is_alive()]

