import random

import numpy as np
import pytest
import torch
from torch import nn

from fsmtrain import Trainer, TrainingCallback, read_events
from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback
from fsmtrain.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    sha256_of,
)
from fsmtrain.training.checkpoint_file import capture_rng_state, restore_rng_state


class AddsState(TrainingCallback):
    def __init__(self):
        self.saves = 0

    def on_save_checkpoint(self, ckpt):
        self.saves += 1
        ckpt.state["extra"]["adds_state"] = self.saves


def _train(tiny, tmp_path, epochs, callbacks, **kw):
    train, val = tiny.loaders(n=8, batch=8)  # one batch per epoch
    model = tiny.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    trainer = Trainer(model, opt, nn.MSELoss(), train, val, max_epochs=epochs, callbacks=callbacks,
                      scheduler=sched, run_dir=tmp_path / "run", extras={"config_fingerprint": "fp-123"},
                      console_level="error", **kw, default_callbacks=False)
    return trainer, trainer.fit()


def test_keep_last_3_over_120_epochs_by_epoch_number(tiny, tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    # written before each epoch ends: retention by epoch number is the subject here, and a background
    # writer on a disk slower than these 2 ms epochs leaves states out by design (test_cb_checkpoint_writer)
    cb = CheckpointCallback(ck, save_every_n_epochs=1, keep_last_k=3, background=False)
    _trainer, result = _train(tiny, tmp_path, 120, [cb, EarlyStoppingCallback(patience=1000), AddsState()])
    assert result.epochs_completed == 120
    assert sorted(p.name for p in ck.iterdir()) == ["best.pt", "epoch_118.pt", "epoch_119.pt", "epoch_120.pt",
                                                     "latest.pt"]
    assert [p.name for p in cb.manager.list_periodic()] == ["epoch_118.pt", "epoch_119.pt", "epoch_120.pt"]
    events = read_events(tmp_path / "run" / "events.jsonl")
    written = [e["payload"] for e in events if e["event"] == "checkpoint"]
    removed = [e["payload"]["path"] for e in events if e["event"] == "checkpoint_removed"]
    assert [w["epoch"] for w in written if w["kind"] == "periodic"] == list(range(120))
    assert removed == [f"checkpoints/epoch_{i}.pt" for i in range(1, 118)]  # oldest first, by number
    # every recorded sha256 of a file still there matches the file
    last = {w["path"]: w["sha256"] for w in written}
    for name in ("best.pt", "latest.pt", "epoch_120.pt"):
        assert last[f"checkpoints/{name}"] == sha256_of(ck / name)
    latest = torch.load(ck / "latest.pt", weights_only=True)
    assert latest["epoch"] == 120 and latest["position"]["next_epoch"] == 120  # epoch_120.pt holds epoch 120
    assert latest["position"]["phase"] == "epoch_end" and latest["position"]["global_step"] == 120
    best = load_checkpoint(ck / "best.pt")
    assert best["epoch"] == result.best_epoch + 1  # the file counts from 1; the result keeps the index
    assert best["metrics"]["val_loss"] == pytest.approx(result.best_val_loss)


def test_contents_load_with_weights_only(tiny, tmp_path):
    ck = tmp_path / "ck"
    adds = AddsState()
    es = EarlyStoppingCallback(patience=50)
    trainer, _ = _train(tiny, tmp_path, 3, [CheckpointCallback(ck), es, adds])
    state = torch.load(ck / "latest.pt", weights_only=True)
    assert set(state) >= {"model", "optimizer", "scheduler", "callbacks", "rng", "position", "config_fingerprint"}
    model = trainer.model
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert state["optimizer"]["state"]  # momentum buffers
    assert state["scheduler"]["last_epoch"] == 3
    assert state["callbacks"]["EarlyStoppingCallback"] == es.state_dict()
    assert state["callbacks"]["CheckpointCallback"]["best_epoch"] is not None
    assert state["config_fingerprint"] == "fp-123"
    assert state["extra"]["adds_state"] == adds.saves
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["position"] == {"phase": "epoch_end", "epoch": 2, "next_epoch": 3, "batch": 0, "global_step": 3,
                                 "max_epochs": 3}


def test_truncated_and_garbage_files_are_reported_by_name(tiny, tmp_path):
    ck = tmp_path / "ck"
    _train(tiny, tmp_path, 2, [CheckpointCallback(ck)])
    path = ck / "latest.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"latest\.pt is corrupt or truncated") as err:
        load_checkpoint(path)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    garbage = ck / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"garbage\.pt"):
        load_checkpoint(garbage)
    with pytest.raises(CheckpointError, match=r"missing\.pt does not exist"):
        load_checkpoint(ck / "missing.pt")
    torch.save({"weights": torch.zeros(1)}, ck / "other.pt")
    with pytest.raises(CheckpointError, match="not an fsmtrain checkpoint"):
        load_checkpoint(ck / "other.pt")


