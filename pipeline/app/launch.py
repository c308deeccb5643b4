"""Start a command on several processes as ``torchrun`` would (torch's elastic agent in this process,
the workers running ``python -m fsmtrain <same command>``), what a worker learns from the agent, and
how the ranks print: whole lines, each in one write, tagged ``[rank r]`` but on rank 0."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fsmtrain.core.events import EVENTS_FILE, first_run_start
from fsmtrain.core.ledger import read_ledger

if TYPE_CHECKING:
    from fsmtrain.app.config.schema import DistributedConfig
    from fsmtrain.training.distributed import TorchCollective

__all__ = [
    "ElasticAttempt", "Nodes", "elastic_attempt", "elastic_restart_line", "elastic_run_dir", "has_committed_checkpoint",
    "RankLines", "joined_ranks", "launch_workers", "recorded_world_size", "tag_rank_output", "worker_place",
    "without_launch_options",
]

_LAUNCH_OPTIONS = frozenset({"--nproc", "--nnodes", "--node-rank", "--rdzv", "--rdzv-id"})


def without_launch_options(argv: Sequence[str]) -> list[str]:
    """The command line a worker runs: this one without the launch options."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in _LAUNCH_OPTIONS:
            next(args, None)  # its value
        elif arg.partition("=")[0] not in _LAUNCH_OPTIONS:
            out.append(arg)
    return out


@dataclass(frozen=True)
class Nodes:
    """Several nodes meeting at a c10d rendezvous (``--nnodes``, ``--node-rank``, ``--rdzv``)."""

    count: int
    rank: int
    endpoint: str
    run_id: str = "fsmtrain"  # the same on every node (``--rdzv-id``)


def launch_workers(nproc: int, argv: Sequence[str], *, nodes: Nodes | None = None) -> int:
    """Run ``python -m fsmtrain *argv`` on ``nproc`` local ranks (of every node in ``nodes``); the
    first failure's exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    nodes = nodes or Nodes(1, 0, "localhost:0", uuid.uuid4().hex)  # one node: a store on a free local port
    # The agent's folder for the workers' error files: torch's default is a temp folder it never removes, one a
    # launch; the run's own log holds what a worker raised.
    with tempfile.TemporaryDirectory(prefix="fsmtrain-launch-") as agent_files:
        config = LaunchConfig(
            min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=nproc, run_id=nodes.run_id,
            rdzv_backend="c10d", rdzv_endpoint=nodes.endpoint, rdzv_configs={"is_host": nodes.rank == 0},
            max_restarts=0, monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=agent_files),
        )
        try:
            elastic_launch(config, entrypoint=sys.executable)("-m", "fsmtrain", *argv)
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            code = failure.exitcode
            return code if code > 0 else 128 - code  # killed by a signal: -15 is reported as 143
        except SignalException as exc:  # the launcher itself was signalled; its workers were told too
            return 128 + int(exc.sigval)
    return 0


def worker_place() -> dict[str, int]:
    """This worker's node and local rank, from the agent's environment; empty outside an agent."""
    return {key: int(os.environ[env]) for key, env in (("node", "GROUP_RANK"), ("local_rank", "LOCAL_RANK"))
            if os.environ.get(env, "").isdigit()}


@dataclass(frozen=True)
class ElasticAttempt:
    """Which start of the workers this is, under an elastic agent (``torchrun --max-restarts``)."""

    run_id: str
    restart: int  # 0: the first start; n: the n-th restart after a failure
    max_restarts: int


def elastic_attempt() -> ElasticAttempt | None:
    """This worker's attempt, from the agent's environment; None outside an agent."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if run_id is None or not restart.isdigit():
        return None
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return ElasticAttempt(run_id, int(restart), int(most) if most.isdigit() else 0)


