"""Shared pieces of the HPO tests: a tiny quickstart study config, the CLI in-process and in a
subprocess, and a real PostgreSQL server in a temp folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forked_cli
import optuna
import yaml
from system_parts import POSTGRES, find_postgres_bin, missing_reason

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

# The quickstart, small: 3 epochs of 128 samples, no scheduler, no W&B.
TINY: dict[str, Any] = {
    "epochs": 3, "batch_size": 32, "scheduler": None, "wandb": {"enabled": False},
    "early_stopping": {"enabled": True, "patience": 2}, "checkpoint": {"enabled": True, "keep_last_k": 1},
}
LR_SPACE: dict[str, dict[str, Any]] = {"optimizer_config.lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}


def study_config(directory: Path, optimize: dict[str, Any], name: str = "study.yaml", **changes: Any) -> Path:
    """The quickstart with ``TINY`` and ``changes`` applied and the given ``optimize:`` section."""
    data = yaml.safe_load(QUICKSTART.read_text(encoding="utf-8"))
    data.update(TINY)
    data["data_config"] = {**data["data_config"], "n_samples": 128}
    data.update(changes)
    data["optimize"] = {"study_name": "s", "n_trials": 3, "search_space": LR_SPACE, **optimize}
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def fsmtrain(*args: str | Path, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return forked_cli.run(list(map(str, args)), cwd, env(), timeout)  # forked: see tests/forked_cli.py


def _default_sigint() -> None:
    # A child inherits an ignored SIGINT (e.g. from a shell's background job), and Python then
    # installs no KeyboardInterrupt handler: give the child the default, as a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(*args: str | Path, cwd: Path, log: Path, session: bool = False) -> subprocess.Popen[bytes]:
    """``fsmtrain`` in the background; ``session``: in a process group of its own, which a signal to
    the group (a terminal's Ctrl-C) reaches whole, and nothing of the test's."""
    fh = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen([sys.executable, "-m", "fsmtrain", *map(str, args)], cwd=cwd, env=env(),
                            stdout=fh, stderr=subprocess.STDOUT, preexec_fn=_default_sigint,
                            start_new_session=session)


def load(storage: str | optuna.storages.BaseStorage, study: str = "s") -> optuna.study.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name=study, storage=storage)


def journal(path: Path) -> optuna.storages.BaseStorage:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(path)))


# --- PostgreSQL --------------------------------------------------------------------------------
@dataclass
class Postgres:
    url: str
    port: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def postgres_server(root: Path) -> Iterator[Postgres]:
    """initdb into ``root``, start on a free local port (socket dir in ``root``), yield, stop.
    As root it runs as the ``postgres`` user (the server refuses to run as root). Raises
    ``RuntimeError`` naming what is missing when it cannot start."""
    bindir = find_postgres_bin()
    if bindir is None:
        raise RuntimeError(missing_reason(POSTGRES))
    run_as: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            raise RuntimeError("running as root and runuser is missing")
        run_as = ["runuser", "-u", "postgres", "--"]
        root.chmod(0o777)
        shutil.chown(root, "postgres")
    data, port = root / "data", _free_port()

    def call(*cmd: str) -> None:
        proc = subprocess.run([*run_as, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} failed: {(proc.stderr or proc.stdout).strip()[-500:]}")

    call(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "fsm", "-E", "UTF8", "--no-sync")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
    call(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "server.log"), "-w", "-t", "60",
         "start")
    try:
        call(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "fsm", "hpo")
        yield Postgres(f"postgresql://fsm@127.0.0.1:{port}/hpo", port)
    finally:
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)


def new_database(pg: Postgres, name: str) -> str:
    """A fresh database on the server: one per test, so studies never meet."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(pg.url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return pg.url.rsplit("/", 1)[0] + "/" + name


def wait_for(predicate: Any, timeout: float, what: str, logs: tuple[Path, ...] = ()) -> Any:
    """Poll ``predicate`` until it returns something true; on timeout fail with the ``logs``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    shown = "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}" for log in logs if log.exists())
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{shown}")
