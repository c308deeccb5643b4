"""The path one run took, counted from its log: how often each move was taken, and how it ended."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsmtrain.core.lifecycle import FINAL, Phase
from fsmtrain.core.log_file import parse_line, read_lines

__all__ = ["DiagramError", "PathCounter", "RunPath", "read_run_path"]

_TRAIN_STEP, _EPOCH_END, _FINAL = Phase.TRAIN_STEP.value, Phase.EPOCH_END.value, FINAL.value  # once a line


class DiagramError(ValueError):
    """Bad input to a diagram (an unreadable run log, a conflicting option)."""


@dataclass
class RunPath:
    """The moves one run took, counted, and how it ended."""

    counts: Counter[tuple[str, str, str]]
    final: tuple[str, str, str] | None = None
    reason: str | None = None
    stop_epoch: int | None = None
    epochs_done: int = 0
    last_phase: str | None = None
    world_size: int = 1  # ranks of a multi-process run (the path is drawn once: the ranks agree)


class PathCounter:
    """Counts the moves of a log fed line by line (``batch`` moves, logged at debug only, from ``global_step``)."""

    def __init__(self) -> None:
        self.run = RunPath(Counter())
        self._internal_logged = 0
        self._derived_internal = 0
        self._entered_step: int | None = None

    def transition(self, src: str, dst: str, trigger: str, step: Any, epoch: Any, payload: Any) -> None:
        """One ``transition`` line; ``payload`` is read only for the move into ``train_end``."""
        run = self.run
        key = (src, dst, trigger)
        run.counts[key] += 1
        run.last_phase = dst
        if src == dst:
            self._internal_logged += 1
        elif dst == _TRAIN_STEP:
            self._entered_step = step if isinstance(step, int) else None
        elif src == _TRAIN_STEP and self._entered_step is not None and isinstance(step, int):
            self._derived_internal += max(step - self._entered_step - 1, 0)
            self._entered_step = None
        if dst == _FINAL:
            run.final = key
            run.reason = payload.get("reason") if isinstance(payload, Mapping) else None
            if isinstance(epoch, int):
                # From epoch_end the epoch counter has moved past the finished epoch.
                run.stop_epoch = epoch - 1 if src == _EPOCH_END else epoch

    def epochs(self, keys: Sequence[tuple[str, str, str]], steps: Sequence[list[int]], times: int) -> None:
        """Whole epochs' moves at once, as :meth:`transition` of each line would count them: move ``keys[k]``
        made ``times`` times, at the global steps ``steps[k]``; none into the end, and ``train_step`` entered in
        each epoch before it is left."""
        run, entered = self.run, None
        for key, at in zip(keys, steps, strict=True):
            run.counts[key] += times
            src, dst, _ = key
            if src == dst:
                self._internal_logged += times
            elif dst == _TRAIN_STEP:
                entered = at
            elif src == _TRAIN_STEP and entered is not None:
                self._derived_internal += sum(max(b - a - 1, 0) for a, b in zip(entered, at, strict=True))
        run.last_phase, self._entered_step = keys[-1][1], None

    def record(self, rec: Mapping[str, Any], where: str = "") -> None:
        """One parsed line of any kind."""
        event = rec.get("event")
        if event == "epoch":
            self.run.epochs_done += 1
        elif event == "run_start":
            payload = rec.get("payload")
            world = payload.get("world_size") if isinstance(payload, Mapping) else None
            if isinstance(world, int) and world > 0:
                self.run.world_size = world
        if event != "transition":
            return
        src, dst, trig = rec.get("from"), rec.get("to"), rec.get("trigger")
        if not (isinstance(src, str) and isinstance(dst, str) and isinstance(trig, str)):
            raise DiagramError(f"{where}: transition without from/to/trigger strings")
        self.transition(src, dst, trig, rec.get("global_step"), rec.get("epoch"), rec.get("payload") or {})

    def result(self) -> RunPath:
        internal = (_TRAIN_STEP, _TRAIN_STEP, "batch")
        if not self._internal_logged and self._derived_internal:
            self.run.counts[internal] = self._derived_internal
        return self.run


def read_run_path(events_path: str | Path) -> RunPath:
    """Count the moves of a run log (a run directory stands for its ``events.jsonl``)."""
    path = Path(events_path)
    if path.is_dir():
        path = path / "events.jsonl"
    counter = PathCounter()
    for lineno, raw in enumerate(read_lines(path, DiagramError), 1):
        if not raw.strip():
            continue
        try:
            rec = parse_line(raw)
        except ValueError as exc:
            raise DiagramError(f"{path}:{lineno}: not a JSON line ({exc}); run `fsmtrain audit` on it") from exc
        if not isinstance(rec, dict):
            raise DiagramError(f"{path}:{lineno}: expected a JSON object, found {type(rec).__name__}")
        counter.record(rec, f"{path}:{lineno}")
    return counter.result()
