"""``fsmtrain train`` and ``fsmtrain resume`` (on one process or several), and what every command
shares: exit statuses, the usage error, config loading. The parser imports it: light imports only."""

from __future__ import annotations

import argparse
import io
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fsmtrain.app.arg_types import config_args, overrides_of, positive_int, set_args
from fsmtrain.core.stop import StopReason

if TYPE_CHECKING:
    from fsmtrain.app.config import RunConfig
    from fsmtrain.app.job import SeedRun
    from fsmtrain.app.launch import ElasticAttempt

__all__ = ["ExitCode", "UsageError", "cmd_resume", "cmd_train", "exit_code_for", "load_config_of",
           "print_warnings", "register_cli", "worst"]


class UsageError(ValueError):
    """Options that do not go together (one line, exit 2)."""


class ExitCode(IntEnum):
    """Process exit status of ``fsmtrain`` (with several seeds: the most severe one)."""

    OK = 0  # COMPLETED, STEPS, EARLY_STOP, TARGET_REACHED or PRUNED; validate/preflight passed
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


def worst(codes: Sequence[ExitCode]) -> ExitCode:
    """The status of a command that ran several seeds: the most severe of theirs (OK for none), by their
    reasons' severities; SIGTERM's, a signal, outranks them all."""
    def severity(code: ExitCode) -> float:
        return math.inf if code is ExitCode.TERMINATED else max(
            (r.severity for r in StopReason if r.exit_code == code), default=0)
    return max(codes, key=severity, default=ExitCode.OK)


def load_config_of(args: argparse.Namespace) -> RunConfig:
    from fsmtrain.app.config import load_config
    return load_config(args.config, overrides_of(args))


def print_warnings(cfg: RunConfig, out: TextIO) -> None:
    for w in cfg.warnings:
        print(f"warning: {w}", file=out)


def _describe_seed(run: SeedRun, out: TextIO) -> ExitCode:
    from fsmtrain.core.engine import Interrupted
    result = run.result
    if result is None:  # failed before the machine started (e.g. in Trainer construction)
        print(f"seed {run.seed}: ERROR before training: {run.error!r}  run dir: {run.run_dir}", file=out)
        return ExitCode.ERROR
    from fsmtrain.core.log_file import FileWriteError
    reason = result.stop_reason
    stop = result.stop
    verb = "raised in" if reason is StopReason.ERROR else "requested by"  # an error is not asked for
    budget = f"max_steps reached: step {result.global_step}" if reason is StopReason.STEPS else "all epochs ran"
    why = f"{verb} {stop.source}: {stop.message}" if stop is not None else budget
    written = run.error if isinstance(run.error, FileWriteError) else None
    if written is not None and stop is not None:  # a run's file could not be written: say which, and where
        print(f"seed {run.seed}: {reason.name} in epoch {stop.epoch + 1}: {written.strerror}", file=out)
    else:
        print(f"seed {run.seed}: {reason.name} after {result.epochs_completed} epoch(s) ({why})", file=out)
    if result.history:
        best_at = f" (epoch {result.best_epoch + 1})" if result.best_epoch is not None else ""
        print(f"  best val_loss {result.best_val_loss:.6g}{best_at}, final val_loss {result.last_val_loss:.6g}",
              file=out)
    else:  # not "best inf, final nan": there is no loss at all
        print("  no epoch completed: no val_loss to report", file=out)
    last = result.history[-1].metrics if result.history else {}
    extra = {k: v for k, v in last.items() if k.startswith("val_") and k != "val_loss"}
    if extra:
        print("  final " + ", ".join(f"{k} {v:.6g}" for k, v in sorted(extra.items())), file=out)
    failed = getattr(run.error, "failure", None)  # another rank failed first (consensus.RankFailed)
    if failed is not None:
        print(f"  rank {failed.rank} failed: {failed.message} (in {failed.source}); every other rank stopped with it",
              file=out)
    print(f"  run dir: {run.run_dir}", file=out)
    resumption = run.trainer.resumption
    if resumption is not None and resumption.next_epoch >= result.epochs_completed and not stop:
        print(f"  nothing left to train: the run had finished its {resumption.next_epoch} epoch(s); "
              f"extend it with: fsmtrain resume {run.run_dir} --set epochs=N", file=out)
    late = isinstance(run.error, Interrupted) and reason is not StopReason.INTERRUPTED
    if late:  # it landed during the teardown, which finished first: the run keeps its reason and its files
        print(f"  {run.error}: it arrived during the teardown, after the run had ended {reason.name}; the run's "
              "files are written", file=out)
    elif isinstance(run.error, Interrupted) or reason is StopReason.INTERRUPTED:
        print(f"  continue it with: fsmtrain resume {run.run_dir}", file=out)
    elif written is not None and written.disk_full:
        print(f"  free space on that device, then continue it with: fsmtrain resume {run.run_dir}", file=out)
    if isinstance(run.error, Interrupted):
        return ExitCode(run.error.exit_code) if run.error.exit_code in set(ExitCode) else ExitCode.INTERRUPTED
    if failed is not None:  # the run failed on another rank: its status is that rank's
        return ExitCode.ERROR
    if run.error is not None and reason is not StopReason.ERROR and not isinstance(run.error, KeyboardInterrupt):
        # fit() raised after the run had reached train_end by another route: the run failed all the same
        print(f"  ERROR after train_end: {type(run.error).__name__}: {run.error}", file=out)
        return ExitCode.ERROR
    return exit_code_for(reason)


