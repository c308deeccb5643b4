"""The checkpoint folder: the names of an epoch's files, and which of them the store keeps.

Files: ``epoch_<n>.pt`` (``n`` the epoch number, 1-based), ``best.pt`` and ``latest.pt`` (other names
of an epoch's file: hard links). Kept: the periodic files of the last ``keep_last_k`` periodic
epochs (``0`` keeps all), the newest epoch's own file, and always the newest older state besides
(:meth:`CheckpointFolder._redundant`). ``latest.pt``, ``best.pt`` and ``epoch_<n>.pt`` of one epoch
are one file under several names, so a single damaged file takes every name of its epoch with it;
the older state is what a resume falls back to. With ``keep_last_k=1`` that is two epoch files: the
disk holds at most one checkpoint more than ``keep_last_k`` says. Only files this run committed are
ever removed, never whatever else is in the folder.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from fsmtrain.core.context import epoch_number
from fsmtrain.core.ledger import CommittedFile

__all__ = ["KINDS", "CheckpointFolder"]

KINDS = ("periodic", "best", "latest")
_PERIODIC = re.compile(r"^epoch_(\d+)\.pt$")


class CheckpointFolder:
    """File names in ``directory``, and the books of what this run keeps there. The writer thread
    keeps the books (:meth:`committed`); the training thread reads them only when no write is pending."""

    def __init__(self, directory: str | Path, keep_last_k: int) -> None:
        self.directory = Path(directory)
        self.keep_last_k = keep_last_k
        # epochs whose periodic / non-periodic epoch file this run committed and still keeps, oldest
        # first, and the newest epoch committed
        self.periodic: list[int] = []
        self.transient: list[int] = []
        self.newest: int | None = None

    def name_for(self, kind: str, epoch: int) -> str:
        """The file name of ``kind`` (``periodic``, ``best``, ``latest``) for ``epoch``, in the folder."""
        if kind == "periodic":
            return f"epoch_{epoch_number(epoch)}.pt"
        if kind == "best":
            return "best.pt"
        if kind == "latest":
            return "latest.pt"
        raise ValueError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")

    def path_for(self, kind: str, epoch: int) -> Path:
        return self.directory / self.name_for(kind, epoch)

    def periodic_path(self, epoch: int) -> Path:
        return self.path_for("periodic", epoch)

    @property
    def best_path(self) -> Path:
        return self.path_for("best", 0)

    @property
    def latest_path(self) -> Path:
        return self.path_for("latest", 0)

    def list_periodic(self) -> list[Path]:
        """Periodic checkpoint files in the folder, oldest epoch first (by epoch number, not by name)."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _PERIODIC.match(p.name))]
        return [p for _, p in sorted(found)]

    # --- what is kept ------------------------------------------------------------------------------
    def committed(self, epoch: int, periodic: bool) -> None:
        """The log committed ``epoch``'s files: it is the newest state on disk."""
        self.newest = epoch
        for books in (self.periodic, self.transient):
            if epoch in books:
                books.remove(epoch)
        kept = self.periodic if periodic else self.transient
        kept.append(epoch)
        kept.sort()

    def _redundant(self, *, keep_newest: bool) -> tuple[Path, ...]:
        """Forget and return the epoch files no longer kept (see the class docstring);
        ``keep_newest`` spares the newest epoch's own file as well."""
        on_disk = sorted({*self.periodic, *self.transient})
        if not on_disk:
            return ()
        newest = self.newest if self.newest is not None else on_disk[-1]
        keep = set(self.periodic[-self.keep_last_k:] if self.keep_last_k else self.periodic)
        if keep_newest:
            keep.add(newest)
        older = [e for e in on_disk if e < newest]
        if older:
            keep.add(older[-1])  # the state a resume falls back to when the newest one is damaged
        self.periodic = [e for e in self.periodic if e in keep]
        self.transient = [e for e in self.transient if e in keep]
        return tuple(self.periodic_path(e) for e in on_disk if e not in keep)

    def adopt(self, committed: Mapping[str, CommittedFile], run_dir: Path | None) -> None:
        """A resumed run: what is on disk, from the files its log commits (not from the checkpoint,
        which cannot know of the writes that came after it was staged)."""
        self.periodic, self.transient, newest = [], [], None
        folder = self.directory.resolve()
        for shown, done in committed.items():
            path = Path(shown) if Path(shown).is_absolute() or run_dir is None else run_dir / shown
            m = _PERIODIC.match(path.name)
            if done.epoch is None:
                continue
            newest = done.epoch if newest is None else max(newest, done.epoch)
            if m is None or path.parent.resolve() != folder or not path.is_file():
                continue
            (self.periodic if done.kind == "periodic" else self.transient).append(done.epoch)
        self.periodic.sort()
        self.transient.sort()
        self.newest = newest