def elastic_restart_line(code: int) -> str | None:
    """For a rank whose elastic attempt failed with ``code``, while restarts are left: the line to print
    instead of the exit line. The agent's SIGTERM that follows is marked as expected."""
    attempt = elastic_attempt()
    if attempt is None or not 0 < code < 128:
        return None
    from fsmtrain.core.signals import installed
    latch = installed()
    if attempt.restart >= attempt.max_restarts:
        if latch is not None:
            latch.expected = "the agent ending every rank of the failed attempt, after this rank's exit line"
        return None
    nth = f"restart {attempt.restart + 1} of {attempt.max_restarts}"
    if latch is not None:
        latch.expected = f"the elastic agent stopping this attempt's ranks for its {nth}"
    return (f"this attempt ended with status {code}; the elastic agent restarts every rank ({nth}) and the run "
            f"goes on in the next attempt")


def has_committed_checkpoint(run_dir: Path) -> bool:
    """Whether the run's log committed a checkpoint (a resume can continue it)."""
    log = run_dir / EVENTS_FILE
    return log.is_file() and bool(read_ledger(log).last)


def elastic_run_dir(root: Path, name: str, attempt: ElasticAttempt) -> Path | None:
    """The run directory an earlier attempt of this elastic run claimed under ``root``, or None."""
    def claimed(path: Path) -> bool:
        log = path / EVENTS_FILE
        elastic = (first_run_start(log) or {}).get("elastic") if log.is_file() else None
        return isinstance(elastic, dict) and elastic.get("run_id") == attempt.run_id
    candidates = [root / name, *sorted(root.glob(f"{name}-*"))] if root.is_dir() else []
    return next((path for path in reversed(candidates) if claimed(path)), None)


def recorded_world_size(run_dir: Path) -> int:
    """How many ranks the newest segment of the run in ``run_dir`` ran on (1 when its log names none)."""
    world = 1
    with open(run_dir / EVENTS_FILE, "rb") as fh:
        for line in fh:
            try:
                rec = json.loads(line) if b'"run_start"' in line else None
            except ValueError:  # unreadable: the audit reports it
                continue
            if isinstance(rec, dict) and rec.get("event") == "run_start" and isinstance(rec.get("payload"), dict):
                value = rec["payload"].get("world_size", 1)
                world = value if type(value) is int and value > 0 else 1
    return world


@contextlib.contextmanager
def joined_ranks(section: DistributedConfig, device: str) -> Iterator[TorchCollective | None]:
    """Under an agent: the process group, joined for the block (the rank's output tagged) and ended after
    it with its threads; None in one process."""
    from fsmtrain.training.distributed import DistributedOptions, init_from_env, launched_by_torchrun, shutdown
    if not launched_by_torchrun():
        yield None
        return
    import torch
    tag_rank_output(int(os.environ.get("RANK", "0")))
    collective = init_from_env(DistributedOptions(section.backend, section.timeout_s, section.agreement_timeout_s),
                               torch.device(device))
    try:
        yield collective
    finally:  # after the run's objects are gone (they hold the group)
        left = shutdown()
        if left:  # the interpreter's exit would join them half torn down (a crash after a good run)
            print(f"warning: rank {collective.rank}: the process group's threads still run after its shutdown: "
                  f"{', '.join(left)}", file=sys.stderr)


class RankLines(io.TextIOBase):
    """A text stream that passes on whole lines only, each in one write, prefixed with ``prefix``."""

    def __init__(self, target: TextIO, prefix: str) -> None:
        super().__init__()
        self.target, self.prefix = target, prefix
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            self.target.write("".join(f"{self.prefix}{line}\n" for line in done.split("\n")))
            self.target.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:  # a line without its end yet: passed on whole, so it is not lost
            self.target.write(f"{self.prefix}{self._pending}")
            self._pending = ""
        self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()

    def isatty(self) -> bool:
        return bool(getattr(self.target, "isatty", lambda: False)())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")


def tag_rank_output(rank: int) -> None:
    """This process is rank ``rank``: its stdout writes whole lines, tagged unless rank 0. Rank 0 on a
    terminal keeps its (line-buffered) stream, where its progress bar redraws a line in place."""
    if isinstance(sys.stdout, RankLines) or (rank == 0 and sys.stdout.isatty()):
        return
    sys.stdout = RankLines(sys.stdout, "" if rank == 0 else f"[rank {rank}] ")