@dataclass(frozen=True)
class _Place:
    """Where this process trains, found once and handed down to every run: the process group (None:
    one process), the console (rank 0's) and what ``run_start`` records of the launch."""

    collective: Any
    out: TextIO
    extras: dict[str, Any]
    attempt: ElasticAttempt | None
    ranks: int
    lead: bool  # rank 0, or the only process


def _nodes(args: argparse.Namespace) -> Any:
    """The nodes of ``--nnodes N --node-rank R --rdzv HOST:PORT``; None on one node."""
    from fsmtrain.app.launch import Nodes
    count = getattr(args, "nnodes", 1)
    if count <= 1:
        return None
    if not args.rdzv or ":" not in args.rdzv:
        raise UsageError(f"--nnodes {count} needs --rdzv HOST:PORT, the rendezvous of node 0; found {args.rdzv!r}")
    if not 0 <= args.node_rank < count:
        raise UsageError(f"--node-rank: expected 0 to {count - 1} (--nnodes {count}); found {args.node_rank}")
    return Nodes(count, args.node_rank, args.rdzv, args.rdzv_id)


def _on_ranks(args: argparse.Namespace, cfg: RunConfig, nproc: int, body: Callable[[_Place], int]) -> int:
    """With ``nproc`` > 1 or several nodes, in a plain process: start the workers, and return their exit
    status; else ``body`` here (under torchrun: joined to the process group for it)."""
    from fsmtrain.app.launch import elastic_attempt, joined_ranks, launch_workers, without_launch_options, worker_place
    from fsmtrain.core.signals import installed, uninstall
    from fsmtrain.training.distributed import launched_by_torchrun
    nodes = _nodes(args)
    if (nproc > 1 or nodes is not None) and not launched_by_torchrun():
        caught = installed()
        uninstall()
        if caught is not None and caught.signum is not None:  # it came during start-up: start nothing
            return caught.exit_status(0)
        return launch_workers(nproc, without_launch_options(args.argv), nodes=nodes)
    with joined_ranks(cfg.distributed, cfg.device) as collective:
        attempt = elastic_attempt()
        extras: dict[str, Any] = dict(worker_place()) if collective is not None else {}
        if attempt is not None:
            extras["elastic"] = asdict(attempt)
        lead = collective is None or collective.rank == 0
        ranks = 1 if collective is None else int(collective.world_size)
        return body(_Place(collective, sys.stdout if lead else io.StringIO(), extras, attempt, ranks, lead))


