"""Runs survive what real jobs meet: exact resume after SIGKILL and SIGTERM, damaged
checkpoints refused, one run per directory, clear errors for bad run directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import torch
from core_helpers import make_trainer, tiny_model
from resume_harness import REPO, env, forked, random_kills, run_with_kills, same_weights

from fsmtrain.app.rundir import RunDirError
from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback
from fsmtrain.core.context import EpochContext
from fsmtrain.core.engine import Interrupted
from fsmtrain.core.events import read_events
from fsmtrain.core.hooks import TrainingCallback
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.checkpoint import CheckpointError, load_checkpoint
from fsmtrain.training.resume import find_resumption

QUICK = REPO / "configs" / "quickstart.yaml"
# The harness kills many processes: W&B's start-up (seconds per process) is left out here; the
# SIGTERM test below runs with it.
FAST = ("epochs=12", "wandb.enabled=false", "checkpoint.keep_last_k=1")
# Kills aimed at a checkpoint write wait for its temp file: a wider MLP (3 MB checkpoints) keeps the
# write (and its fsync) open long enough for the harness to see it on a loaded machine; with the
# quickstart's 50 KB files a kill could wait many epochs for one and the run would end first.
KILLED = (*FAST, "net_config.hidden=[512,512]")
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


def _reference(tmp: Path, *overrides: str, config: Path = QUICK) -> Path:
    ref = tmp / "reference"
    ref.mkdir()
    proc = forked("train", str(config), *[a for o in overrides for a in ("--set", o)], cwd=ref)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    return ref / RUN / "model.pt"


def _audit_ok(run_dir: Path) -> None:
    report = audit_file(run_dir / "events.jsonl")
    assert report.ok, report.render(False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_then_resume_ends_bit_identical(tmp_path: Path) -> None:
    expected = _reference(tmp_path, *KILLED)
    work = tmp_path / "killed"
    work.mkdir()
    kills = random_kills(8, seed=int(os.environ.get("FSMTRAIN_KILL_SEED", "7")))
    report = run_with_kills(QUICK, work, work / RUN, kills, *KILLED)
    assert len(report.kills) >= 6, report.kills  # most kills landed before the run could finish
    assert any("during a checkpoint write" in k for k in report.kills), report.kills
    assert same_weights(work / RUN / "model.pt", expected)
    _audit_ok(work / RUN)
    resumes = [e for e in read_events(work / RUN / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) >= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_negative_control_without_the_data_order_restore_the_weights_differ(tmp_path: Path) -> None:
    """The same harness, with a loader whose shuffle generator the trainer cannot see: the
    comparison must fail, or the harness could not tell an exact resume from a lucky one."""
    opaque = tmp_path / "opaque.yaml"
    opaque.write_text(QUICK.read_text().replace("fsmtrain.training.data.synthetic_regression",
                                                "opaque_data.opaque_regression"))
    expected = _reference(tmp_path, *FAST, config=opaque)
    work = tmp_path / "killed"
    work.mkdir()
    report = run_with_kills(opaque, work, work / RUN, random_kills(2, seed=3), *FAST)
    assert report.kills
    assert not same_weights(work / RUN / "model.pt", expected)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_mid_epoch_exits_143_with_a_complete_record_and_resumes_exactly(tmp_path: Path) -> None:
    overrides = ("epochs=6",)  # W&B on, offline
    expected = _reference(tmp_path, *overrides)
    work = tmp_path / "term"
    work.mkdir()
    run = work / RUN
    proc = forked("train", str(QUICK), "--set", "epochs=6", cwd=work)
    deadline = time.monotonic() + 240
    while (run / "events.jsonl").read_bytes().count(b'"event":"epoch"') < 2 if (run / "events.jsonl").exists() \
            else True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()[-3000:]
        time.sleep(0.01)
    time.sleep(0.05)  # mid-epoch
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err.decode()[-3000:]
    assert "Traceback" not in err.decode()
    assert f"fsmtrain resume {RUN}" in out.decode()
    events = read_events(run / "events.jsonl")
    end = [e for e in events if e["event"] == "transition" and e["to"] == "train_end"]
    assert end[-1]["payload"]["reason"] == "interrupted" and events[-1]["event"] == "result"
    _audit_ok(run)
    logged = [(e["global_step"], e["epoch"] + 1) for e in events if e["event"] == "epoch"]  # W&B: step, epoch from 1
    from callbacks_wandb_history import wandb_history  # the offline run's own record file

    files = sorted(str(f.relative_to(run)) for f in (run / "wandb").rglob("*"))
    assert any(f.endswith(".wandb") for f in files), files
    # every epoch logged before the signal, at its global step
    assert [(row["_step"], row["epoch"]) for row in wandb_history(run)] == logged
    replay = forked_cli.run(["replay", str(RUN)], work, env(), timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr  # the interruption it recorded is no divergence
    proc = forked("resume", str(RUN), cwd=work)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert same_weights(run / "model.pt", expected)
    _audit_ok(run)
    w_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(w_runs) == 2 and len({d.name.split("-", 3)[-1] for d in w_runs}) == 1, w_runs  # one W&B run id
    replay = forked_cli.run(["replay", str(RUN)], work, env(), timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr


def _fit(tmp: Path, epochs: int, lr: float = 0.05, **kw: Any) -> Any:
    trainer = make_trainer(tmp, [CheckpointCallback(tmp / "checkpoints", keep_last_k=1),
                                 EarlyStoppingCallback(patience=50)], epochs=epochs,
                           model=tiny_model(), **kw)
    opt = trainer.optimizer
    for group in opt.param_groups:
        group["lr"] = lr
    trainer.fit()
    return trainer


def test_resume_at_an_epoch_end_in_python_is_exact_even_with_another_lr(tmp_path: Path) -> None:
    full = _fit(tmp_path / "full", 6)
    _fit(tmp_path / "part", 3)
    # Built with a different learning rate: only the restored optimizer state gives the same end.
    resumed = _fit(tmp_path / "part", 6, lr=0.5, resume_from="latest")
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    events = read_events(tmp_path / "part" / "events.jsonl")
    assert [e["event"] for e in events].count("run_start") == 2
    assert [e["payload"]["next_epoch"] for e in events if e["event"] == "resume"] == [3]
    _audit_ok(tmp_path / "part")


class _SignalAfterValidation(TrainingCallback):
    """A SIGTERM that arrives as epoch ``at``'s last validation ends, after every other on_val_end."""

    priority = 99

    def __init__(self, at: int) -> None:
        self.at = at

    def on_val_end(self, epoch: EpochContext) -> None:
        if epoch.index == self.at:
            epoch.run.pending_signal = signal.SIGTERM


