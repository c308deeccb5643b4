"""A kill between a checkpoint's commit and its role links is an interrupted commit, not damage.

The run is killed (SIGKILL, from a wrapper around ``os.replace`` in the training process) right
after the n-th move of ``latest.pt`` or ``best.pt``. The resume must call nothing damaged, lose no
file, keep a ``best.pt`` the log commits, and end with the weights of an uninterrupted run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import tiny_model, tiny_task
from resume_harness import env
from torch import nn

from fsmtrain import Trainer
from fsmtrain.callbacks import CheckpointCallback
from fsmtrain.core.events import read_events
from fsmtrain.core.ledger import committed_checkpoints
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.checkpoint import load_checkpoint, sha256_of

EPOCHS = 4

# The training process: the test's own Trainer, with os.replace wrapped to SIGKILL the process
# right after the n-th replace whose target is a role link.
_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import test_commit_window as t

    run_dir, kill_after = Path(sys.argv[1]), int(sys.argv[2])
    real_replace, moves = os.replace, [0]

    def replace(src, dst, **kw):
        real_replace(src, dst, **kw)
        if os.path.basename(dst) in ("latest.pt", "best.pt"):
            moves[0] += 1
            if moves[0] == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
    t.trainer(run_dir).fit()
""")


def trainer(run_dir: Path, **kw: Any) -> Trainer:
    """The run under test: foreground writes, so every epoch's state is written, with keep_last_k 1."""
    torch.set_num_threads(1)
    model = tiny_model(0)
    train, val = tiny_task(0)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss(), train, val,
                   max_epochs=EPOCHS, run_dir=run_dir, console_level="warning", default_callbacks=False,
                   callbacks=[CheckpointCallback(run_dir / "checkpoints", keep_last_k=1, background=False)], **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], int]:
    """The weights of a run never killed, and the epoch its best.pt holds."""
    run = tmp_path_factory.mktemp("whole") / "run"
    whole = trainer(run)
    whole.fit()
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    return {k: v.clone() for k, v in whole.model.state_dict().items()}, int(best["epoch"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill_after", [1, 2, 3, 4, 6])
def test_a_kill_right_after_a_role_link_moves_resumes_with_nothing_damaged_or_lost(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], uninterrupted: tuple[dict[str, torch.Tensor], int],
        kill_after: int) -> None:
    """Killed right after the n-th move of latest.pt/best.pt, then resumed: no checkpoint_damaged,
    nothing set aside, every committed file still there with its bytes, a committed best.pt of the
    best epoch, and the uninterrupted run's weights."""
    weights, best_epoch = uninterrupted
    run = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    child = subprocess.run([sys.executable, str(script), str(run), str(kill_after)], env=env(), capture_output=True,
                           text=True, timeout=180)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    before = committed_checkpoints(run / "events.jsonl")
    capfd.readouterr()

    resumed = trainer(run, resume_from="latest")
    resumed.fit()

    err = capfd.readouterr().err
    assert "checkpoint_damaged" not in err, err
    events = read_events(run / "events.jsonl")
    assert not [e for e in events if e["event"] == "checkpoint_damaged"]
    completed = [e["payload"] for e in events if e["event"] == "warning" and "completed" in e["payload"]]
    assert len(completed) == 1 and "was cut short" in err, err  # the interrupted commit is finished, and said
    resume = next(e["payload"] for e in events if e["event"] == "resume")
    assert resume["removed"] == [] and "uncommitted_moved_to" not in resume, resume
    ck = run / "checkpoints"
    assert not (ck / "damaged").exists() and not (ck / "uncommitted").exists()
    removed = {e["payload"]["path"] for e in events if e["event"] == "checkpoint_removed"}
    live = committed_checkpoints(run / "events.jsonl")
    for shown in before:  # no file lost: each is still committed, or its removal was logged
        assert shown in live or shown in removed, shown
    for shown, done in live.items():
        assert sha256_of(run / shown) == done.sha256, shown
    assert "checkpoints/best.pt" in live and live["checkpoints/best.pt"].kind == "best"
    assert int(load_checkpoint(ck / "best.pt")["epoch"]) == best_epoch
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(weights[name], value), name
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render()