def cmd_train(args: argparse.Namespace) -> int:
    from fsmtrain.core.signals import install
    install(owns_process=args.owns_process)  # a command that trains handles signals first thing
    cfg = load_config_of(args)  # checked once here, so a config mistake is one line, not one per rank
    return _on_ranks(args, cfg, args.nproc, partial(_train_seeds, args, cfg))


def _train_seeds(args: argparse.Namespace, cfg: RunConfig, place: _Place) -> int:
    from fsmtrain.app.defaults import console_callbacks
    from fsmtrain.app.job import Header, pick_run_dir, train_seed
    from fsmtrain.core.engine import Interrupted
    out, collective, extras = place.out, place.collective, place.extras
    if place.lead:
        print_warnings(cfg, sys.stderr)
    if cfg.optimize is not None and place.lead:  # train runs the config once, as written; the study is hpo's
        print(f"note: {args.config} has an optimize: section; train runs it once with the values as written; "
              f"`fsmtrain hpo {args.config}` runs the study", file=sys.stderr)
    run_name = cfg.name or Path(args.config).stem
    codes: list[ExitCode] = []
    objectives: list[float] = []
    root = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.project
    for seed in cfg.seeds:
        pick = partial(pick_run_dir, root, f"{run_name}-seed{seed}", bool(args.resume), place.attempt)
        target, resume, note = pick() if collective is None else collective.share(pick)
        notes = [n for n in (note, _global_batch_line(cfg, place.ranks)) if n is not None]
        header = Header(out, f"{cfg.project}/{run_name} seed {seed}", notes)
        seed_extras = extras if note is None else {**extras, "elastic": {**extras["elastic"], "note": note}}
        try:
            run = train_seed(cfg, seed, target, extra_callbacks=console_callbacks(), resume=resume,
                             extras=seed_extras, header=header)
        except Interrupted as exc:  # caught during this seed's start-up: honoured before its run began
            print(f"seed {seed}: {exc} before its run started; nothing was trained", file=out)
            codes.append(ExitCode(exc.exit_code))
            break
        codes.append(_describe_seed(run, out))
        if run.result is not None:
            objectives.append(run.result.objective)
        if isinstance(run.error, KeyboardInterrupt) or (collective is not None and run.error is not None):
            break  # the user asked to stop, or a rank failed (the others are not coming): no next seed
    if len(cfg.seeds) > 1 and objectives:
        mean = statistics.fmean(objectives) if all(map(math.isfinite, objectives)) else math.inf
        spread = f" ± {statistics.stdev(objectives):.6g}" if len(objectives) > 1 and math.isfinite(mean) else ""
        print(f"mean objective (best val_loss) over {len(objectives)} seeds: {mean:.6g}{spread}", file=out)
    return _exit_line(worst(codes), out)


def _global_batch_line(cfg: RunConfig, ranks: int) -> str | None:
    """``batch_size`` is per rank: with several ranks or accumulation, what one optimizer step sees."""
    if ranks == 1 and cfg.grad_accumulation == 1:
        return None
    from fsmtrain.app.global_batch import describe_global_batch
    steps = cfg.grad_accumulation
    said = describe_global_batch({"per_rank": cfg.batch_size, "ranks": ranks, "accumulation": steps,
                                  "global": cfg.batch_size * ranks * steps})
    return f"global batch {said}; batch_size is per rank"


def cmd_resume(args: argparse.Namespace) -> int:
    from fsmtrain.app.config import load_run_config
    from fsmtrain.app.launch import recorded_world_size
    from fsmtrain.core.signals import install
    from fsmtrain.training.resume import NeverStarted, RecordedStart, ResumeError, recorded_start
    install(owns_process=args.owns_process)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        found = "is a file" if run_dir.exists() else "does not exist"
        raise ResumeError(f"{run_dir} {found}: expected a run directory of fsmtrain train "
                          "(runs/<project>/<name>-seed<s>)")
    if not (run_dir / "config.yaml").is_file():
        raise ResumeError(f"{run_dir} holds no config.yaml: is it a run directory of fsmtrain train?")
    cfg = load_run_config(run_dir, overrides_of(args))  # with the folders the run's own modules came from
    try:
        recorded = recorded_start(run_dir)
    except NeverStarted:  # stopped before its run_start: it starts over in place (train_seed says so)
        recorded = RecordedStart(_seed_of_unstarted(cfg, run_dir), 1)
    before = recorded_world_size(run_dir)  # the newest segment's; a run may have changed size before
    # as many ranks as it had, unless --nproc says otherwise
    return _on_ranks(args, cfg, args.nproc or before, partial(_resume_seed, run_dir, cfg, recorded.seed, before))


