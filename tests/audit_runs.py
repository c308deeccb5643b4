"""Real runs for the audit and diagram tests: each trains a tiny model with the real ``Trainer`` and
real built-in callbacks, and leaves a run directory with its ``events.jsonl`` (and checkpoints).

``make_real_runs(root)`` builds all of them once; ``tests/conftest.py`` exposes it as the
session-scoped ``real_runs`` fixture. The interrupted run is a real SIGINT sent to a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsmtrain.app.trainer import Trainer
from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback, NaNDetectionCallback, PrunerCallback
from fsmtrain.core.chain import KEY_ENV, Chain
from fsmtrain.core.context import EpochContext
from fsmtrain.core.hooks import TrainingCallback

REPO = Path(__file__).resolve().parents[1]


def _loaders(seed: int = 0) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(80, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(80, 1, generator=g)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16)
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16)
    return train, val


def _trainer(run_dir: Path, callbacks: list[TrainingCallback], *, epochs: int, lr: float = 0.05,
             log_level: str = "info", resume_from: str | None = None, log_key: bytes | None = None) -> Trainer:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    train, val = _loaders()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=callbacks,
                   run_dir=run_dir, run_id=run_dir.name, console_level="error", log_level=log_level,
                   resume_from=resume_from, log_key=log_key, default_callbacks=False)


class _RaiseAt(TrainingCallback):
    """Raises ``exc`` in ``on_val_end`` of epoch ``at`` (a callback that fails, or a Ctrl-C)."""

    def __init__(self, at: int, exc: BaseException) -> None:
        self.at = at
        self.exc = exc

    def on_val_end(self, epoch: EpochContext) -> None:
        if epoch.index == self.at:
            raise self.exc


class _WarnAt(TrainingCallback):
    """Logs a warning at the end of epoch ``at`` (a callback that has something to say)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_epoch_end(self, epoch: EpochContext) -> None:
        if epoch.index == self.at:
            epoch.warn(type(self).__name__, "a warning a person should see")


@dataclass(frozen=True)
class RealRuns:
    root: Path
    completed: Path
    early_stopped: Path
    nan: Path
    pruned: Path
    errored: Path
    interrupted_callback: Path
    interrupted_sigint: Path
    debug: Path
    steady: Path
    steady_debug: Path

    def events(self, name: str) -> Path:
        path: Path = getattr(self, name) / "events.jsonl"
        return path


_SIGINT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from audit_runs import _trainer
    from fsmtrain.callbacks import CheckpointCallback
    from fsmtrain.core.hooks import TrainingCallback

    class Slow(TrainingCallback):
        def on_epoch_end(self, epoch):
            time.sleep(0.02)

    run_dir = Path(sys.argv[1])
    trainer = _trainer(run_dir, [CheckpointCallback(run_dir / "checkpoints", keep_last_k=2), Slow()], epochs=100000)
    trainer.fit()
