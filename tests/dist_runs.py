"""What the multi-process tests share: a tiny quickstart config, the ``fsmtrain`` and ``torchrun``
commands as subprocesses (real processes, real gloo), and readers of the logs they leave."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import forked_cli
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
# What a clean exit never prints: a rank's threads outliving its process group's shutdown.
TEARDOWN_FAULTS = ("terminate called", "threads still run after its shutdown")


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH", "")]))
    out.update(WANDB_MODE="offline", OMP_NUM_THREADS="1", WANDB_SILENT="true")
    out.pop("WANDB_SERVICE", None)
    out.update(extra)
    return out


def config(folder: Path, *, extra: Sequence[dict[str, Any]] = (), epochs: int = 4, name: str = "run.yaml",
           **changes: Any) -> Path:
    """The quickstart, small: 512 rows, ``epochs`` epochs, no W&B, the given extra callbacks."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg.update(epochs=epochs, wandb={"enabled": False})
    cfg["data_config"]["n_samples"] = 512
    cfg["scheduler_config"]["T_max"] = epochs
    cfg["callbacks"] = {"extra": list(extra)}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def fsmtrain(*args: str, cwd: Path, timeout: float = 150, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m fsmtrain ARGS``, forked from a zygote (tests/forked_cli.py; so are the workers its elastic
    agent starts); past ``timeout`` stopped as :func:`finish` stops a process."""
    return forked_cli.run(list(args), cwd, env(**extra_env), timeout, stop=signal.SIGTERM)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Wait for ``proc``; past ``timeout``, stop it with SIGTERM first (an elastic agent then ends the
    workers it started, each in a session of its own, which a SIGKILL of the agent would orphan),
    then SIGKILL, and raise the timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return out or "", err or ""


def torchrun_command(cwd: Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run ARGS``, its agent's files in ``cwd`` (torch's default is a temp folder it
    never removes, one a launch)."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(cwd / "torchrun-logs"), *args]


def torchrun(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m torch.distributed.run ARGS``, started (not waited for)."""
    return subprocess.Popen(torchrun_command(cwd, *args), cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_dir(folder: Path) -> Path:
    (found,) = {p.parent for p in (folder / "runs").rglob("events*.jsonl")}
    return found


def log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in log(path) if r["event"] == kind]


def weights(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return loaded


def same_weights(a: Path, b: Path) -> None:
    want, got = weights(a), weights(b)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs between {a} and {b}"


def clean(done: subprocess.CompletedProcess[str] | str) -> str:
    """The output of a command, asserted free of teardown faults."""
    out = done if isinstance(done, str) else done.stdout + done.stderr
    for fault in TEARDOWN_FAULTS:
        assert fault not in out, out[-4000:]
    return out
