"""The checkpoint writer on a slow disk: the training thread only stages, a waiting state gives way to
a newer one (``checkpoint_skipped``), a best state never gives way to one that is not, and what was
staged is what was trained, bit for bit, however late it reaches the disk.

The slow disk is a test double: the real ``CheckpointManager`` whose ``write`` waits at a gate the test
opens (this machine's disk cannot be made slow on demand, and a sleep would make the order a race).
If the training thread ever waited for the writer, a gate that opens only later would stop the run,
and the gate's timeout would fail the test: the runs completing is the proof that no epoch waited."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsmtrain import Trainer, TrainingCallback, read_events
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.checkpoint import CheckpointManager, WritePlan, Written, load_checkpoint
from fsmtrain.training.checkpoint_writer import BufferSet, stage, tensor_bytes

GATE_S = 60  # a gate never opened in time fails the test instead of hanging it

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device; none here"))]


class GatedDisk(CheckpointManager):
    """A disk that finishes the write of an epoch only once the test opens that epoch's gate."""

    def gate(self, epoch: int) -> threading.Event:
        gates: dict[int, threading.Event] = self.__dict__.setdefault("gates", {})
        return gates.setdefault(epoch, threading.Event())

    def write(self, plan: WritePlan) -> Written:
        if not self.gate(plan.epoch).wait(GATE_S):
            raise TimeoutError(f"the gate of epoch {plan.epoch} never opened: did the training thread wait?")
        return super().write(plan)


def _gated(cb: CheckpointCallback) -> GatedDisk:
    cb.manager.__class__ = GatedDisk  # the same manager, on a slow disk
    assert isinstance(cb.manager, GatedDisk)
    return cb.manager


class Scores(TrainingCallback):
    """Sets the metric the checkpoint monitors, epoch by epoch (priority 60: before the checkpoint)."""

    priority = 60

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores

    def on_val_end(self, epoch: Any) -> None:
        epoch.metrics["score"] = self.scores[epoch.index]


class At(TrainingCallback):
    """Runs ``fn(epoch index)`` at each epoch's end, at ``priority`` (94: before the checkpoint is
    staged; 96: after it)."""

    def __init__(self, priority: int, fn: Any) -> None:
        self.priority = priority
        self.fn = fn

    def on_epoch_end(self, epoch: Any) -> None:
        self.fn(epoch.index)


class AtEnd(TrainingCallback):
    """Runs ``fn()`` at train_end before the checkpoint waits for its writer (priority 90 < 95)."""

    priority = 90

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def on_train_end(self, run: Any) -> None:
        self.fn()


def _fit(run_dir: Path, callbacks: list[TrainingCallback], epochs: int, device: str = "cpu") -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), nn.MSELoss(), batches, batches[:1],
                      max_epochs=epochs, callbacks=callbacks, run_dir=run_dir, device=device, console_level="error",
                      default_callbacks=False)
    trainer.fit()
    return trainer


