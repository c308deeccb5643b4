"""``val_every_n_steps`` through ``fsmtrain train`` (a real subprocess): early stopping counts validations,
stops at a validation inside an epoch and cuts the epoch there; the audit passes and rejects a removed
or forged mid-epoch validation; ``fsmtrain replay`` re-drives the run, and a what-if on
``val_every_n_steps`` says what another setting would have done."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from steps_support import RUN, events, fsmtrain, write_config

from fsmtrain.core.stop import StopReason
from fsmtrain.tools.audit.auditor import audit_file
from fsmtrain.tools.replay import replay_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """26 batches an epoch; a validation every 4 steps; nothing improves after the first by 99%: patience 5
    stops the run at validation 6, step 24, two batches before epoch 1's end."""
    folder = tmp_path_factory.mktemp("valsteps")
    config = write_config(folder, val_every_n_steps=4,
                          early_stopping={"enabled": True, "patience": 5, "min_delta": 0.99})
    done = fsmtrain(folder, "train", str(config))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return folder / RUN


def _validations(log: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    return [(e["payload"]["validation"], e["epoch"], e["global_step"]) for e in log if e["event"] == "validation"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_early_stopping_stops_at_a_validation_inside_an_epoch_and_the_log_audits_and_replays(run_dir: Path) -> None:
    log = events(run_dir)
    result = next(e["payload"] for e in log if e["event"] == "result")
    assert result["stop_reason"] == StopReason.EARLY_STOP.value and result["global_step"] == 24
    assert _validations(log) == [(n, 0, 4 * n) for n in range(1, 7)]
    moves = [(e["trigger"], e["global_step"]) for e in log if e["event"] == "transition"]
    assert moves[-3:] == [("val_check", 24), ("cut_epoch", 24), ("finish", 24)]  # the epoch is cut there
    epoch = next(e["payload"] for e in log if e["event"] == "epoch")
    assert epoch["batches"] == 24 and epoch["cut"] is True and "train_loss" in epoch["metrics"]
    stop = next(e["payload"] for e in log if e["event"] == "stop_request")
    assert "(validation 1 (epoch 1, step 4))" in stop["message"] and "for 5 validations" in stop["message"]
    report = audit_file(run_dir / "events.jsonl")
    assert not report.violations, [f.message for f in report.violations]
    replayed = fsmtrain(run_dir.parent, "replay", str(run_dir))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "replay reproduces the recorded trace" in replayed.stdout and "EARLY_STOP" in replayed.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_what_if_on_val_every_n_steps(run_dir: Path) -> None:
    # every 8 steps, patience 2: validations at 8 (best), 16, 24, all recorded: a stop at step 24
    res = replay_run(run_dir, overrides=["val_every_n_steps=8", "early_stopping.patience=2"])
    assert res.stop_reason is StopReason.EARLY_STOP and res.result is not None and res.result.global_step == 24
    assert [(e["payload"]["validation"], e["global_step"]) for e in res.trace
            if e["event"] == "validation"] == [(1, 8), (2, 16), (3, 24)]
    # every 12 steps, patience 5: the run would go on past where the recording ends: unknown, said so
    res = replay_run(run_dir, overrides=["val_every_n_steps=12"])
    assert res.stop_reason is None and res.exhausted_after is not None
    # every 5 steps: the run never validated at step 5, so what it would have done is not known
    res = replay_run(run_dir, overrides=["val_every_n_steps=5"])
    assert res.stop_reason is None and "no validation at global step 5" in res.what_if()


def _lines(run_dir: Path) -> list[str]:
    return (run_dir / "events.jsonl").read_text().splitlines()


def _audit_of(tmp_path: Path, lines: list[str]) -> str:
    forged = tmp_path / "forged.jsonl"
    forged.write_text("\n".join(lines) + "\n")
    return " | ".join(f.message for f in audit_file(forged, verify_checkpoints=False).violations)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_audit_rejects_a_removed_mid_epoch_validation(run_dir: Path, tmp_path: Path) -> None:
    kept = [line for line in _lines(run_dir) if not (json.loads(line)["global_step"] == 8 and (
        json.loads(line)["event"] == "validation" or json.loads(line).get("trigger") in ("val_check", "resume_train")))]
    assert len(kept) == len(_lines(run_dir)) - 3
    found = _audit_of(tmp_path, kept)
    assert "no validation at global_step 8 (val_every_n_steps=4" in found


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_audit_rejects_a_forged_mid_epoch_validation(run_dir: Path, tmp_path: Path) -> None:
    recs = [json.loads(line) for line in _lines(run_dir)]
    at = next(i for i, r in enumerate(recs) if r.get("trigger") == "resume_train")  # the one after step 4
    extra = [{**r, "global_step": 6} for r in recs[at - 2:at + 1]]  # val_check, validation, resume_train at 6
    forged = [{**r, "seq": n} for n, r in enumerate(recs[:at + 1] + extra + recs[at + 1:])]
    found = _audit_of(tmp_path, [json.dumps(r, separators=(",", ":")) for r in forged])
    assert "train_step -> val (val_check) needs [has_batch, val_due, not immediate_stop]" in found
    renumbered = [line.replace('"validation":3', '"validation":7') for line in _lines(run_dir)]  # a count that skips
    assert "validation line 7 at global_step 12, expected validation 3" in _audit_of(tmp_path, renumbered)
