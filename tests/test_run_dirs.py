"""A run directory is claimed only for a run that can start, and let go with nothing left over: no
``.lock`` stays in a finished run, a Trainer whose constructor fails releases its claim, a run that
never started leaves no folder (or one the next start reuses), and ``train`` claims (and prints
``==``) only once the config is built."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import forked_cli
import pytest
import torch
from core_helpers import make_trainer, tiny_model, tiny_task
from resume_harness import REPO, env, forked
from signal_support import wait_for
from torch import nn

from fsmtrain import Trainer, TrainingCallback
from fsmtrain.app.rundir import LOCK_FILE, RunDirError, claim_new, claim_next_free
from fsmtrain.callbacks import CheckpointCallback, EarlyStoppingCallback
from fsmtrain.core.checks import CallbackDefinitionError
from fsmtrain.core.context import EpochContext
from fsmtrain.core.events import read_events

QUICK = REPO / "configs" / "quickstart.yaml"
RUN = Path("runs") / "quickstart" / "mlp-regression-seed0"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# --- .lock lives as long as its claim -------------------------------------------------------------------
def test_a_finished_run_keeps_no_lock_and_its_claim_still_excludes_others(tmp_path: Path) -> None:
    """A finished run removes its .lock, and while it runs the lock keeps others out."""
    trainer = make_trainer(tmp_path, [CheckpointCallback(tmp_path / "checkpoints")], epochs=1)
    assert (tmp_path / LOCK_FILE).exists()
    with pytest.raises(RunDirError, match="already holds a run"):
        make_trainer(tmp_path, [], epochs=1)  # held while it lives
    trainer.fit()
    assert not (tmp_path / LOCK_FILE).exists()
    held = make_trainer(tmp_path, [], epochs=2, resume_from="latest")
    assert (tmp_path / LOCK_FILE).exists()
    with pytest.raises(RunDirError, match="in use by another running process"):
        make_trainer(tmp_path, [], epochs=2, resume_from="latest")
    held.close()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_file_removed_by_its_holder_is_not_shared_by_two_claims(tmp_path: Path) -> None:
    """A claim that opened ``.lock`` just before its holder let go (and removed it) must not think it
    holds the folder while a third claim locks the folder's new ``.lock``: it locks that one."""
    import fcntl

    from fsmtrain.app import rundir

    first = claim_new(tmp_path / "run")
    stale = os.open(tmp_path / "run" / LOCK_FILE, os.O_RDWR)  # a second claimer got this far...
    first.release()  # ...when the holder let go
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it can lock the removed file: the trap
    os.close(stale)
    again = rundir._lock(tmp_path / "run")
    other = os.open(tmp_path / "run" / LOCK_FILE, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the folder's lock is the one held
    os.close(other)
    again.release()


# --- constructor errors let the claim go ---------------------------------------------------------------
class BadHook(TrainingCallback):
    def on_val_end(self, epoch: EpochContext, extra: int) -> None:  # type: ignore[override]
        return None


def _bad(**kw: Any) -> Callable[[Path], Trainer]:
    def build(run_dir: Path) -> Trainer:
        return make_trainer(run_dir, kw.pop("callbacks", []), epochs=1, **kw)

    return build


NEW_RUN_ERRORS: dict[str, tuple[Callable[[Path], Any], type[BaseException], str]] = {
    "reserved metric name": (_bad(metrics={"val_loss": lambda p, t: p.sum()}), ValueError, "metrics named val_loss"),
    "log_level": (_bad(log_level="verbose"), ValueError, "level must be one of"),
    "console_level": (lambda d: Trainer(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1),
                                        nn.MSELoss(), tiny_task()[0], run_dir=d, console_level="loud",
                                        default_callbacks=False), ValueError, "console_level must be one of"),
    "precision": (_bad(precision="fp8"), ValueError, "precision"),
    "max_epochs": (lambda d: make_trainer(d, [], epochs=-1), ValueError, "max_epochs"),
    "not a callback": (_bad(callbacks=[object()]), TypeError, "callbacks\\[0\\] must be a TrainingCallback"),
    "hook signature": (_bad(callbacks=[BadHook()]), CallbackDefinitionError, "exactly one context"),
}


@pytest.mark.parametrize("case", list(NEW_RUN_ERRORS))
def test_each_constructor_error_releases_the_claim_and_the_retry_works(tmp_path: Path, case: str) -> None:
    """A constructor error (a reserved metric name, ...) leaves no .lock and no empty events.jsonl,
    so the retry starts instead of being refused as "already holds a run"."""
    build, error, match = NEW_RUN_ERRORS[case]
    run_dir = tmp_path / "run"
    with pytest.raises(error, match=match):
        build(run_dir)
    assert _files(tmp_path) == []  # the folder it claimed is gone again, with all it wrote
    make_trainer(run_dir, [], epochs=1).fit()  # the retry is a new run
    assert [e["event"] for e in read_events(run_dir / "events.jsonl")].count("run_start") == 1


