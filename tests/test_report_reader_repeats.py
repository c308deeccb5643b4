"""The run report's reader counts a move handed to it again as the same dict (the audit's per-batch
lines) as often as a reader given every line as its own dict."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.parametrize("per_batch_lines", [0, 3])
def test_whole_epochs_count_as_each_line_does(per_batch_lines: int) -> None:
    """The audit hands whole epochs over at once (:meth:`PathCounter.epochs`): at debug level their per-batch lines
    among them. Counted as each line is: the moves, and the per-batch moves as logged, not derived from steps."""
    batches = per_batch_lines + 1
    keys = [("epoch_end", "epoch_begin", "next_epoch"), ("epoch_begin", "train_step", "batch"),
            *[("train_step", "train_step", "batch")] * per_batch_lines, ("train_step", "val", "validate"),
            ("val", "epoch_end", "end_epoch")]
    begins = [10 * e for e in range(1, 4)]
    steps = [[b] * 2 + [b + k for k in range(1, batches)] + [b + batches] * 2 for b in begins]
    whole, each = PathCounter(), PathCounter()
    whole.epochs(keys, [list(col) for col in zip(*steps, strict=True)], len(begins))
    for at in steps:
        for key, step in zip(keys, at, strict=True):
            each.transition(*key, step, 1, None)
    assert vars(whole) == vars(each) and vars(whole.result()) == vars(each.result())
    assert whole.result().counts[("train_step", "train_step", "batch")] == 3 * (batches - 1)