def test_failed_write_leaves_old_file_and_no_temp(tiny, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    cb = CheckpointCallback(ck, save_best=False)
    _train(tiny, tmp_path, 1, [cb])
    before = (ck / "latest.pt").read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("fsmtrain.training.checkpoint_file.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):  # a callback instance serves one Trainer: a new one
        _train(tiny, tmp_path / "again", 1, [CheckpointCallback(ck, save_best=False)])
    monkeypatch.undo()
    assert (ck / "latest.pt").read_bytes() == before
    assert sorted(p.name for p in ck.iterdir()) == ["epoch_1.pt", "latest.pt"]  # no .tmp left behind


def test_ordering_by_epoch_number_not_name(tmp_path):
    m = CheckpointManager(tmp_path, keep_last_k=2)
    for e in (9, 10, 100, 99):
        (tmp_path / f"epoch_{e}.pt").write_bytes(b"x")
    assert [p.name for p in m.list_periodic()] == ["epoch_9.pt", "epoch_10.pt", "epoch_99.pt", "epoch_100.pt"]
    m.periodic = [8, 9, 98, 99]  # the epochs (0-based) whose files this run committed
    assert [p.name for p in m._redundant(keep_newest=False)] == ["epoch_9.pt", "epoch_10.pt"]


def test_pruning_never_touches_files_this_run_did_not_commit(tiny, tmp_path):
    ck = tmp_path / "shared-checkpoints"  # a folder that already holds someone else's files
    ck.mkdir(parents=True)
    for name in ("epoch_50.pt", "epoch_77.pt", "notes.txt"):
        (ck / name).write_bytes(b"someone else's")
    _train(tiny, tmp_path, 4, [CheckpointCallback(ck, keep_last_k=1, background=False)])
    # keep_last_k=1 keeps epoch_4.pt, and the store keeps one older state besides (epoch_3.pt)
    assert sorted(p.name for p in ck.iterdir()) == [
        "best.pt", "epoch_3.pt", "epoch_4.pt", "epoch_50.pt", "epoch_77.pt", "latest.pt", "notes.txt"]
    assert all((ck / n).read_bytes() == b"someone else's" for n in ("epoch_50.pt", "epoch_77.pt", "notes.txt"))


def test_every_n_epochs_best_max_mode_and_paths(tiny, tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    cb = CheckpointCallback(ck, save_every_n_epochs=2, keep_last_k=0, monitor="neg", mode="max",
                            background=False)  # every epoch's files, in order: no state left out
    train, val = tiny.loaders(n=8, batch=8)
    model = tiny.model()
    negs = iter([0.1, 0.5, 0.3, 0.7, 0.2])

    class Metric(TrainingCallback):
        priority = 60

        def on_val_end(self, epoch):
            epoch.metrics["neg"] = next(negs)

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), train, val,
                      max_epochs=5, callbacks=[cb, Metric()], run_dir=tmp_path / "run", console_level="error",
                      default_callbacks=False)
    trainer.fit()
    events = [e["payload"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint"]
    kinds = [(e["epoch"], e["kind"]) for e in events]
    assert kinds == [(0, "epoch"), (0, "latest"), (0, "best"), (1, "periodic"), (1, "latest"), (1, "best"),
                     (2, "epoch"), (2, "latest"), (3, "periodic"), (3, "latest"), (3, "best"),
                     (4, "epoch"), (4, "latest")]
    assert sorted(p.name for p in ck.iterdir()) == ["best.pt", "epoch_2.pt", "epoch_4.pt", "latest.pt"]
    assert all(not e["path"].startswith("/") for e in events)  # relative to the run dir
    assert load_checkpoint(ck / "best.pt")["epoch"] == 4  # epoch index 3, counted from 1 in the file


def test_absolute_paths_outside_run_dir(tiny, tmp_path):
    ck = tmp_path / "elsewhere"
    _trainer, _ = _train(tiny, tmp_path, 1, [CheckpointCallback(ck)])
    events = [e["payload"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint"]
    assert events and all(e["path"] == str((ck / e["path"].rsplit("/", 1)[1]).resolve()) for e in events)


def test_dry_run_writes_nothing_and_records_intent(scripted, tmp_path):
    out = scripted([CheckpointCallback(tmp_path / "ck")], [1.0, 0.5], [1.0, 0.5], dry_run=True)
    assert not (tmp_path / "ck").exists()
    planned = [(e["payload"]["epoch"], e["payload"]["kind"]) for e in out.named("checkpoint_planned")]
    assert planned == [(0, "periodic"), (0, "best"), (0, "latest"), (1, "periodic"), (1, "best"), (1, "latest")]


def test_rng_state_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


@pytest.mark.parametrize("kwargs", [{"save_every_n_epochs": 0}, {"keep_last_k": -1}, {"mode": "best"}])
def test_bad_arguments(kwargs, tmp_path):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CheckpointCallback(tmp_path, **kwargs)


def test_history_text_reads_back_exactly():
    import math

    from fsmtrain.core.context import EpochRecord
    from fsmtrain.training.checkpoint_file import history_text, read_history

    history: list[EpochRecord] = []
    for e in range(5):
        metrics = {"train_loss": 1 / (e + 1), "val_loss": math.nan if e == 3 else 0.1 + e * 1e-17}
        got = read_history(history_text(history, e, metrics))
        assert [h["epoch"] for h in got] == list(range(e + 1))
        assert got[-1]["metrics"]["train_loss"] == metrics["train_loss"]  # bit-exact floats
        history.append(EpochRecord(e, metrics))
    assert math.isnan(read_history(history_text(history, 5, {}))[3]["metrics"]["val_loss"])
    # a resumed run's history (new records) is what is encoded
    resumed = [EpochRecord(r.epoch, {"train_loss": 9.0}) for r in history[:2]]
    assert [h["metrics"] for h in read_history(history_text(resumed, 2, {"train_loss": 1.0}))] == [
        {"train_loss": 9.0}, {"train_loss": 9.0}, {"train_loss": 1.0}]
    # older checkpoints hold the list itself
    assert read_history([{"epoch": 0, "metrics": {}}]) == [{"epoch": 0, "metrics": {}}]


def test_a_runs_checkpoints_encode_each_finished_epoch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsmtrain.core.context import EpochRecord
    from fsmtrain.training import checkpoint_file
    from fsmtrain.training.checkpoint_file import HistoryTexts, history_text

    encoded: list[int] = []
    encode = checkpoint_file._epoch_text
    monkeypatch.setattr(checkpoint_file, "_epoch_text", lambda e, m: encoded.append(e) or encode(e, m))
    history: list[EpochRecord] = []
    texts: HistoryTexts = {}
    for e in range(50):  # a checkpoint at every epoch's end
        metrics = {"train_loss": 1 / (e + 1)}
        whole = history_text(history, e, metrics)
        encoded.clear()
        assert history_text(history, e, metrics, texts) == whole
        assert encoded == [e - 1, e][e == 0:]  # the epoch finished since the last checkpoint, and this one
        history.append(EpochRecord(e, metrics))
    encoded.clear()
    history_text(history, 50, None, texts)
    history_text(history, 50, None, texts)
    assert encoded == [49]  # the last finished epoch, once; nothing else again
    encoded.clear()
    history[3] = EpochRecord(3, {"train_loss": 7.0})  # a resume replaced a record: that one is encoded again
    assert '{"epoch":3,"metrics":{"train_loss":7.0}}' in history_text(history, 50, None, texts)
    assert encoded == [3]
