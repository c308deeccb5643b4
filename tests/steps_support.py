"""Real kills at exact steps of real ``fsmtrain`` processes, for the tests of checkpoints at steps
and of resuming inside an epoch. ``KillAt`` (a callback every run of a test's config carries) sends
its own process SIGKILL when ``FSMTRAIN_TEST_KILL`` says so: ``step:N`` as batch N+1 begins (N steps
done), ``val:E`` as epoch index E's validation begins, ``slow:S`` sleeps S milliseconds per batch (an
epoch long enough for a signal to land inside it); without it, it does nothing. ``FSMTRAIN_TEST_HOLD``
(``N:FOLDER``) holds the run as batch N+1 begins until the test has sent its signal (:func:`preempted`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import forked_cli
import torch
import yaml

from fsmtrain.core.context import EpochContext, RunContext, StepContext
from fsmtrain.core.hooks import TrainingCallback

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
KILL_ENV = "FSMTRAIN_TEST_KILL"
PIDS_ENV = "FSMTRAIN_TEST_PIDS"
HOLD_ENV = "FSMTRAIN_TEST_HOLD"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


class KillAt(TrainingCallback):
    priority = 99  # after the checkpoint callback (95): a step's hooks have all run

    def __init__(self) -> None:
        what, _, at = os.environ.get(KILL_ENV, ":").partition(":")
        self.what, self.at = what, int(at) if at else -1
        step, _, folder = os.environ.get(HOLD_ENV, ":").partition(":")
        self.hold_at, self.hold = int(step) if step else -1, Path(folder)

    def on_train_begin(self, run: RunContext) -> None:
        pids = os.environ.get(PIDS_ENV)
        if pids:  # where a test finds each rank's process
            (Path(pids) / f"rank{run.extras.get('rank', 0)}").write_text(str(os.getpid()))

    def on_batch_begin(self, step: StepContext) -> None:
        if self.what == "step" and step.run.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.what == "slow":
            time.sleep(self.at / 1000)
        if step.run.global_step == self.hold_at:  # mid-epoch for sure: the signal lands here, whatever the load
            (self.hold / "held").touch()
            deadline = time.monotonic() + 120
            while not (self.hold / "sent").exists() and time.monotonic() < deadline:
                time.sleep(0.005)

    def on_val_begin(self, epoch: EpochContext) -> None:
        if self.what == "val" and epoch.index == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def write_config(folder: Path, **settings: Any) -> Path:
    """The quickstart, small and fast, with ``settings`` (dotted keys) and ``KillAt`` on."""
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg.update(epochs=3, wandb={"enabled": False}, early_stopping={"enabled": False},
               scheduler_config={"T_max": 3}, callbacks={"extra": [{"target": "steps_support.KillAt"}]})
    for key, value in settings.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fsmtrain(cwd: Path, *args: str, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1"}
    env.pop(KILL_ENV, None)
    if kill is not None:
        env[KILL_ENV] = kill
    return forked_cli.run(list(args), cwd, env, timeout=300)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def events(run_dir: Path, name: str = "events.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def kill_and_resume(folder: Path, config: Path, kill: str) -> tuple[Path, dict[str, Any] | None]:
    """Train ``config`` in ``folder`` until ``kill`` kills it (SIGKILL), then ``fsmtrain resume`` it to
    its end. Returns the run directory and the resume event (None: it started over)."""
    killed = fsmtrain(folder, "train", str(config), kill=kill)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    run_dir = folder / RUN
    resumed = fsmtrain(folder, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    found = [e["payload"] for e in events(run_dir) if e["event"] == "resume"]
    return run_dir, found[-1] if found else None


def plain_loaders(*, batch_size: int, seed: int) -> Any:
    """The quickstart's data, its train loader shuffled from the global RNG (no generator of its own)."""
    from torch.utils.data import DataLoader

    from fsmtrain.training.data import Loaders, synthetic_regression

    made = synthetic_regression(batch_size=batch_size, seed=seed)
    return Loaders(DataLoader(made.train.dataset, batch_size=batch_size, shuffle=True), made.val)


class Batches:
    """A train loader that is no DataLoader: it cannot start at a batch index."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.generator = loader, loader.generator

    def __iter__(self) -> Any:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def iterable_loaders(*, batch_size: int, seed: int) -> Any:
    from fsmtrain.training.data import Loaders, synthetic_regression

    made = synthetic_regression(batch_size=batch_size, seed=seed)
    return Loaders(Batches(made.train), made.val)  # type: ignore[arg-type]  # the point: no DataLoader


def preempted(folder: Path, config: Path, signum: int, at_step: int) -> tuple[forked_cli.ForkedProcess, float]:
    """Start ``fsmtrain train`` with 20 ms batches and send ``signum`` as it holds before batch
    ``at_step`` + 1 (a time after the start raced the epoch's end on a fast machine); returns the
    finished process and the seconds from the signal to its exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "CI": "1", "OMP_NUM_THREADS": "1", KILL_ENV: "slow:20",
           HOLD_ENV: f"{at_step}:{folder}"}
    proc = forked_cli.zygote(env).start(["train", str(config)], folder, env)  # see tests/forked_cli.py
    deadline = time.monotonic() + 120
    while not (folder / "held").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signum)
    (folder / "sent").touch()
    proc.wait(timeout=120)
    return proc, time.monotonic() - sent