def _waits(run_dir: Path) -> list[Any]:
    return [e["payload"]["slots"].get("early_stopping_wait") for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "epoch"]


@pytest.mark.parametrize("save_latest", [True, False])
def test_a_signal_during_an_epochs_last_validation_ends_the_epoch_and_resume_does_not_validate_it_again(
        tmp_path: Path, save_latest: bool) -> None:
    def fit(tmp: Path, at: int, **kw: Any) -> Any:
        callbacks = [CheckpointCallback(tmp / "checkpoints", keep_last_k=1, save_latest=save_latest,
                                        save_every_n_epochs=5),
                     EarlyStoppingCallback(patience=50, min_delta=0.0), _SignalAfterValidation(at)]
        trainer = make_trainer(tmp, callbacks, epochs=6, model=tiny_model(), **kw)
        trainer.fit()
        return trainer

    full = fit(tmp_path / "full", -1)
    with pytest.raises(Interrupted):
        fit(tmp_path / "part", 2)
    events = read_events(tmp_path / "part" / "events.jsonl")
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [0, 1, 2]  # the signalled epoch ended
    assert next(e for e in events if e["event"] == "exception")["phase"] == "epoch_end"
    assert [e["payload"]["epoch"] for e in events if e["event"] == "checkpoint"][-1] == 2  # and was saved
    resumed = fit(tmp_path / "part", -1, resume_from="latest")
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the resumed run went on with epoch 4: early stopping counted each validation once
    assert _waits(tmp_path / "part") == _waits(tmp_path / "full")
    assert not audit_file(tmp_path / "part" / "events.jsonl").violations