def _resume_seed(run_dir: Path, cfg: RunConfig, seed: int, before: int, place: _Place) -> int:
    from fsmtrain.app.defaults import console_callbacks
    from fsmtrain.app.job import Header, train_seed
    ranks = place.ranks
    notes = [f"{cfg.epochs or 'unbounded'} epochs" + ("" if cfg.max_steps is None else f", max_steps {cfg.max_steps}")]
    if ranks != before:
        notes.append(f"on {ranks} process(es); it ran on {before}: it continues from its newest committed checkpoint "
                     "(one inside an epoch after as many of the epoch's examples), and from there its data order is "
                     f"that of a {ranks}-process run")
    header = Header(place.out, f"{cfg.project}/{run_dir.name} seed {seed}", notes)
    run = train_seed(cfg, seed, run_dir, extra_callbacks=console_callbacks(), resume=True, extras=place.extras,
                     header=header)
    return _exit_line(_describe_seed(run, place.out), place.out)


def _exit_line(code: ExitCode, out: TextIO) -> int:
    from fsmtrain.app.launch import elastic_restart_line

    print(elastic_restart_line(code) or f"exit code {int(code)} ({code.name})", file=out)
    return int(code)


def _seed_of_unstarted(cfg: RunConfig, run_dir: Path) -> int:
    """The seed of a run dir whose log never got its run_start: the config's only one, or its folder's."""
    from fsmtrain.training.resume import ResumeError
    if len(cfg.seeds) == 1:
        return cfg.seeds[0]
    m = re.search(r"-seed(-?\d+)(?:-\d+)?$", run_dir.name)
    if m is not None and int(m.group(1)) in cfg.seeds:
        return int(m.group(1))
    raise ResumeError(f"{run_dir}: its log never recorded the run's seed, and neither its config.yaml (seeds "
                      f"{cfg.seeds}) nor its folder name tells which one it ran; train it again with "
                      "`fsmtrain train CONFIG --resume`")


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                   help="the run spans N nodes; run the same command on each (like torchrun --nnodes)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this node's rank, 0 to N-1 (node 0 hosts the rendezvous store)")
    p.add_argument("--rdzv", metavar="HOST:PORT", help="the c10d rendezvous endpoint, on node 0 (with --nnodes)")
    p.add_argument("--rdzv-id", default="fsmtrain", metavar="ID", help="the job's id, the same on every node")


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsmtrain train`` and ``fsmtrain resume`` to the ``fsmtrain`` parser."""
    p = subparsers.add_parser("train", help="train every seed of a config")
    config_args(p)
    p.add_argument("--run-dir", help="parent folder of the per-seed run directories (default runs/<project>)")
    p.add_argument("--resume", action="store_true",
                   help="continue each seed's run where it stopped (runs/<project>/<name>-seed<s>), or start it")
    p.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                   help="train on N local processes (DDP: gloo on CPU, NCCL with one GPU each), like torchrun")
    _node_args(p)
    p.set_defaults(func=cmd_train)
    p = subparsers.add_parser("resume", help="continue a run in place from its newest committed checkpoint")
    p.add_argument("run_dir", help="the run directory (runs/<project>/<name>-seed<s>)")
    set_args(p, "change what a resume may change, e.g. --set epochs=40 to extend a finished run")
    p.add_argument("--nproc", type=positive_int, default=None, metavar="M",
                   help="continue on M processes per node (default: as many as the run's newest segment had); "
                        "another number continues from the newest committed checkpoint in that world's data order")
    _node_args(p)
    p.set_defaults(func=cmd_resume)