""")


def _sigint_run(run_dir: Path) -> None:
    """Train in a subprocess and interrupt it with a real SIGINT once two epochs are logged."""
    script = run_dir.parent / "sigint_train.py"
    script.write_text(_SIGINT_SCRIPT.format(tests=str(Path(__file__).resolve().parent)), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if events.exists() and events.read_text(encoding="utf-8").count('"event":"epoch"') >= 2:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"training subprocess ended early: {proc.communicate()[1].decode()[-2000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if b"Interrupted: signal SIGINT received" not in err:  # the run ended at a boundary, by its guard
        raise RuntimeError(f"expected the run to end Interrupted by SIGINT, got: {err.decode()[-2000:]}")


def make_real_runs(root: Path) -> RealRuns:
    root.mkdir(parents=True, exist_ok=True)
    runs = RealRuns(root, *(root / n for n in (
        "completed", "early_stopped", "nan", "pruned", "errored", "interrupted_callback", "interrupted_sigint",
        "debug", "steady", "steady_debug")))

    # 4 epochs, periodic checkpoints with keep_last_k=2: two are removed again. Written in the
    # epoch, not behind it: a busy machine's writer thread rightly drops states that wait behind a
    # slow write (checkpoint_skipped), and then fewer than three periodic files exist to remove.
    d = runs.completed
    _trainer(d, [NaNDetectionCallback(), CheckpointCallback(d / "checkpoints", keep_last_k=2, background=False)],
             epochs=4).fit()

    d = runs.early_stopped  # lr 0: val loss never improves after epoch 0, patience 2 stops in epoch 2
    _trainer(d, [NaNDetectionCallback(), EarlyStoppingCallback(patience=2),
                 CheckpointCallback(d / "checkpoints")], epochs=20, lr=0.0).fit()

    d = runs.nan  # a huge learning rate drives the weights, then the loss, to inf/NaN
    _trainer(d, [NaNDetectionCallback(), CheckpointCallback(d / "checkpoints")], epochs=30, lr=1e6).fit()

    d = runs.pruned  # a real study on SQLite whose pruner prunes any value above 1e-9
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{d.parent / 'pruned-study.db'}", study_name="audit",
                                pruner=optuna.pruners.ThresholdPruner(upper=1e-9))
    trial = study.ask()
    result = _trainer(d, [NaNDetectionCallback(), PrunerCallback(trial)], epochs=10).fit()
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    assert result.stop_reason.value == "pruned"

    d = runs.errored
    try:
        _trainer(d, [NaNDetectionCallback(), _RaiseAt(1, RuntimeError("disk full"))], epochs=5).fit()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the errored run did not raise")

    d = runs.interrupted_callback
    try:
        _trainer(d, [NaNDetectionCallback(), _RaiseAt(1, KeyboardInterrupt())], epochs=5).fit()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupted run did not raise")

    _sigint_run(runs.interrupted_sigint)

    d = runs.debug  # debug level: every per-batch internal move is logged too
    _trainer(d, [NaNDetectionCallback()], epochs=3, log_level="debug").fit()

    d = runs.steady  # info level, no checkpoints: after the first epochs, each epoch's lines repeat the last's words
    _trainer(d, [NaNDetectionCallback(), EarlyStoppingCallback(patience=100)], epochs=12).fit()

    d = runs.steady_debug  # the same at debug level: each epoch's lines are its moves, 3 per-batch ones among them
    _trainer(d, [NaNDetectionCallback(), EarlyStoppingCallback(patience=100)], epochs=12, log_level="debug").fit()
    return runs


KEYED_RUN_KEY = b"keyed-run-log-key"


def make_keyed_run(root: Path) -> Path:
    """A small keyed run of two segments, with as many kinds of event as a tiny run can have: run
    1 checkpoints (``keep_last_k=1``: files removed again), warns, and is interrupted in epoch 3 by a
    KeyboardInterrupt (exception, result INTERRUPTED); run 2 resumes from its latest checkpoint,
    appending after that result, and stops early (stop request, result EARLY_STOP). Its run dir."""
    run = root / "keyed"
    root.mkdir(parents=True, exist_ok=True)
    ckpt = run / "checkpoints"
    try:
        _trainer(run, [NaNDetectionCallback(), CheckpointCallback(ckpt, keep_last_k=1), _WarnAt(1),
                       _RaiseAt(2, KeyboardInterrupt())], epochs=8, log_key=KEYED_RUN_KEY).fit()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the first segment of the keyed run was not interrupted")
    # min_delta 10: no epoch improves by 1000%, so patience 1 stops the resumed run one epoch in
    result = _trainer(run, [NaNDetectionCallback(), EarlyStoppingCallback(patience=1, min_delta=10.0),
                            CheckpointCallback(ckpt, keep_last_k=1), _WarnAt(3)], epochs=8,
                      resume_from="latest", log_key=KEYED_RUN_KEY).fit()
    assert result.stop_reason.value == "early_stop", result.stop_reason
    return run


QUICKSTART_KEY = b"quickstart-log-key"
# The quickstart, shortened and stopped early so the log has a stop request, non-best epochs,
# checkpoints and removed periodic files: 4 epochs, then EARLY_STOP. W&B off (time only).
_QUICKSTART_SETTINGS = ("epochs=10", "early_stopping.patience=3", "early_stopping.min_delta=0.3",
                        "wandb.enabled=false")


@dataclass(frozen=True)
class QuickstartRuns:
    plain: Path  # a run directory written without a key
    keyed: Path  # the same run written with FSMTRAIN_LOG_KEY=QUICKSTART_KEY

    def events(self, keyed: bool = False) -> Path:
        return (self.keyed if keyed else self.plain) / "events.jsonl"


def make_quickstart_runs(root: Path) -> QuickstartRuns:
    """Two real ``fsmtrain train configs/quickstart.yaml`` runs (in this process, through the CLI)."""
    from fsmtrain.cli import main as cli_main

    dirs = []
    for keyed in (False, True):
        parent = root / ("keyed" if keyed else "plain")
        before = os.environ.pop(KEY_ENV, None)
        if keyed:
            os.environ[KEY_ENV] = QUICKSTART_KEY.decode()
        try:
            args = ["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(parent)]
            for setting in _QUICKSTART_SETTINGS:
                args += ["--set", setting]
            if cli_main(args) != 0:
                raise RuntimeError("the quickstart run failed")
        finally:
            os.environ.pop(KEY_ENV, None)
            if before is not None:
                os.environ[KEY_ENV] = before
        (run_dir,) = [d for d in parent.iterdir() if (d / "events.jsonl").is_file()]
        dirs.append(run_dir)
    return QuickstartRuns(*dirs)


def rechain(lines: list[str], key: bytes | None = None, *, describe: bool = False,
            old_key: bytes | None = None, sealed: bool = True) -> list[str]:
    """The log with every ``prev`` recomputed, as someone with write access to the file can do:
    plain sha256 (or HMAC with ``key``), and each checkpoint event's ``chain_head`` moved to the
    new digest of the line it pinned. That line is found by its digest under ``old_key`` (default
    ``key``) wherever it now sits, or, when the forgery changed it (a new ``seq``), as the line the
    old ``prev`` of its successor names. Lines are re-encoded and sealed the way ``EventLog`` writes
    them. ``describe``: also make each ``run_start`` name the new scheme (as if written with ``key``).
    ``sealed=False``: the lines without seals, chained as fsmtrain wrote logs before lines were sealed."""
    chain, old_chain = Chain(key), Chain(key if old_key is None else old_key)
    by_content: dict[str, str] = {}
    by_successor: dict[Any, str] = {}
    prev: str | None = None
    out = []
    for line in lines:
        rec = json.loads(line)
        if prev is None:
            prev = chain.genesis(rec["run_id"], rec["payload"].get("config"))
        by_successor[rec.get("prev")] = prev
        rec["prev"] = prev
        if describe and rec["event"] == "run_start":
            rec["payload"]["chain"] = chain.describe()
        head = rec["payload"].get("chain_head") if rec["event"] == "checkpoint" else None
        if head is not None:
            rec["payload"]["chain_head"] = by_content.get(head, by_successor.get(head, head))
        rec.pop("seal", None)
        body = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode("utf-8")
        text, prev = (chain.seal(body)[::2] if sealed else (body + b"\n", chain.digest(body + b"\n")))
        out.append(text.decode("utf-8"))
        by_content[old_chain.digest(line.encode("utf-8"))] = prev
    return out


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def line_of(lines: list[str], pred: Any) -> int:
    """1-based number of the first line whose parsed record satisfies ``pred``."""
    for i, line in enumerate(lines, 1):
        if pred(json.loads(line)):
            return i
    raise LookupError("no such line")
