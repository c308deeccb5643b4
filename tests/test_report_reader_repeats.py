"""The run report's reader counts a move handed to it again as the same dict (the audit's per-batch
lines) as often as a reader given every line as its own dict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fsmtrain.core.run_path import PathCounter
from fsmtrain.tools.report.run_log import RunData


def _move(src: str, dst: str, trigger: str, step: int) -> dict[str, Any]:
    return {"event": "transition", "from": src, "to": dst, "trigger": trigger, "global_step": step, "epoch": 0,
            "payload": {}}


def test_a_repeated_move_dict_counts_like_every_line() -> None:
    batch = _move("train_step", "train_step", "batch", 0)  # one dict, handed again and again
    lines = [{"event": "run_start", "run_id": "r", "payload": {}}, _move("epoch_begin", "train_step", "start", 0),
             *[batch] * 5, _move("train_step", "val", "validate", 5), _move("val", "train_step", "resume", 5),
             *[batch] * 3, _move("train_step", "train_step", "batch", 9), *[batch] * 2,
             _move("train_step", "train_step", "clip", 12), *[batch] * 4]
    data = RunData(Path("events.jsonl"))
    plain = PathCounter()
    for n, rec in enumerate(lines, 1):
        data.read(n, rec)
        plain.record(copy.deepcopy(rec))
    data.run_id = "r"  # a report needs a run to draw
    assert data.finish(len(lines)).path.result().counts == plain.result().counts
    assert data.path.result().counts[("train_step", "train_step", "batch")] == 15