def _written(disk: GatedDisk, n: int) -> None:
    """Wait until the writer has finished ``n`` writes (and moved on to the next)."""
    deadline = time.monotonic() + GATE_S
    while disk.writer.written < n:
        assert time.monotonic() < deadline, f"the writer finished {disk.writer.written} writes, not {n}"
        time.sleep(0.001)


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model, optimizer, ...), by its place in the state."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def _skips(run_dir: Path) -> dict[int, str]:
    return {e["payload"]["epoch"]: e["payload"]["reason"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "checkpoint_skipped"}


def _committed(run_dir: Path) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for e in read_events(run_dir / "events.jsonl"):
        if e["event"] == "checkpoint":
            out.setdefault(e["payload"]["kind"], set()).add(e["payload"]["epoch"])
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("snapshot", ["serialized", "staged"])
def test_a_staged_state_is_what_was_trained_while_the_next_epochs_train(tmp_path: Path, device: str,
                                                                         snapshot: str) -> None:
    """Each state is written while later epochs train, and equals, tensor for tensor and bit for bit, the
    state a synchronous save wrote. A small CPU state is serialized on the training thread (its bytes are the
    snapshot, no buffer is used); any other, or one above the limit, is staged into the buffer set of its slot
    while the other slot's state is written."""
    epochs = 6
    sync = tmp_path / "sync"
    _fit(sync, [CheckpointCallback(sync / "checkpoints", keep_last_k=0, save_best=False, background=False)], epochs,
         device)

    late = tmp_path / "late"
    cb = CheckpointCallback(late / "checkpoints", keep_last_k=0, save_best=False)
    disk = _gated(cb)
    if snapshot == "staged":
        disk.serialized_at_most = None  # as a state above the limit is
    slots: list[set[int]] = []
    # Before epoch e is staged: the write of e - 2 is done (so nothing is left out), while e - 1 may
    # still be in flight. After it is staged (two states pending, one per buffer set): the write of
    # e - 1 may begin, and reads its buffers while epoch e + 1 trains.
    before = At(94, lambda e: _written(disk, e - 1))
    after = At(96, lambda e: (slots.append(disk.writer.busy_slots()), disk.gate(e - 1).set()))
    end = AtEnd(lambda: [disk.gate(e).set() for e in range(epochs)])
    _fit(late, [cb, before, after, end], epochs, device)

    assert {0, 1} in slots  # a state waited in one buffer set while the other was being written
    assert _skips(late) == {}
    n_tensors = len(_tensors(load_checkpoint(late / "checkpoints" / "epoch_1.pt")))
    serialized = snapshot == "serialized" and device == "cpu"  # a CUDA state is always staged
    allocations = 0 if serialized else n_tensors  # once per tensor, then reused
    assert [b.allocations for b in disk.buffers] == [allocations, allocations]
    assert all(not b.buffers for b in disk.buffers)  # released at train_end
    for e in range(1, epochs + 1):
        a = _tensors(load_checkpoint(sync / "checkpoints" / f"epoch_{e}.pt"))
        b = _tensors(load_checkpoint(late / "checkpoints" / f"epoch_{e}.pt"))
        assert a.keys() == b.keys() and len(a) == n_tensors
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (e, k)
    assert audit_file(late / "events.jsonl").ok


def test_a_small_cpu_state_is_snapshot_as_its_bytes_and_any_other_in_reused_buffers() -> None:
    """At most ``serialized_at_most`` bytes of plain CPU tensors: the file's bytes, made on the training thread,
    and no buffer; above it, never (None), or with a tensor of another kind: a copy in the slot's buffers."""
    model = nn.Linear(4, 2)
    state = {"model": model.state_dict(), "epoch": 3, "names": ["a", "b"]}
    size = tensor_bytes(state)
    before = model.weight.detach().clone()
    buffers = BufferSet()

    small = stage(state, buffers, size)  # at the limit
    assert small.state is None and small.data is not None and small.staged_bytes == size and not buffers.buffers
    with torch.no_grad():
        model.weight.add_(1.0)  # the run goes on
    kept = torch.load(io.BytesIO(bytes(small.data)), weights_only=True)
    assert torch.equal(kept["model"]["weight"], before) and kept["epoch"] == 3 and kept["names"] == ["a", "b"]

    for limit in (size - 1, None):
        copied = stage(state, buffers, limit)
        assert copied.data is None and torch.equal(copied.state["model"]["weight"], model.weight)
        assert copied.state["model"]["weight"].data_ptr() != model.weight.data_ptr()
    assert buffers.allocations == 2  # weight and bias, once: the second staging reused them

    for odd in ({"model": state["model"], "sparse": torch.eye(2).to_sparse()},
                {"model": state["model"], "extra": [(1, nn.Parameter(torch.zeros(2)))]}):  # a tensor subclass
        assert stage(odd, BufferSet(), size * 10).data is None


@pytest.mark.timeout(180)
def test_a_slow_disk_drops_waiting_states_with_a_reason_and_never_holds_an_epoch_up(tmp_path: Path) -> None:
    """The first write takes until the run's end: every epoch after it trains anyway. Each newer
    state replaces the waiting one; the log names each one left out and the audit accepts them."""
    epochs = 7
    run = tmp_path / "run"
    cb = CheckpointCallback(run / "checkpoints", keep_last_k=0, save_best=False)
    disk = _gated(cb)
    staged: list[int] = []
    busy = At(96, staged.append)
    end = AtEnd(lambda: disk.gate(0).set() or disk.gate(epochs - 1).set())
    _fit(run, [cb, busy, end], epochs)

    assert staged == list(range(epochs))  # every epoch ended while the first write was still in flight
    assert disk.writer.written == 2
    assert _committed(run) == {"periodic": {0, epochs - 1}, "latest": {0, epochs - 1}}
    skips = _skips(run)
    assert sorted(skips) == list(range(1, epochs - 1))
    assert all(f"the state of epoch {e + 2} replaced it" in why and "write of epoch 1" in why
               for e, why in skips.items())
    events = read_events(run / "events.jsonl")
    for e in skips:  # said at the epoch end that replaced it, on the training thread
        line = next(x for x in events if x["event"] == "checkpoint_skipped" and x["payload"]["epoch"] == e)
        assert line["epoch"] == e + 1 and line["phase"] == "epoch_end"
    levels = [x["level"] for x in events if x["event"] == "checkpoint_skipped"]
    assert levels[0] == "warning" and set(levels[1:]) == {"info"}  # the console hears it once
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render()
    assert report.explanation.checkpoints_skipped == epochs - 2
    # the audit checks the log explains each one: without its checkpoint_skipped, epoch index 2 is a gap
    lines = (run / "events.jsonl").read_text().splitlines(keepends=True)
    cut = [ln for ln in lines if not (json.loads(ln)["event"] == "checkpoint_skipped"
                                      and json.loads(ln)["payload"]["epoch"] == 2)]
    assert len(cut) == len(lines) - 1
    (tmp_path / "cut.jsonl").write_text("".join(cut))
    gaps = [f for f in audit_file(tmp_path / "cut.jsonl", verify_checkpoints=False).violations
            if f.check == "coverage"]
    assert len(gaps) == 1 and "epoch 3 has no checkpoint" in gaps[0].message, gaps  # index 2, read from 1


@pytest.mark.timeout(180)
def test_a_best_state_is_never_dropped_for_a_newer_one_that_is_not(tmp_path: Path) -> None:
    """Epoch 0 is being written; epoch 1 (best) waits and gives way to epoch 2 (a better best); epochs
    3 and 4 (not best) are left out rather than drop it; the last epoch waits for a free slot."""
    scores = [1.0, 0.5, 0.3, 0.9, 0.8, 0.7]
    run = tmp_path / "run"
    cb = CheckpointCallback(run / "checkpoints", keep_last_k=0, monitor="score")
    disk = _gated(cb)
    last = len(scores) - 1
    # the disk frees up at the last epoch's end, before its state is staged
    opener = At(94, lambda e: [disk.gate(k).set() for k in range(len(scores))] if e == last else None)
    _fit(run, [cb, Scores(scores), opener], len(scores))

    committed = _committed(run)
    assert committed["best"] == {0, 2} and committed["latest"] == {0, 2, last}
    skips = _skips(run)
    assert sorted(skips) == [1, 3, 4]
    assert "the state of epoch 3 replaced it" in skips[1]  # a best gives way to a newer best only
    assert all("the best state of epoch 3 still waits" in skips[e] for e in (3, 4))
    assert load_checkpoint(run / "checkpoints" / "best.pt")["epoch"] == 3  # counted from 1
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["epoch"] == last + 1
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render()


@pytest.mark.timeout(120)
def test_a_writer_that_hangs_in_the_teardown_is_given_up_on_said_and_the_result_written(tmp_path: Path) -> None:
    """The teardown's wait for the last writes is bounded: a write that never ends (a hung disk) is
    given up on after ``drain_timeout_s``, with a warning, and the run still ends with its result."""
    run = tmp_path / "run"
    cb = CheckpointCallback(run / "checkpoints", keep_last_k=0, save_best=False, drain_timeout_s=0.5)
    disk = _gated(cb)
    disk.gate(0).set()  # the first epoch's write goes through; the last one hangs until after the run
    started = time.monotonic()
    _fit(run, [cb], epochs=2)
    took = time.monotonic() - started
    disk.gate(1).set()
    events = read_events(run / "events.jsonl")
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "completed"
    (gave_up,) = [e for e in events if e["event"] == "warning" and e["payload"]["source"] == "CheckpointCallback"]
    assert "did not finish within 0.5 s" in gave_up["payload"]["message"], gave_up
    assert took < GATE_S, took
    assert _committed(run)["latest"] == {0}  # the hung write of the last epoch was never committed