def test_a_constructor_error_on_a_folder_the_user_made_leaves_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="metrics named val_loss"):
        make_trainer(tmp_path, [], epochs=1, metrics={"val_loss": lambda p, t: p.sum()})
    assert tmp_path.is_dir() and _files(tmp_path) == []


def _resume_errors(run_dir: Path) -> dict[str, Callable[[], Any]]:
    def with_key() -> Any:
        return make_trainer(run_dir, [], epochs=2, resume_from="latest", log_key=b"another key")

    def adam() -> Any:
        model = tiny_model()
        return Trainer(model, torch.optim.Adam(model.parameters()), nn.MSELoss(), tiny_task()[0],
                       max_epochs=2, run_dir=run_dir, resume_from="latest", default_callbacks=False)

    def not_committed() -> Any:
        return make_trainer(run_dir, [], epochs=2, resume_from=run_dir / "checkpoints" / "nope.pt")

    return {"log key": with_key, "optimizer class": adam, "checkpoint not committed": not_committed}


@pytest.mark.parametrize("case", ["log key", "optimizer class", "checkpoint not committed"])
def test_a_failed_resume_releases_the_run_and_touches_nothing(tmp_path: Path, case: str) -> None:
    make_trainer(tmp_path, [CheckpointCallback(tmp_path / "checkpoints"), EarlyStoppingCallback(patience=9)],
                 epochs=1).fit()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError):
        _resume_errors(tmp_path)[case]()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    trainer = make_trainer(tmp_path, [CheckpointCallback(tmp_path / "checkpoints")], epochs=2, resume_from="latest")
    assert trainer.fit().epochs_completed == 2


# --- a run that never started --------------------------------------------------------------------------
def test_claim_next_free_reuses_a_folder_whose_run_never_started_and_skips_a_live_one(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / "run"
    left.mkdir()
    (left / LOCK_FILE).write_text(dead.stdout)  # locked once by a process that is gone
    (left / "config.yaml").write_text("epochs: 1\n")
    (left / "events.jsonl").write_bytes(b"")
    (left / ".config.yaml.k1ll3d.tmp").write_text("epo")  # its atomic write of the config, cut short
    claim = claim_next_free(tmp_path, "run")
    assert claim.path == left and claim.cleared == (".config.yaml.k1ll3d.tmp", "config.yaml", "events.jsonl")
    assert _files(left) == [LOCK_FILE]
    other = claim_next_free(tmp_path, "run")  # the first is held now: the next name
    assert other.path == tmp_path / "run-2"
    claim.let_go()
    other.let_go()
    assert _files(tmp_path) == []  # neither run started: both folders went


def test_claim_next_free_never_takes_a_folder_another_process_just_made(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()  # made by a concurrent claim that has not locked it yet
    claim = claim_next_free(tmp_path, "run")
    assert claim.path == tmp_path / "run-2"
    claim.let_go()


def test_a_started_run_is_never_reused(tmp_path: Path) -> None:
    make_trainer(tmp_path / "run", [], epochs=1).fit()
    claim = claim_next_free(tmp_path, "run")
    assert claim.path == tmp_path / "run-2"
    claim.let_go()
    with pytest.raises(RunDirError, match="already holds a run"):
        claim_new(tmp_path / "run")


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return forked_cli.run(["train", str(QUICK), *args], cwd, env(), timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_start_killed_before_the_run_began_is_continued_in_the_same_folder(tmp_path: Path) -> None:
    """A `kill -9` between the claim and ``run_start`` leaves a folder no process can tidy; the next
    ``train`` reuses it (and says so) instead of creating ``-seed0-2``, as does ``train --resume``."""
    sets = ["--set", "epochs=1", "--set", "wandb.enabled=false", "--set", "data_config.n_samples=256"]
    slow = ["--set", "callbacks.extra=[{target: signal_support.SlowStart, kwargs: {seconds: 8}}]"]
    for extra in ([], ["--resume"]):
        work = tmp_path / ("resume" if extra else "train")
        work.mkdir()
        proc = forked("train", str(QUICK), *sets, *slow, cwd=work)
        wait_for(lambda work=work: (work / RUN / "config.yaml").exists(), proc)  # claimed; its callbacks build
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _files(work / RUN) == [LOCK_FILE, "config.yaml"] or (work / RUN / ".lock").exists()
        done = _train(*sets, *extra, cwd=work)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "reusing the folder of a run that never started" in done.stdout
        assert sorted(p.name for p in (work / "runs" / "quickstart").iterdir()) == ["mlp-regression-seed0"]
        start = next(e for e in read_events(work / RUN / "events.jsonl") if e["event"] == "run_start")
        assert "config.yaml" in start["payload"]["reused_run_dir"]
        assert not (work / RUN / LOCK_FILE).exists()


@pytest.mark.timeout(300)
def test_train_claims_and_announces_only_a_config_it_can_build(tmp_path: Path) -> None:
    """`train` prints `== … -> runs/…` only for a config it can build, not before refusing one (exit 2)."""
    bad = _train("--set", "optimizer_config.betas=[0.9]", "--set", "epochs=1", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "optimizer_config" in bad.stderr and "==" not in bad.stdout
    assert not (tmp_path / "runs").exists()
