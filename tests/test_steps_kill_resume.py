"""Checkpoints at steps and exact resume inside an epoch, with real processes killed by real SIGKILL
at exact steps (tests/steps_support.py): the resumed run's weights are bit for bit those of an
uninterrupted run of the same config, it lost at most ``every_n_steps`` steps, and its log audits."""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from steps_support import RUN, events, fsmtrain, kill_and_resume, same_bits, weights, write_config

from fsmtrain.tools.audit.auditor import audit_file

STEPS = 78  # 3 epochs of 26 batches


def _reference(root: Path, config: Path) -> dict[str, torch.Tensor]:
    (root / "ref").mkdir()
    done = fsmtrain(root / "ref", "train", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    return weights(root / "ref" / RUN)


def _killed(root: Path, config: Path, kill: str) -> tuple[Path, dict[str, Any] | None]:
    folder = root / "killed"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    run_dir, resume = kill_and_resume(folder, config, kill)
    report = audit_file(run_dir / "events.jsonl")
    assert not report.violations, [f.message for f in report.violations]
    return run_dir, resume


def _epoch_losses(run_dir: Path) -> list[float]:
    return [e["payload"]["metrics"]["train_loss"] for e in events(run_dir) if e["event"] == "epoch"]


def _last_resume(run_dir: Path) -> dict[str, Any] | None:
    """The ``resume`` event of the newest process of the run (None: it started over)."""
    found: dict[str, Any] | None = None
    for e in events(run_dir):
        if e["event"] == "run_start":
            found = None
        elif e["event"] == "resume":
            found = e["payload"]
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_kill_9_at_30_random_steps_resumes_bit_identical_losing_at_most_5_steps(tmp_path: Path) -> None:
    """One run killed with SIGKILL at 30 random steps, each ``fsmtrain resume`` the next process killed
    (a kill costs one process): every resume goes on from at most 5 steps back, and the end is the
    uninterrupted run's, bit for bit, epoch losses included; a resume that was not exact would carry
    its difference to the end."""
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 5, "checkpoint.background": False,
                                       "checkpoint.keep_last_k": 2})
    ref = _reference(tmp_path, config)
    kept = sorted(p.name for p in (tmp_path / "ref" / RUN / "checkpoints").iterdir())
    assert [n for n in kept if n.startswith("step_")] == ["step_70.pt", "step_75.pt"]  # keep_last_k holds for steps
    kills = sorted(random.Random(41).sample(range(1, STEPS), 30))
    folder = tmp_path / "killed"
    folder.mkdir()
    run_dir, before = folder / RUN, None
    for at in [*kills, None]:
        args = ("train", str(config)) if before is None else ("resume", str(run_dir))
        done = fsmtrain(folder, *args, kill=None if at is None else f"step:{at}")
        expected = 0 if at is None else -signal.SIGKILL
        assert done.returncode == expected, (at, done.returncode, done.stdout[-2000:] + done.stderr[-3000:])
        if before is not None:  # the kill before this process: where it went on from
            resume = _last_resume(run_dir)
            continued = 0 if resume is None else resume["global_step"]
            assert before - continued <= 5, f"killed at step {before}, resumed from step {continued}"
            if resume is not None and resume["checkpoint"].startswith("checkpoints/step_"):
                assert resume["batch"] == continued - 26 * resume["next_epoch"]
        before = at
    assert same_bits(ref, weights(run_dir)), f"kills at steps {kills}"
    assert _epoch_losses(run_dir) == _epoch_losses(tmp_path / "ref" / RUN)  # the epochs' sums were kept too
    report = audit_file(run_dir / "events.jsonl")
    assert not report.violations, [f.message for f in report.violations]
    assert sum(e["event"] == "run_start" for e in events(run_dir)) == 31


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_at_an_epochs_last_step_resumes_into_that_epochs_validation_then_the_next_epoch(
        tmp_path: Path) -> None:
    """verl #7401: resuming from a checkpoint at the last step of an epoch must not skip an epoch."""
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 13, "checkpoint.background": False})
    ref = _reference(tmp_path, config)
    run_dir, resume = _killed(tmp_path, config, "val:0")  # step_26.pt is committed; epoch 1 is not validated
    assert resume is not None
    assert (resume["checkpoint"], resume["global_step"], resume["next_epoch"], resume["batch"]) == \
        ("checkpoints/latest.pt", 26, 0, 26)
    epochs = [e for e in events(run_dir) if e["event"] == "epoch"]
    assert [(e["epoch"], e["payload"]["batches"]) for e in epochs] == [(0, 26), (1, 26), (2, 26)]
    assert same_bits(ref, weights(run_dir))
    assert _epoch_losses(run_dir) == _epoch_losses(tmp_path / "ref" / RUN)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gradient_accumulation_resumes_inside_its_window_bit_identical(tmp_path: Path) -> None:
    # every 5 steps with windows of 4: most checkpoints fall inside a window, its gradient half summed
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 5, "checkpoint.background": False,
                                       "grad_accumulation": 4})
    ref = _reference(tmp_path, config)
    for at in (7, 33, 51):  # step 5, 30, 50: 1, 2 and 2 micro-batches into a window
        run_dir, resume = _killed(tmp_path, config, f"step:{at}")
        assert resume is not None and resume["global_step"] == at - at % 5
        assert same_bits(ref, weights(run_dir)), f"killed at step {at}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_loader_without_its_own_generator_and_dropout_resume_bit_identical(tmp_path: Path) -> None:
    """The epoch's order is drawn from the global RNG as the epoch began: the checkpoint keeps that state."""
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 5, "checkpoint.background": False,
                                       "data": "steps_support.plain_loaders", "data_config": {},
                                       "net_config.dropout": 0.2})
    ref = _reference(tmp_path, config)
    for at in (12, 44):
        run_dir, _ = _killed(tmp_path, config, f"step:{at}")
        assert same_bits(ref, weights(run_dir)), f"killed at step {at}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_loader_that_cannot_start_at_an_index_says_so_and_still_resumes_bit_identical(tmp_path: Path) -> None:
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 5, "checkpoint.background": False,
                                       "data": "steps_support.iterable_loaders", "data_config": {}})
    ref = _reference(tmp_path, config)
    run_dir, _ = _killed(tmp_path, config, "step:38")
    said = [e["payload"] for e in events(run_dir) if e["event"] == "warning" and e["payload"]["source"] == "resume"]
    assert said and said[0]["skipped_batches"] == 9 and "loaded and dropped" in said[0]["message"]
    assert same_bits(ref, weights(run_dir))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_background_writer_resumes_bit_identical(tmp_path: Path) -> None:
    config = write_config(tmp_path, **{"checkpoint.every_n_steps": 5})
    ref = _reference(tmp_path, config)
    for at in (23, 61):
        run_dir, _ = _killed(tmp_path, config, f"step:{at}")
        assert same_bits(ref, weights(run_dir)), f"killed at step {at}"
