"""A user callback that fills the file system its run is on (tests/test_disk_full.py): named in a
config's ``callbacks.extra``, found through PYTHONPATH."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from fsmtrain import TrainingCallback
from fsmtrain.core.context import EpochContext


def fill(path: Path) -> int:
    """Write ``path`` until the file system refuses another byte; returns the bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 8, 1):
            with contextlib.suppress(OSError):
                while True:
                    written += os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return written


class FillDisk(TrainingCallback):
    """When epoch ``at_epoch`` (0-based) begins, fills the disk through ``path``, once: ``marker`` (a
    file elsewhere) records that it did, so the run resumed after the space is freed goes on.
    ``leave``: bytes left free (the filler cut back by that much), room for the log's next lines
    but not for a checkpoint file."""

    def __init__(self, path: str, marker: str, at_epoch: int = 2, leave: int = 0) -> None:
        self.path, self.marker, self.at_epoch, self.leave = Path(path), Path(marker), at_epoch, leave

    def on_train_epoch_begin(self, epoch: EpochContext) -> None:
        if epoch.index == self.at_epoch and not self.marker.exists():
            written = fill(self.path)
            os.truncate(self.path, max(0, written - self.leave))
            self.marker.write_text(str(written))
            # The log learns of a full disk when it next needs a block (4 KB): with nothing left,
            # this line is longer than one, so it is the line that finds the disk full, here.
            epoch.emit("disk_filled", path=str(self.path), bytes=written, left=self.leave,
                       padding="" if self.leave else "." * 5000)