def test_a_finished_run_resumed_without_more_epochs_ends_at_once(tmp_path: Path) -> None:
    _fit(tmp_path, 2)
    trainer = _fit(tmp_path, 2, resume_from="latest")
    moves = [(e["from"], e["to"]) for e in read_events(tmp_path / "events.jsonl")
             if e["event"] == "transition"][-2:]
    assert moves == [("created", "train_begin"), ("train_begin", "train_end")]
    assert trainer.engine.result is not None and trainer.engine.result.epochs_completed == 2


def test_two_trainers_on_one_run_dir_the_second_is_refused(tmp_path: Path) -> None:
    first = make_trainer(tmp_path, [CheckpointCallback(tmp_path / "checkpoints")], epochs=1)
    with pytest.raises(RunDirError, match=rf"run directory {tmp_path} already holds a run .*resume_from"):
        make_trainer(tmp_path, [], epochs=1)
    first.fit()
    held = make_trainer(tmp_path, [], epochs=2, resume_from="latest")  # a live resume holds the lock
    with pytest.raises(RunDirError, match="in use by another running process"):
        make_trainer(tmp_path, [], epochs=2, resume_from="latest")
    held.close()
    with pytest.raises(RunDirError, match=r"already holds a run \(events.jsonl\); continue it with resume_from"):
        make_trainer(tmp_path, [], epochs=1)


# --- damaged checkpoints ---------------------------------------------------------------------------
@pytest.fixture
def committed(tmp_path: Path) -> Path:
    make_trainer(tmp_path, [CheckpointCallback(tmp_path / "checkpoints")], epochs=2).fit()
    return tmp_path / "checkpoints" / "latest.pt"


def test_a_one_byte_flip_is_refused_with_both_digests(committed: Path) -> None:
    data = bytearray(committed.read_bytes())
    data[len(data) // 2] ^= 0x01
    committed.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"latest\.pt does not match its committed sha256: the log recorded "
                                              r"[0-9a-f]{64}, the file has [0-9a-f]{64}"):
        load_checkpoint(committed)


def test_a_truncated_file_is_refused(committed: Path) -> None:
    committed.write_bytes(committed.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="does not match its committed sha256"):
        load_checkpoint(committed)
    with pytest.raises(CheckpointError, match=r"is corrupt or truncated \(1000 bytes\)"):
        _load_unrecorded(committed)


def _load_unrecorded(path: Path) -> Any:
    copy = path.parent.parent.parent / "copy.pt"  # outside the run: no log records it
    copy.write_bytes(path.read_bytes())
    return load_checkpoint(copy)


class _Code:
    def __reduce__(self) -> Any:
        return (os.system, ("echo this must never run",))


def test_a_pickle_payload_says_it_contains_code_and_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "model": _Code()}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert "contains code" in message and "was not loaded" in message
    assert "weights_only" not in message and "corrupt" not in message


def test_resume_skips_a_damaged_newest_checkpoint_and_removes_uncommitted_files(tmp_path: Path) -> None:
    _fit(tmp_path, 3)
    ck = tmp_path / "checkpoints"
    (ck / ".latest.pt.123.tmp").write_bytes(b"half a write")
    (ck / "epoch_9.pt").write_bytes(b"renamed into place, never committed")
    res = find_resumption(tmp_path)
    assert res.next_epoch == 3
    assert sorted(res.removed) == ["checkpoints/.latest.pt.123.tmp", "checkpoints/epoch_9.pt"]


