"""What the ranks of a multi-process ``Trainer`` settle before they train: rank 0 claims the run directory
and marks its lock with the launch's token; a rank that sees the mark shares the folder, else logs on its own
node. On resume rank 0 chooses the checkpoint and sends its state to the ranks that cannot read it."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsmtrain.app.launch import recorded_world_size
from fsmtrain.app.rundir import LOCK_FILE, RunDirClaim
from fsmtrain.callbacks.gradient_accumulation import GradientAccumulationCallback
from fsmtrain.core.consensus import log_name_for_rank
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.training.distributed import TorchCollective
from fsmtrain.training.resume import (
    Restart,
    Resumption,
    find_resumption,
    prepare_restart,
    rank_log_tail,
    resumption_or_restart,
)

__all__ = ["Settled", "global_batch", "settle_claim", "share_resumption"]


@dataclass(frozen=True)
class Settled:
    """What the ranks agreed on at the claim, and whether this rank reads rank 0's run directory."""

    path: Path | None
    launch: str
    layout: str | None
    reads_rank_zero_dir: bool

    def record(self) -> dict[str, Any]:
        """What ``run_start`` records of it."""
        return {"launch": self.launch, **({} if self.layout is None else {"layout": self.layout})}


def _holds_token(path: Path, token: str) -> bool:
    try:
        return token in (path / LOCK_FILE).read_text(encoding="utf-8", errors="replace").split()
    except OSError:
        return False


def settle_claim(collective: TorchCollective, claim: Callable[[], RunDirClaim | None], token: str) -> Settled:
    """Rank 0 claims and marks its claim with ``token``; every rank looks for the mark: the layout."""

    def decide() -> tuple[Path | None, str]:
        made = claim()
        if made is None:
            return None, token
        if made.fd is not None:
            os.write(made.fd, f"{token}\n".encode())  # after the pid: the mark the other ranks look for
        return made.path, token
    path, launch = collective.share(decide)
    if path is None:
        return Settled(None, launch, None, True)
    sees = collective.rank == 0 or _holds_token(path, launch)
    if not sees:
        path.mkdir(parents=True, exist_ok=True)  # this node's own folder of the run, for this rank's log
    seen = [row[0] for row in collective.all_gather_ints([int(sees)])]
    return Settled(path, launch, "shared" if all(seen) else "node-local", sees)


def share_resumption(collective: TorchCollective | None, run_dir: Path, which: str | Path,
                     settled: Settled | None) -> Resumption | Restart:
    """The checkpoint to continue from, or a restart in place when the log committed none. With several
    ranks rank 0 chooses; the others read it from the shared run directory or are sent it by rank 0."""
    if collective is None or settled is None:
        alone = resumption_or_restart(run_dir, which)
        if isinstance(alone, Resumption):
            alone.notes.update(world_size_before=recorded_world_size(run_dir), world_size=1)
        return alone
    found: list[Resumption | Restart] = []

    def choose() -> tuple[str, int]:
        found.append(resumption_or_restart(run_dir, which))
        chosen = found[0]
        return ("" if isinstance(chosen, Restart) else str(chosen.path)), recorded_world_size(run_dir)
    chosen, before = collective.share(choose)
    own, mine = log_name_for_rank(collective.rank), found[0] if found else None  # mine: rank 0's
    if chosen == "":  # nothing committed: every rank starts over
        return mine or prepare_restart(run_dir, own_log=own)
    assert not isinstance(mine, Restart)
    need = [row[0] for row in collective.all_gather_ints([int(not settled.reads_rank_zero_dir)])]
    sent = None
    if any(need):  # node-local disks: rank 0 sends the state to the ranks that cannot read it
        sent = collective.broadcast_object(None if mine is None else (mine.shown, mine.sha256, mine.state), 0)
    if mine is not None:
        resumption = mine
    elif settled.reads_rank_zero_dir:
        resumption = find_resumption(run_dir, chosen, own_log=own)
    else:
        assert sent is not None  # rank 0 found the checkpoint, or share() raised its error on every rank
        shown, sha256, state = sent
        resumption = Resumption(run_dir, run_dir / shown, shown, sha256, state, rank_log_tail(run_dir, own))
    resumption.notes.update(world_size_before=before, world_size=collective.world_size)
    return resumption


def global_batch(loader: Any, ranks: int, callbacks: Sequence[TrainingCallback]) -> dict[str, int] | None:
    """The batch of one optimizer step (per rank x ranks x accumulation); None without a fixed batch size."""
    per_rank = getattr(loader, "batch_size", None)
    if type(per_rank) is not int:
        return None
    steps = max((cb.steps for cb in callbacks if isinstance(cb, GradientAccumulationCallback)), default=1)
    return {"per_rank": per_rank, "ranks": ranks, "accumulation": steps, "global": per_rank * ranks * steps}
