"""The background checkpoint writer: the same log as a write on the training thread, files that hold
the epoch they were captured at while training goes on, and a failed write that ends the run visibly."""

import errno
import threading
import time

import pytest
import torch
from core_helpers import DiskKeepsUp
from torch import nn

from fsmtrain import Trainer, TrainingCallback, read_events
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.training.checkpoint import CheckpointManager, Written, load_checkpoint

VOLATILE = ("ts", "prev", "seal", "run_id")  # differ between any two runs
TIMINGS = ("seconds", "phase_seconds", "callback_seconds")


class SlowWriter(CheckpointManager):
    """A disk that takes 0.3 s per checkpoint, so the next epoch's batches run during the write."""

    def write(self, plan):
        self.threads = [*getattr(self, "threads", []), threading.current_thread().name]
        time.sleep(0.3)
        return super().write(plan)


class WeightsAtEpochEnd(TrainingCallback):
    """The weights each epoch ended with (priority 99: after the checkpoint captured them)."""

    priority = 99

    def __init__(self):
        self.by_epoch = {}

    def on_epoch_end(self, epoch):
        self.by_epoch[epoch.index] = {k: v.clone() for k, v in epoch.run.model.state_dict().items()}


def _fit(tiny, run_dir, callbacks, epochs=4, n=64):
    train, val = tiny.loaders(n=n, batch=8)
    model = tiny.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=callbacks,
                      run_dir=run_dir, console_level="error", default_callbacks=False)
    return trainer.fit()


def _comparable(events):
    out = []
    for e in events:
        e = {k: v for k, v in e.items() if k not in VOLATILE}
        if isinstance(e.get("payload"), dict):
            e["payload"] = {k: v for k, v in e["payload"].items() if k not in TIMINGS and k != "chain_head"}
            if e["event"] == "run_start":
                e["payload"] = {k: v for k, v in e["payload"].items() if k not in ("callbacks", "run_dir")}
        out.append(e)
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN equals NaN here


def test_background_and_foreground_writes_log_the_same_lines_and_bytes(tiny, tmp_path):
    logs = {}
    for background in (True, False):
        run = tmp_path / str(background)
        cb = CheckpointCallback(run / "checkpoints", keep_last_k=2, save_every_n_epochs=2, background=background)
        result = _fit(tiny, run, [cb, DiskKeepsUp(cb)], epochs=7)
        assert result.stop_reason.value == "completed"
        logs[background] = read_events(run / "events.jsonl")
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            "best.pt", "epoch_4.pt", "epoch_6.pt", "latest.pt"]
    files = ("checkpoint", "checkpoint_removed")
    # The same run, line for line, apart from where the file lines fall: a foreground write is
    # committed at its epoch's end, a background one at the next epoch's end (or train_end).
    lines = {b: [(e["event"], e["payload"]) for e in _comparable(log) if e["event"] not in files]
             for b, log in logs.items()}
    assert lines[True] == lines[False]
    # the same files in the same order (their bytes differ only by the run id and chain head they store)
    committed = {b: [(e["event"], {k: v for k, v in e["payload"].items() if k != "sha256"})
                     for e in _comparable(log) if e["event"] in files] for b, log in logs.items()}
    assert committed[True] == committed[False]
    states = [load_checkpoint(tmp_path / str(b) / "checkpoints" / "latest.pt") for b in (True, False)]
    for state in states:
        del state["run_id"], state["chain_head"]
    assert _same(states[0], states[1])
    assert len([c for c in committed[True] if c[0] == "checkpoint"]) >= 14
    for log in logs.values():
        epoch_of = {e["payload"]["sha256"]: e["payload"]["epoch"] for e in log if e["event"] == "checkpoint"}
        assert len(epoch_of) == 7  # one serialisation per epoch: every role of an epoch has its bytes


def test_the_write_runs_beside_the_next_epoch_and_holds_the_epoch_it_captured(tiny, tmp_path):
    run = tmp_path / "run"
    cb = CheckpointCallback(run / "checkpoints", keep_last_k=0, save_best=False)
    cb.manager.__class__ = SlowWriter  # the same manager, on a slow disk
    weights = WeightsAtEpochEnd()
    _fit(tiny, run, [cb, weights, DiskKeepsUp(cb)], epochs=4)
    assert isinstance(cb.manager, SlowWriter)
    assert cb.manager.threads and all(t.startswith("fsmtrain-checkpoint") for t in cb.manager.threads)
    events = read_events(run / "events.jsonl")
    for e in range(4):
        committed = next(x for x in events if x["event"] == "checkpoint" and x["payload"]["epoch"] == e)
        ended = next(i for i, x in enumerate(events) if x["event"] == "epoch" and x["epoch"] == e)
        # logged once durable: after the next epoch's batches (or at train_end for the last)
        assert events.index(committed) > ended + 1
        state = load_checkpoint(run / "checkpoints" / f"epoch_{e + 1}.pt")
        for name, value in weights.by_epoch[e].items():
            assert torch.equal(state["model"][name], value), (e, name)  # not the weights trained since
    assert not any(t.name.startswith("fsmtrain-checkpoint") for t in threading.enumerate())


class FailingDisk(CheckpointManager):
    """The second write meets a full disk (a test double: this machine's disk cannot be filled safely)."""

    def write(self, plan) -> Written:
        if plan.epoch == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.periodic_path(1)))
        return super().write(plan)


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_write_ends_the_run_as_an_error_with_what_was_committed(tiny, tmp_path, background):
    run = tmp_path / "run"
    cb = CheckpointCallback(run / "checkpoints", save_best=False, background=background)
    cb.manager.__class__ = FailingDisk
    with pytest.raises(OSError, match="No space left on device"):
        _fit(tiny, run, [cb, DiskKeepsUp(cb)], epochs=6)
    events = read_events(run / "events.jsonl")
    error = next(e for e in events if e["event"] == "exception")
    assert error["payload"]["type"] == "OSError" and "No space left" in error["payload"]["message"]
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "error"
    # surfaced at the next phase boundary: at the latest in the epoch after the failed one
    assert error["epoch"] <= 2
    committed = {e["payload"]["path"]: e["payload"]["epoch"] for e in events if e["event"] == "checkpoint"}
    assert committed == {"checkpoints/epoch_1.pt": 0, "checkpoints/latest.pt": 0}
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["epoch"] == 1  # what was committed loads (epoch_1)
