"""The structured event log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_helpers import events_of, make_trainer

from fsmtrain.core.events import EVENT_KEYS, EventLog, as_float, jsonable, read_events


def test_every_line_is_strict_json_with_the_schema(tmp_path: Path) -> None:
    make_trainer(tmp_path, epochs=2).fit()
    with open(tmp_path / "events.jsonl", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
        assert tuple(record) == EVENT_KEYS
    events = events_of(tmp_path)
    assert {e["run_id"] for e in events} == {events[0]["run_id"]}
    assert events[0]["event"] == "run_start"
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert set(epochs[0]["payload"]["metrics"]) == {"lr", "train_loss", "val_loss"}


def test_non_finite_values_round_trip(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl", "r", console=None)
    log.emit("x", payload={"a": math.nan, "b": math.inf, "c": -math.inf, "d": [1.5, math.nan]})
    log.close()
    p = read_events(tmp_path / "e.jsonl")[0]["payload"]
    assert math.isnan(as_float(p["a"])) and as_float(p["b"]) == math.inf and as_float(p["c"]) == -math.inf
    assert p["d"][0] == 1.5


def test_batch_events_only_at_debug_level(tmp_path: Path) -> None:
    make_trainer(tmp_path / "info", epochs=1).fit()
    make_trainer(tmp_path / "debug", epochs=1, log_level="debug").fit()
    info = [e for e in events_of(tmp_path / "info") if e["from"] == "train_step" and e["to"] == "train_step"]
    debug = [e for e in events_of(tmp_path / "debug") if e["from"] == "train_step" and e["to"] == "train_step"]
    assert info == [] and len(debug) == 4  # 5 batches: the first enters train_step, 4 internal moves
    assert all(e["level"] == "debug" for e in debug)


def test_bad_level_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="level must be one of"):
        EventLog(None, "r", level="verbose")


def test_jsonable_handles_enums_dataclasses_tensors() -> None:
    import torch

    from fsmtrain.core.slots import LossPrediction
    from fsmtrain.core.stop import StopReason

    assert jsonable(StopReason.NAN) == "nan"
    assert jsonable(LossPrediction(0.5, 0.3, True)) == {"predicted_loss": 0.5, "neg_log10": 0.3, "fit_ok": True}
    assert jsonable(torch.tensor(2.5)) == 2.5


def test_console_gets_one_line_for_an_exception_and_the_file_the_traceback(tmp_path: Path) -> None:
    import io

    console = io.StringIO()
    log = EventLog(tmp_path / "e.jsonl", "r", console=console, console_level="warning")
    log.emit("exception", level="error", payload={"type": "ValueError", "message": "bad",
                                                  "traceback": "Traceback (most recent call last):\n  ..."})
    log.close()
    shown = console.getvalue()
    assert "bad" in shown and "Traceback" not in shown and len(shown.strip().splitlines()) == 1
    assert read_events(tmp_path / "e.jsonl")[0]["payload"]["traceback"].startswith("Traceback")


def test_a_line_written_beside_the_training_thread_takes_the_logs_position(tmp_path: Path) -> None:
    """A line from beside the training thread (the checkpoint writer's commit) sits where it is
    written: phase, epoch and step of the line before it, not the run's live phase (train_step while
    the log's last transition still says epoch_begin, a line the audit would refuse)."""
    from fsmtrain.core.context import RunContext
    from fsmtrain.core.lifecycle import Phase
    from fsmtrain.tools.audit import audit_file

    log = EventLog(tmp_path / "events.jsonl", "r", console=None)
    run = RunContext("r", 5, log)
    phase = [Phase.CREATED]
    run.bind_phase(lambda: phase[0])
    run.emit("run_start", max_epochs=5)
    log.emit("transition", phase="train_begin", epoch=0, global_step=0, payload={}, from_phase="created",
             to_phase="train_begin", trigger="begin")
    log.emit("transition", phase="epoch_begin", epoch=0, global_step=0, payload={}, from_phase="train_begin",
             to_phase="epoch_begin", trigger="start_epoch")
    phase[0], run.epoch, run.global_step = Phase.TRAIN_STEP, 0, 7  # the machine has moved; its line is not written
    run.emit_at_log_position("warning", level="warning", source="writer", message="from beside")
    log.close()
    last = read_events(tmp_path / "events.jsonl")[-1]
    assert (last["event"], last["phase"], last["epoch"], last["global_step"]) == ("warning", "epoch_begin", 0, 0)
    report = audit_file(tmp_path / "events.jsonl")
    assert not [f for f in report.findings if f.check == "phase"], report.render(False)
