"""Start a command on several local processes, as ``torchrun --standalone --nproc-per-node N`` would.

``fsmtrain train CONFIG --nproc N`` (and ``fsmtrain resume`` of a multi-process run) run torch's
elastic agent in this process; it starts N workers (``python -m pipeline <same command>``), each
with RANK, WORLD_SIZE, LOCAL_RANK and a free rendezvous port in its environment. The exit status
is the status of the first worker that failed (the ranks of one run end together, so they agree),
a signal that killed it as 128 + its number.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Sequence

__all__ = ["launch_workers", "without_nproc"]


def without_nproc(argv: Sequence[str]) -> list[str]:
    """The command line a worker runs: this one without ``--nproc N`` (or ``--nproc=N``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def launch_workers(nproc: int, argv: Sequence[str], *, monitor_interval: float = 0.1) -> int:
    """Run ``python -m pipeline *argv`` on ``nproc`` local ranks; the first failure's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=monitor_interval,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "pipeline", *argv)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        code = failure.exitcode
        return code if code > 0 else 128 - code  # killed by a signal: -15 is reported as 143
    except SignalException as exc:  # the launcher itself was signalled; its workers were told too
        return 128 + int(exc.sigval)
    return 0
