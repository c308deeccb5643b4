"""``fsmtrain predict`` and ``fsmtrain evaluate``: a run's model, rebuilt from its ``config.yaml`` with
a checkpoint its log committed, over its val data or any builder's. Under torchrun rank 0 writes."""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsmtrain.app.arg_types import overrides_of, set_args
from fsmtrain.app.run_commands import ExitCode, UsageError

if TYPE_CHECKING:
    from fsmtrain.app.trainer import Trainer

__all__ = ["cmd_evaluate", "cmd_predict", "register_cli"]

# What predict and evaluate may change of the run's config: the data and where it runs, not the model.
_MAY_SET = ("data", "data_config", "batch_size", "device", "num_threads")

# A command's work: the Trainer, where the output came from, and whether this process prints and writes.
Work = Callable[["Trainer", dict[str, str], bool], None]


def _said(about: dict[str, str]) -> str:
    return f"{about['run_dir']} (checkpoint {about['checkpoint']}) on the val data of {about['data']}"


def _overrides(args: argparse.Namespace) -> list[str]:
    for item in args.set:
        if item.split("=", 1)[0].split(".", 1)[0] not in _MAY_SET:
            raise UsageError(f"--set {item}: {args.command} may change only {', '.join(_MAY_SET)}; the model and "
                             "its training are the run's")
    data = [f"data={args.data}", "data_config={}"] if args.data else []  # the run's arguments were its builder's
    return [*data, *overrides_of(args)]


def _checkpoint(run_dir: Path, which: str) -> tuple[Path, str, str]:
    """The committed checkpoint ``which`` names (best falls back to latest): path, name in the log, sha256."""
    import os

    from fsmtrain.core.events import EVENTS_FILE
    from fsmtrain.core.ledger import committed_checkpoints
    live = committed_checkpoints(run_dir / EVENTS_FILE)
    kinds = {c.kind: c for c in live.values() if c.kind in ("best", "latest")}
    if which == "best" and "best" not in kinds and "latest" in kinds:
        print(f"note: {run_dir} committed no best checkpoint (checkpoint.save_best off): using the latest",
              file=sys.stderr)
        which = "latest"
    found = kinds.get(which) if which in ("best", "latest") else next(
        (c for s, c in live.items() if which == s or os.path.abspath(run_dir / s) == os.path.abspath(which)), None)
    if found is None:
        have = ", ".join(sorted(live)) or "none (was checkpoint.enabled false?)"
        raise UsageError(f"--checkpoint {which}: expected best, latest or a checkpoint file the log of {run_dir} "
                         f"committed; it committed: {have}")
    return run_dir / found.path, found.path, found.sha256


def _on_ranks(args: argparse.Namespace, work: Work) -> int:
    """``work`` on the run's model with the chosen checkpoint's weights, in a Trainer over the data."""
    from fsmtrain.app.config import load_run_config
    from fsmtrain.app.job import CONFIG_FILE, build_parts
    from fsmtrain.app.launch import joined_ranks
    from fsmtrain.app.trainer import Trainer
    from fsmtrain.core.events import EVENTS_FILE
    from fsmtrain.training.checkpoint_file import CheckpointError, load_checkpoint
    from fsmtrain.training.resume import recorded_start
    run_dir = Path(args.run_dir)
    for need in (CONFIG_FILE, EVENTS_FILE):
        if not (run_dir / need).is_file():
            found = "does not exist" if not run_dir.exists() else "is not a directory" if not run_dir.is_dir() else \
                f"holds no {need}"
            raise UsageError(f"{run_dir} {found}: expected the run directory of an fsmtrain run "
                             "(runs/<project>/<name>-seed<s>)")
    for option in ("--out", "--json"):
        target = Path(getattr(args, option[2:], None) or ".")
        if not target.parent.is_dir():
            raise UsageError(f"{option} {target}: the folder {target.parent} does not exist")
    path, shown, sha = _checkpoint(run_dir, args.checkpoint)
    cfg = load_run_config(run_dir, _overrides(args))  # with the folders the run's own modules came from
    try:
        state = load_checkpoint(path, expected_sha256=sha)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint {args.checkpoint}: {exc}") from None
    about = {"run_dir": str(run_dir), "checkpoint": shown, "checkpoint_sha256": sha, "data": cfg.data}
    with joined_ranks(cfg.distributed, cfg.device) as collective:
        parts = build_parts(cfg, recorded_start(run_dir).seed)  # the run's seed: a builder's own split is the run's
        parts.model.load_state_dict(state["model"])
        trainer = Trainer(parts.model, parts.optimizer, parts.criterion, parts.train_loader, parts.val_loader,
                          metrics=parts.metrics, device=cfg.device, precision=cfg.precision, collective=collective,
                          default_callbacks=False, step=parts.steps[0], val_step=parts.steps[1])
        try:
            work(trainer, about, collective is None or collective.rank == 0)
        finally:
            trainer.close()
    return int(ExitCode.OK)


def _write(option: str, path: str, data: bytes) -> None:
    from fsmtrain.training.checkpoint_file import atomic_write_bytes
    try:
        atomic_write_bytes(Path(path), data)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write it: {exc.strerror or exc}") from None


def cmd_predict(args: argparse.Namespace) -> int:
    def work(trainer: Trainer, about: dict[str, str], lead: bool) -> None:
        import torch
        outputs = trainer.predict()
        if lead:
            buffer = io.BytesIO()
            torch.save({"predictions": outputs, **about}, buffer)
            _write("--out", args.out, buffer.getvalue())
            rows = len(outputs) if isinstance(outputs, torch.Tensor) else "the"
            print(f"wrote {rows} predictions of {_said(about)} to {args.out}")
    return _on_ranks(args, work)


def cmd_evaluate(args: argparse.Namespace) -> int:
    def work(trainer: Trainer, about: dict[str, str], lead: bool) -> None:
        from fsmtrain.training.inference import run_over
        metrics = run_over(trainer.driver, trainer.run, trainer.collective, keep=False).metrics
        dataset = getattr(trainer.driver.val_loader, "dataset", None)
        examples = len(dataset) if isinstance(dataset, Sized) else None
        if lead:
            print(_said(about) + (f", {examples} examples" if examples is not None else "") + ":")
            print("\n".join(f"  {name} {value:.6g}" for name, value in metrics.items()))
            if args.json:
                record = {**about, "examples": examples, "metrics": metrics}
                _write("--json", args.json, (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    return _on_ranks(args, work)


def register_cli(subparsers: argparse._SubParsersAction[Any]) -> None:
    for name, func, what in (("predict", cmd_predict, "write a run's predictions, one row per example in order"),
                             ("evaluate", cmd_evaluate, "compute a run's loss and metrics on its val data or any")):
        p = subparsers.add_parser(name, help=what)
        p.add_argument("run_dir", help="the run directory (runs/<project>/<name>-seed<s>)")
        p.add_argument("--data", metavar="BUILDER", help="another data builder's val data (dotted path; its arguments "
                                                         "with --set data_config.K=V)")
        p.add_argument("--checkpoint", default="best", metavar="best|latest|FILE",
                       help="a checkpoint the run's log committed (default best; latest if it saved no best)")
        set_args(p, f"change {', '.join(_MAY_SET)}")
        if name == "predict":
            p.add_argument("--out", required=True, metavar="FILE", help="where to write them (torch.save)")
        else:
            p.add_argument("--json", metavar="FILE", help="also write the values as JSON")
        p.set_defaults(func=func)