# --- one run, one directory; bad run directories ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_identical_commands_started_together_get_four_run_dirs(tmp_path: Path) -> None:
    lrs = ["0.001", "0.002", "0.003", "0.004"]
    procs = [forked("train", str(QUICK), "--set", "epochs=2", "--set", "wandb.enabled=false",
                      "--set", f"optimizer_config.lr={lr}", cwd=tmp_path) for lr in lrs]
    for p in procs:
        _, err = p.communicate(timeout=400)
        assert p.returncode == 0, err.decode()[-3000:]
    dirs = sorted((tmp_path / "runs" / "quickstart").iterdir())
    assert [d.name for d in dirs] == ["mlp-regression-seed0", *(f"mlp-regression-seed0-{n}" for n in (2, 3, 4))]
    seen = set()
    for d in dirs:
        _audit_ok(d)
        import yaml

        cfg_lr = yaml.safe_load((d / "config.yaml").read_text())["optimizer_config"]["lr"]
        logged = json.loads((d / "events.jsonl").read_text().splitlines()[0])["payload"]["config"]
        first_lr = next(e for e in read_events(d / "events.jsonl") if e["event"] == "epoch")["payload"]["metrics"]["lr"]
        assert cfg_lr == logged["optimizer_config"]["lr"] == pytest.approx(first_lr)  # the file describes the run
        seen.add(cfg_lr)
    assert len(seen) == 4


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return forked_cli.run(list(args), cwd, env(), timeout=120)


@pytest.mark.parametrize("name", ["../x", "a/b", ".."])
def test_a_run_name_that_climbs_out_is_refused(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(QUICK.read_text().replace("name: mlp-regression", f"name: {json.dumps(name)}"))
    for command in ("validate", "train"):
        res = _cli(command, str(cfg), cwd=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "name" in res.stderr and "single folder name" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()


def test_run_dir_pointing_at_a_file_and_an_unwritable_parent(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = _cli("train", str(QUICK), "--run-dir", str(afile), cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "is a file, not a folder" in res.stderr and "Traceback" not in res.stderr
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        # root writes through permissions, so as root the parent is /proc, where nobody can create folders
        target = "/proc/fsmtrain-runs" if os.geteuid() == 0 else str(locked / "runs")
        res = _cli("train", str(QUICK), "--run-dir", target, cwd=tmp_path)
    finally:
        locked.chmod(0o700)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "cannot create run directory" in res.stderr and "Traceback" not in res.stderr


def _train_one_epoch(work: Path) -> None:
    proc = forked("train", str(QUICK), *[a for o in ("epochs=1", "wandb.enabled=false") for a in ("--set", o)],
                    cwd=work)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_refuses_a_changed_seed_or_lr_naming_the_field_and_keeps_config_yaml(tmp_path: Path) -> None:
    """`fsmtrain resume RUN --set seeds=[5]` is refused, naming the field, and config.yaml stays as it was."""
    _train_one_epoch(tmp_path)
    config = (tmp_path / RUN / "config.yaml").read_bytes()
    events = (tmp_path / RUN / "events.jsonl").read_bytes()
    for change, named in (("seeds=[5]", "seeds ([5] leaves out seed 0"),
                          ("optimizer_config.lr=0.5", "optimizer_config.lr (0.003 -> 0.5)")):
        proc = forked("resume", str(RUN), "--set", "epochs=2", "--set", change, cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        text = out.decode() + err.decode()
        assert proc.returncode == 2, text
        assert named in text and "Traceback" not in text, text
        assert (tmp_path / RUN / "config.yaml").read_bytes() == config
        assert (tmp_path / RUN / "events.jsonl").read_bytes() == events
    proc = forked("resume", str(RUN), "--set", "epochs=2", "--set", "seeds=[0,5]", cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]  # a seed added beside this run's own is no change to it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_of_a_run_dir_whose_log_is_gone_or_garbage_is_a_one_line_error(tmp_path: Path) -> None:
    """A missing or binary events.jsonl is a one-line error, not a traceback."""
    import shutil

    _train_one_epoch(tmp_path)
    cases = {"gone": None, "binary": bytes(range(256)) * 2, "no run_start": b'{"event": "epoch"}\n'}
    for name, content in cases.items():
        run = tmp_path / name
        shutil.copytree(tmp_path / RUN, run)
        log = run / "events.jsonl"
        if content is None:
            log.unlink()
        else:
            log.write_bytes(content)
        before = sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file())
        proc = forked("resume", str(run), "--set", "epochs=2", cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        text = out.decode() + err.decode()
        assert proc.returncode == 2 and "Traceback" not in text, (name, text)
        assert str(run) in text and ("no events.jsonl" in text if content is None else "no run_start" in text), text
        assert sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file()) == before
